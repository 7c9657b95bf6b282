"""Faults under Snakemake itself (issue 24): a store path with a space and a `;`, an identical rebuild that
reruns nothing, a failed rerun that keeps the finished manifest, and `dormouse verify`. One build, then each
test in order on it."""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from pipeline_util import configure
from test_workflow import BIN, snakemake

STORE = "results/my store;echo INJECTED"  # a space, and a `;` that would run as shell unquoted


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_corpus, quality_examples):
    wd = tmp_path_factory.mktemp("wf")
    for name in ("Snakefile", "profiles", "workflow", "config", "envs", "requirements.txt"):
        src = REPO / name
        if src.is_symlink():
            (wd / name).symlink_to(src.readlink())
        else:
            (shutil.copytree if src.is_dir() else shutil.copy)(src, wd / name)
    (wd / "corpus" / "demo").mkdir(parents=True)
    configure(wd, small_corpus, *quality_examples)
    config = wd / "config" / "config.yaml"
    config.write_text(re.sub(r"(?m)^store:.*$", f"store: {json.dumps(STORE)}", config.read_text()))
    snakemake(wd, "results/tiny/anchors.json")
    return wd


def artifact(wd: Path, stage: str) -> Path:
    (path,) = [p.parent for p in (wd / STORE / stage).glob("*/manifest.json")]
    return path


def dormouse(wd: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run([str(BIN / "dormouse"), *args], cwd=wd, env=env, capture_output=True, text=True, timeout=300)


def test_store_path_with_space_and_semicolon_is_quoted(built):
    view = json.loads((built / "results" / "tiny" / "anchors.json").read_text())
    assert view["ladder"][0]["bpb"] == 8.0
    assert (built / STORE / "anchors").is_dir() and not (built / "results" / "my").exists()
    logs = [p.read_text() for p in (built / "results" / "logs").rglob("*.log")]
    assert logs and not any(line == "INJECTED" for text in logs for line in text.splitlines())


def test_identical_rebuild_reruns_nothing(built):
    filt = artifact(built, "filter")
    job = filt.parent.parent.parent / "job.json"
    job.write_text(dormouse(built, "plan", "--preset", "tiny", "--stage", "filter").stdout)
    old = json.loads((filt / "manifest.json").read_text())
    shutil.rmtree(filt)  # lost, then rebuilt by hand with the same digest (a newer, different manifest)
    assert dormouse(built, "filter", "--job", f"@{job}").returncode == 0
    assert json.loads((filt / "manifest.json").read_text())["created_unix"] >= old["created_unix"]
    dry = snakemake(built, "-n", "results/tiny/anchors.json")
    assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout


def test_failed_rerun_keeps_the_finished_manifest(built):
    anchors = artifact(built, "anchors")
    before = json.loads((anchors / "manifest.json").read_text())
    name = sorted(before["files"])[0]
    good = (anchors / name).read_bytes()
    (anchors / name).write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # a flipped bit in a finished artifact
    failed = snakemake(built, "--forcerun", "anchors", "results/tiny/anchors.json", check=False)
    assert failed.returncode != 0
    assert json.loads((anchors / ".manifest.json").read_text()) == before  # the record survives Snakemake's cleanup
    log = next((built / "results" / "logs" / "anchors").glob("*.log")).read_text()
    assert name in log and "no longer match" in log
    verify = dormouse(built, "verify", "--preset", "tiny")
    assert verify.returncode != 0 and f"anchors/{anchors.name}/{name}: altered" in verify.stdout, verify.stdout + verify.stderr
    (anchors / name).write_bytes(good)  # put right: the rerun relinks the manifest and recomputes nothing
    snakemake(built, str((anchors / "manifest.json").relative_to(built)))
    assert json.loads((anchors / "manifest.json").read_text()) == before
    assert (anchors / "manifest.json").stat().st_ino == (anchors / ".manifest.json").stat().st_ino
    assert dormouse(built, "verify", "--preset", "tiny").returncode == 0


def test_verify_names_a_chain_artifact_moved_away_under_one_built_on_it(built):
    """`verify --preset` once said "0 problems" with the preset's shard moved out of the store."""
    shard = artifact(built, "shard")
    away = shard.parent / f".moved-{shard.name}"
    shard.rename(away)
    try:
        verify = dormouse(built, "verify", "--preset", "tiny")
        assert verify.returncode == 1 and f"shard/{shard.name}: missing, while anchors" in verify.stdout, verify.stdout
        # its advice holds: Snakemake plans nothing for the preset's views, and the shard for the named target
        dry = snakemake(built, "-n", "results/tiny/anchors.json")
        assert "Nothing to be done" in dry.stdout + dry.stderr
        target = f"{STORE}/shard/{shard.name}/manifest.json"
        assert f"snakemake {shlex.quote(target)}" in verify.stdout, verify.stdout
        dry = snakemake(built, "-n", target)
        assert "rule shard:" in dry.stdout + dry.stderr
    finally:
        away.rename(shard)
    assert dormouse(built, "verify", "--preset", "tiny").returncode == 0
