"""anchors.max_train_bytes: the n-grams are counted over a bounded, uniform sample of train, said everywhere."""

from __future__ import annotations

import json

import yaml
from pipeline_util import configure, run_chain


def anchors_of(workdir, config, cap):
    path = workdir / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(path.read_text())
    preset["anchors"]["max_train_bytes"] = cap
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    plan = run_chain(workdir, config)
    out = workdir / plan.artifact_dir("anchors", plan.chain["tiny"]["anchors"])
    return json.loads((out / "anchors.json").read_text()), json.loads((out / "manifest.json").read_text())["counters"]


def test_a_capped_count_reads_whole_documents_up_to_the_cap_and_says_so(workdir, small_corpus, quality_examples):
    config = configure(workdir, small_corpus, *quality_examples)
    full, c_full = anchors_of(workdir, config, None)
    assert full["train_bytes_counted"] == full["train_bytes"] and c_full["train_docs_beyond_cap"] == 0
    cap = full["train_bytes"] // 3
    part, c = anchors_of(workdir, config, cap)
    assert 0 < part["train_bytes_counted"] <= cap and part["max_train_bytes"] == cap
    assert part["train_bytes_counted"] + c["train_bytes_beyond_cap"] == part["train_bytes"] and c["train_docs_beyond_cap"] > 0
    assert all(r["train_bytes_counted"] == part["train_bytes_counted"] for r in part["ladder"] + part["ladder_tail"])
    kn = lambda a: next(r["bpb"] for r in a["ladder"] if r["name"] == "kneser_ney" and r["order"] == a["max_order"])
    assert kn(part) > kn(full)  # fewer counts, a weaker model: the cap is real
