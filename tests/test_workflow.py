"""The workflow under Snakemake itself: lint, dry runs of every preset, and a real run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_util import configure

ROOT = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent


def snakemake(workdir, *args, check=True):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run([str(BIN / "snakemake"), "--cores", "2", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture()
def fixture_workflow(workdir, small_corpus, quality_examples):
    configure(workdir, small_corpus, *quality_examples, presets=("tiny", "small", "medium", "b1"))
    return workdir


def test_lint_is_clean(fixture_workflow):
    proc = snakemake(fixture_workflow, "--lint", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations, your workflow is in a good condition!" in proc.stdout + proc.stderr


def test_dry_run_of_every_preset_plans_shared_artifacts(fixture_workflow):
    # The fixture gives every preset the same data params; tiny alone gets another shard count.
    tiny = fixture_workflow / "config" / "presets" / "tiny.yaml"
    tiny.write_text(tiny.read_text().replace("num_shards: 3", "num_shards: 5"))
    targets = [f"results/{p}/anchors.json" for p in ("tiny", "small", "medium", "b1")]
    t0 = time.time()
    proc = snakemake(fixture_workflow, "-n", *targets)
    print(f"dry run of four presets: {time.time() - t0:.1f} s")  # informational; the target is in benchmarks/
    counts = job_counts(proc.stdout)
    # anchors: one per (shards, eval window), and each preset has its own window (train.eval_bytes, seq_len)
    assert counts == {"filter": 1, "shard": 2, "anchors": 4, "anchors_view": 4, "total": 11}, counts


def job_counts(out: str) -> dict:
    """The job table of a Snakemake dry run: {rule: count}."""
    counts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
            if parts[0] == "total":
                break
    return counts


def test_snakemake_builds_anchors_and_reruns_nothing(fixture_workflow):
    run = snakemake(fixture_workflow, "results/tiny/anchors.json")
    # What a person sees: each stage's progress lines, not its log (dormouse/engine/progress.py)
    seen = run.stdout + run.stderr
    for line in ("[filter] doc ", "[shard] pass 2: doc ", "[anchors] n-gram counts: doc ", "[anchors] kneser_ney"):
        assert line in seen, f"{line!r} not shown by snakemake:\n{seen[-3000:]}"
    assert "[filter] params" not in seen  # the full record stays in the log
    filter_log = next((fixture_workflow / "results" / "logs" / "filter").glob("*.log")).read_text()
    assert "[filter] params" in filter_log and "[filter] doc " not in filter_log
    view = json.loads((fixture_workflow / "results" / "tiny" / "anchors.json").read_text())
    assert [link["stage"] for link in view["digest_chain"]] == ["anchors", "shard", "filter"]
    assert view["ladder"][0] == {**view["ladder"][0], "name": "uniform", "bpb": 8.0}
    assert view["retractions_applied"] == []
    again = snakemake(fixture_workflow, "-n", "results/tiny/anchors.json")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_config_corpus_override_points_the_chain_at_another_corpus(fixture_workflow, small_corpus, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for f in sorted((small_corpus / "code").glob("*.txt"))[:8]:
        (other / f.name).write_text(f.read_text())
    base = job_counts(snakemake(fixture_workflow, "-n", "results/tiny/anchors.json").stdout)
    assert base["filter"] == 1
    snakemake(fixture_workflow, "results/tiny/anchors.json")
    # Built: nothing to do for the configured corpus; a --config corpus=... override re-plans the chain.
    proc = snakemake(fixture_workflow, "-n", "results/tiny/anchors.json", "--config", f"corpus={other}")
    assert job_counts(proc.stdout) == {"filter": 1, "shard": 1, "anchors": 1, "anchors_view": 1, "total": 4}
    missing = snakemake(fixture_workflow, "-n", "--config", f"corpus={tmp_path / 'nowhere'}", check=False)
    assert missing.returncode != 0 and "matched no files" in missing.stdout + missing.stderr


def test_every_registered_stage_has_its_rule():
    """The rules are written out for readers; this holds them to the registry (dormouse/engine/registry.py): one
    rule per stage, named as the stage, whose inputs, job and command are that stage's, and no rule runs a stage
    under another name."""
    import re

    from dormouse.engine.registry import STAGES

    rules = {}
    for smk in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        for m in re.finditer(r"^rule (\w+):\n(.*?)(?=^rule |\Z)", smk.read_text(), re.S | re.M):
            rules[m.group(1)] = m.group(2)
    for name in STAGES:
        body = rules.get(name)
        assert body is not None, f"no rule {name!r} in workflow/rules/"
        for want in (f'unpack(stage_inputs("{name}"))', f'stage_job("{name}")', f'{{STORE}}/{name}/{{{{d}}}}/manifest.json'):
            assert want in body, f"rule {name}: {want!r} missing"
        assert re.search(rf"(dormouse|{{params.launch}}) {name} --job", body), f"rule {name} does not run its stage"
    runs = {rule: re.findall(r"(?:dormouse|{params.launch}) (\w+) --job", body) for rule, body in rules.items()}
    assert all(cmd == [rule] for rule, cmd in runs.items() if cmd), runs


def test_a_configuration_mistake_is_one_message_not_a_traceback(fixture_workflow):
    for config, needle in (("corpus=/nonexistent", "raw input '/nonexistent' matched no files"),
                           ("set=train.stepz=3", "'stepz' was unexpected")):
        r = snakemake(fixture_workflow, "-n", "--config", config, check=False)
        assert r.returncode != 0 and needle in r.stderr, r.stderr[-2000:]
        assert 'File "' not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_target_no_rule_makes_is_one_message_naming_what_to_fix(fixture_workflow):
    for target, needle in (("results/nosuch/bench.json", "no preset 'nosuch' in this run (presets: tiny, small, medium, b1)"),
                           ("results/tiny/sft.json", "results/tiny/ holds anchors.json, pretrain.json, bench.json"),
                           ("results/ab/nope/verdict.json", "no experiment 'nope'")):
        r = snakemake(fixture_workflow, "-n", target, check=False)
        assert r.returncode == 1 and f"dormouse: {target}: {needle}" in r.stderr, r.stderr[-2000:]
        assert "MissingRuleException" not in r.stderr + r.stdout
