"""The workflow under Snakemake itself: lint, dry runs of every preset, and a real run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_util import configure

from dormouse.planner.plan import load_plan, override_tag, run_overrides

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
    # What a person sees: each stage's progress lines, not its log (dormouse/core/progress.py)
    seen = run.stdout + run.stderr
    for line in ("[filter] doc ", "[shard] pass 2: doc ", "[anchors] n-gram counts: doc ", "[anchors] kneser_ney"):
        assert line in seen, f"{line!r} not shown by snakemake:\n{seen[-3000:]}"
    assert "[filter] params" not in seen  # the full record stays in the log
    filter_log = next((fixture_workflow / "results" / "logs" / "filter").glob("*.log")).read_text()
    assert "[filter] params" in filter_log and "[filter] doc " not in filter_log
    view = json.loads((fixture_workflow / "results" / "tiny" / "anchors.json").read_text())
    assert [link["stage"] for link in view["digest_chain"]] == ["anchors", "shard", "filter"]
    assert view["ladder"][0] == {**view["ladder"][0], "name": "uniform", "bpb": 8.0}
    assert view["retractions_applied"] == ["R005"]  # the ledger's entry for every shard built before the tail cap
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
    # Built: nothing to do for the configured corpus; a --config corpus=... override re-plans the chain, whose
    # views go to their own folder (the preset's stay tiny's own).
    view = f"tiny@{override_tag({'corpus': str(other)})}"
    proc = snakemake(fixture_workflow, "-n", f"results/{view}/anchors.json", "--config", f"corpus={other}")
    assert job_counts(proc.stdout) == {"filter": 1, "shard": 1, "anchors": 1, "anchors_view": 1, "total": 4}
    missing = snakemake(fixture_workflow, "-n", "--config", f"corpus={tmp_path / 'nowhere'}", check=False)
    assert missing.returncode != 0 and "matched no files" in missing.stdout + missing.stderr


def test_a_run_with_overrides_keeps_the_presets_own_views(fixture_workflow):
    """A one-off run (--config set=...) writes results/<preset>@<tag>/, recording its overrides; the preset's own
    results/<preset>/ stays as it was, and a target there is one line naming this run's folder."""
    snakemake(fixture_workflow, "results/tiny/anchors.json")
    own = fixture_workflow / "results" / "tiny" / "anchors.json"
    before = (own.read_bytes(), own.stat().st_mtime_ns)
    override = "set=anchors.max_order=3"  # the anchors stage alone: a quick rerun
    view = f"tiny@{override_tag({'set': 'anchors.max_order=3'})}"
    planned = snakemake(fixture_workflow, "-n", "--config", override).stdout  # the default target of such a run
    assert f"results/{view}/bench.json" in planned and "results/tiny/" not in planned
    refused = snakemake(fixture_workflow, "-n", "results/tiny/anchors.json", "--config", override, check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert (f"dormouse: results/tiny/anchors.json: results/tiny/ holds the preset's own views, which a run with "
            f"overrides leaves as they are; this run (set=anchors.max_order=3) writes results/{view}/ (or "
            f"results/tiny@<label>/): "
            f"snakemake results/{view}/anchors.json --config set=anchors.max_order=3") in refused.stderr
    snakemake(fixture_workflow, f"results/{view}/anchors.json", "--config", override)
    assert (own.read_bytes(), own.stat().st_mtime_ns) == before
    mine, theirs = (json.loads(p.read_text()) for p in (fixture_workflow / "results" / view / "anchors.json", own))
    assert (mine["preset"], mine["view"], mine["overrides"]) == ("tiny", view, {"set": "anchors.max_order=3"})
    assert (theirs["view"], theirs["overrides"]) == ("tiny", {})
    assert mine["digest_chain"][0]["digest"] != theirs["digest_chain"][0]["digest"]
    assert mine["digest_chain"][1:] == theirs["digest_chain"][1:]  # the same shard and filter
    again = snakemake(fixture_workflow, "-n", f"results/{view}/anchors.json", "--config", override)
    assert "Nothing to be done" in again.stdout + again.stderr
    # a folder named by the user holds the same run; a folder of other overrides is never reused
    labelled = snakemake(fixture_workflow, "-n", "results/tiny@order3/anchors.json", "--config", override).stdout
    assert job_counts(labelled) == {"anchors_view": 1, "total": 1}
    reused = snakemake(fixture_workflow, "-n", f"results/{view}/anchors.json", "--config", "set=anchors.max_order=2",
                       check=False)
    assert reused.returncode == 1 and (f"dormouse: results/{view}/anchors.json: results/{view}/ holds the views of a "
                                       "run with set=anchors.max_order=3, not this run's (set=anchors.max_order=2)"
                                       ) in reused.stderr
    art = f"results/store/anchors/{mine['digest_chain'][0]['digest']}"  # and the view command itself refuses
    over = subprocess.run([str(BIN / "dormouse"), "view", "anchors", "--preset", "tiny", "--view", view, "--overrides",
                           '{"set": "anchors.max_order=2"}', "--artifact", art, "--out", f"results/{view}/anchors.json"],
                          cwd=fixture_workflow, capture_output=True, text=True)
    assert over.returncode == 2 and over.stderr.startswith(f"dormouse view: results/{view}/anchors.json: holds the view "
                                                           "of a run with overrides {'set': 'anchors.max_order=3'}")
    assert len(over.stderr.splitlines()) == 1 and "max_order=3" in (fixture_workflow / "results" / view / "anchors.json").read_text()


def test_only_what_changes_results_is_an_override(workdir, monkeypatch):
    file_config = {"corpus": "corpus/demo/data", "preset": "tiny", "store": "results/store"}
    given = {"corpus": "corpus/demo/data", "preset": "small", "store": "/scratch/store", "set": "",
             "slurm": {"partition": "gpu"}}
    assert run_overrides(file_config, given) == {}  # the file's corpus, an empty set, where and which
    assert run_overrides(file_config, {"corpus": "/data/mine", "set": "train.steps=50"}) == {
        "corpus": "/data/mine", "set": "train.steps=50"}
    assert override_tag({"set": "train.steps=50"}) == override_tag({"set": "train.steps=50"}) != override_tag({})
    monkeypatch.chdir(workdir)  # views move only where the overrides change a preset's chain
    assert load_plan(None, "train.steps=50").view_name("tiny") == f"tiny@{override_tag({'set': 'train.steps=50'})}"
    assert load_plan(None, "resources.runtime_min.pretrain=99").view_name("tiny") == "tiny"  # not digested
    assert load_plan(None, corpus="corpus/demo/data").view_name("tiny") == "tiny"  # the file's own corpus


def test_every_registered_stage_has_its_rule():
    """The rules are written out for readers; this holds them to the registry (dormouse/planner/registry.py): one
    rule per stage, named as the stage, whose inputs, job and command are that stage's, and no rule runs a stage
    under another name."""
    import re

    from dormouse.planner.registry import STAGES

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
