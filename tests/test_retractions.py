"""Retractions rebuild exactly what they invalidate, proven with Snakemake's own scheduler."""

import json
import os
import subprocess

import pytest
import yaml
from pipeline_util import configure
from test_workflow import BIN, job_counts, snakemake

from dormouse.core.config import ConfigError
from dormouse.planner.plan import build_plan

ENTRY = {"id": "R-test-1", "date": "2026-12-02", "stage": "shard", "match": {"num_shards": 5},
         "reason": "routing defect in shards of the 5-way preset", "fixed_in": "abc123"}


@pytest.fixture()
def two_presets(workdir, small_corpus, quality_examples):
    """tiny and small differ in one key: data.shard.num_shards (5 vs 3)."""
    configure(workdir, small_corpus, *quality_examples, presets=("tiny", "small"))
    tiny = workdir / "config" / "presets" / "tiny.yaml"
    tiny.write_text(tiny.read_text().replace("num_shards: 3", "num_shards: 5"))
    ledger(workdir, [])  # the mechanism under test, apart from the project's own entries (R005 retracts every shard)
    return workdir


def ledger(workdir, entries):
    (workdir / "config" / "retractions.yaml").write_text(yaml.safe_dump(entries))


def dormouse(workdir, *args):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run([str(BIN / "dormouse"), *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_retraction_schedules_exactly_the_matched_stage_and_downstream(two_presets):
    targets = ["results/tiny/anchors.json", "results/small/anchors.json"]
    snakemake(two_presets, *targets)
    before = {p: json.loads((two_presets / f"results/{p}/anchors.json").read_text()) for p in ("tiny", "small")}

    ledger(two_presets, [ENTRY])
    out = snakemake(two_presets, "-n", *targets).stdout
    assert job_counts(out) == {"shard": 1, "anchors": 1, "anchors_view": 1, "total": 3}, out
    views = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("output: results/") and "/store/" not in line]
    assert views == ["results/tiny/anchors.json"], views

    snakemake(two_presets, *targets)
    tiny = json.loads((two_presets / "results/tiny/anchors.json").read_text())
    small = json.loads((two_presets / "results/small/anchors.json").read_text())
    assert tiny["retractions_applied"] == ["R-test-1"] and small == before["small"]
    chain = {link["stage"]: link["digest"] for link in tiny["digest_chain"]}
    old = {link["stage"]: link["digest"] for link in before["tiny"]["digest_chain"]}
    assert chain["filter"] == old["filter"] and chain["shard"] != old["shard"] and chain["anchors"] != old["anchors"]

    audit = json.loads(dormouse(two_presets, "retractions", "--json"))
    (entry,) = audit
    assert entry["hits"] == [{"preset": "tiny", "stage": "shard", "digest": chain["shard"]}]
    pairs = {(s["stage"], s["old"], s["new"]) for s in entry["superseded"]}
    assert pairs == {("shard", old["shard"], chain["shard"]), ("anchors", old["anchors"], chain["anchors"])}
    text = dormouse(two_presets, "retractions", "--preset", "tiny")
    assert f"superseded shard    {old['shard']} -> {chain['shard']} (matched)" in text

    # Removing the entry returns the old digests: old artifacts are reused, only the tiny view re-points.
    ledger(two_presets, [])
    out = snakemake(two_presets, "-n", *targets).stdout
    assert job_counts(out) == {"anchors_view": 1, "total": 1}, out


def test_match_on_a_list_of_values_and_empty_match(two_presets):
    config = yaml.safe_load((two_presets / "config" / "config.yaml").read_text())
    ledger(two_presets, [{**ENTRY, "match": {"num_shards": [3, 5]}}])
    plan = build_plan(config, two_presets)
    assert all(plan.job("shard", plan.chain[p]["shard"]).retractions == ["R-test-1"] for p in ("tiny", "small"))
    ledger(two_presets, [{**ENTRY, "stage": "filter", "match": {}}])
    plan = build_plan(config, two_presets)
    assert plan.job("filter", plan.chain["tiny"]["filter"]).retractions == ["R-test-1"]
    assert plan.job("shard", plan.chain["tiny"]["shard"]).retractions == []


def test_a_match_key_that_no_job_has_is_refused(two_presets):
    config = yaml.safe_load((two_presets / "config" / "config.yaml").read_text())
    ledger(two_presets, [{**ENTRY, "match": {"num_shard": 5}}])
    with pytest.raises(ConfigError, match=r"R-test-1: \['num_shard'\] not among the params of stage 'shard'"):
        build_plan(config, two_presets)
    ledger(two_presets, [{**ENTRY, "date": "yesterday"}])
    with pytest.raises(ConfigError, match="0.date"):
        build_plan(config, two_presets)


def test_every_stage_can_be_retracted():
    from pathlib import Path

    from dormouse.planner.registry import STAGES

    schema = yaml.safe_load((Path(__file__).resolve().parent.parent / "dormouse/schemas/retractions.schema.yaml").read_text())
    assert schema["items"]["properties"]["stage"]["enum"] == list(STAGES)
