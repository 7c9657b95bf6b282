"""The filter's heuristics over several processes write the very documents and counters of one process."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import yaml
from pipeline_util import configure, run_chain


@pytest.mark.parametrize("rule", ["threshold", "top_fraction"])
def test_two_workers_write_what_one_writes(workdir, small_corpus, quality_examples, monkeypatch, rule):
    """Both keep rules: a threshold decides as documents are scored (one pass), a top fraction after all are."""
    config = configure(workdir, small_corpus, *quality_examples)
    if rule == "top_fraction":
        path = workdir / "config" / "presets" / "tiny.yaml"
        preset = yaml.safe_load(path.read_text())
        preset["data"]["filter"]["quality"].update(threshold=None, top_fraction=0.5)
        path.write_text(yaml.safe_dump(preset, sort_keys=False))
    runs = {}
    for workers in ("1", "2"):
        monkeypatch.setenv("OMP_NUM_THREADS", workers)  # Snakemake's grant to the rule
        plan = run_chain(workdir, config, stages=("filter",))
        out = workdir / plan.artifact_dir("filter", plan.chain["tiny"]["filter"])
        manifest = json.loads((out / "manifest.json").read_text())
        runs[workers] = ({n: (out / n).read_bytes() for n in manifest["files"] if n != "quality_model.bin"},
                         manifest["counters"], manifest["workers"])
        shutil.rmtree(out)
    (docs1, c1, w1), (docs2, c2, w2) = runs["1"], runs["2"]
    assert (w1, w2) == (1, 2)
    assert c1 == c2 and c1["docs_kept"] > 0 and any(k.startswith("docs_dropped.gopher") for k in c1)
    assert docs1.keys() == docs2.keys() and all(docs1[n] == docs2[n] for n in docs1)
    if rule == "top_fraction":  # half of the documents the heuristics passed, rounded up
        candidates = c1["docs_kept"] + c1["docs_dropped.quality_low_score"]
        assert c1["docs_kept"] == math.ceil(0.5 * candidates) and c1["docs_dropped.quality_low_score"] > 0
