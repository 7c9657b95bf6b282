"""A job killed mid-way leaves nothing that looks finished, and the next run recovers by itself."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pipeline_util import configure
from test_workflow import BIN, snakemake

pytestmark = pytest.mark.slow


def stage_pids(workdir: Path, stage: str) -> list[int]:
    """Processes running `dormouse <stage>` with cwd = workdir (other tests may run the same stage)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if any(a.endswith(b"dormouse") for a in argv) and stage.encode() in argv and cwd == str(workdir):
            pids.append(int(proc.name))
    return pids


def start_and_wait_for_filter_tmp(workdir: Path):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.Popen([str(BIN / "snakemake"), "--cores", "1", "results/tiny/anchors.json"], cwd=workdir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    store = workdir / "results" / "store" / "filter"
    while time.monotonic() < deadline:
        if store.exists() and list(store.glob(".*.tmp-*")) and stage_pids(workdir, "filter"):
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the filter job never started")


@pytest.fixture()
def wf(workdir, small_corpus, quality_examples):
    configure(workdir, small_corpus, *quality_examples)
    return workdir


def test_killed_stage_process_is_rerun_without_manual_cleanup(wf):
    proc = start_and_wait_for_filter_tmp(wf)
    for pid in stage_pids(wf, "filter"):
        os.kill(pid, signal.SIGKILL)  # e.g. the OOM killer
    assert proc.wait(timeout=120) != 0
    assert not list((wf / "results" / "store").rglob("manifest.json"))  # nothing looks finished
    snakemake(wf, "results/tiny/anchors.json")
    assert (wf / "results" / "tiny" / "anchors.json").exists()


def test_killed_snakemake_needs_only_unlock(wf):
    proc = start_and_wait_for_filter_tmp(wf)
    os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its jobs, no cleanup at all
    proc.wait(timeout=60)
    assert not list((wf / "results" / "store").rglob("manifest.json"))
    assert list((wf / "results" / "store" / "filter").glob(".*.tmp-*"))  # the half-written artifact
    locked = snakemake(wf, "results/tiny/anchors.json", check=False)
    assert locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr
    snakemake(wf, "--unlock")
    snakemake(wf, "results/tiny/anchors.json")
    filt = next((wf / "results" / "store" / "filter").glob("*/manifest.json"))
    assert '"store.stale_tmp_dirs_removed": 1' in filt.read_text()
    assert not list((wf / "results" / "store" / "filter").glob(".*.tmp-*"))
