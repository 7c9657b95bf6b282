"""The filter's heuristics over several processes write the very documents and counters of one process."""

from __future__ import annotations

import json
import shutil

from pipeline_util import configure, run_chain


def test_two_workers_write_what_one_writes(workdir, small_corpus, quality_examples, monkeypatch):
    config = configure(workdir, small_corpus, *quality_examples)
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
