"""Issue 24's case 1 end to end: `kill -9` of Snakemake while it runs a tiny pretrain, then what the docs say
(`snakemake --unlock`, run again). The orphaned stage must die with its Snakemake (dormouse/core/lifeline.py),
the rerun must resume from the checkpoint and publish the artifact, and no finished manifest may be lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pipeline_util import configure
from test_pretrain import TINY_MODEL, TINY_TRAIN, set_model
from test_workflow import BIN, snakemake

pytestmark = pytest.mark.skipif(os.environ.get("DORMOUSE_SLOW_TESTS") != "1",
                                reason="slow; set DORMOUSE_SLOW_TESTS=1 (make test-all)")


def stage_pids(digest: str) -> list[int]:
    """Live processes whose command line names this pretrain job (the stage, its gpu-run, its shell)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if digest.encode() in cmd and b"pretrain" in cmd and b"snakemake" not in cmd:
                out.append(int(d.name))
    return out


def test_kill_9_of_snakemake_mid_pretrain_then_unlock_and_rerun(workdir, small_corpus, quality_examples):
    configure(workdir, small_corpus, *quality_examples)
    set_model(workdir, TINY_MODEL, {**TINY_TRAIN, "steps": 400, "ckpt_every": 10, "eval_every": 200})
    snakemake(workdir, "results/tiny/anchors.json")  # the data stages first: the kill lands in pretrain
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.Popen([str(BIN / "snakemake"), "--cores", "2", "results/tiny/pretrain.json"], cwd=workdir,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scratch = workdir / "results" / "scratch" / "pretrain"
    deadline = time.monotonic() + 300
    while not list(scratch.glob("*/step-*/snapshot.json")):
        assert proc.poll() is None, "snakemake ended before the first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    digest = next(scratch.iterdir()).name
    assert stage_pids(digest), "no pretrain process to orphan"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while stage_pids(digest):  # the lifeline: the stage stops within seconds of its Snakemake
        assert time.monotonic() < deadline, f"orphans still running: {stage_pids(digest)}"
        time.sleep(0.2)
    art = workdir / "results" / "store" / "pretrain" / digest
    assert not (art / "manifest.json").exists()  # nothing that looks finished
    snakemake(workdir, "--unlock", "results/tiny/pretrain.json")
    snakemake(workdir, "results/tiny/pretrain.json")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["counters"]["resumed_from_step"] >= 10 and manifest["counters"]["train.steps"] == 400
    dry = snakemake(workdir, "-n", "results/tiny/pretrain.json")
    assert "Nothing to be done" in dry.stdout + dry.stderr  # and it stays finished
