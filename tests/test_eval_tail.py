"""The eval tail (issue 24, case 7): sized as a fraction with floors and caps, a warning when it is small, and
an error that says what to change when it swallows the corpus."""

from collections import Counter

import numpy as np
import pytest

from dormouse.data.docs_io import PartWriter
from dormouse.stages.shard import shard_documents, tail_size


class Art:
    def __init__(self, root):
        self.root, self.counters, self.extra = root, Counter(), {}

    def path(self, name):
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p


def parts(tmp_path, n_docs, size=1000):
    with PartWriter(lambda n: tmp_path / n, "docs") as out:
        for i in range(n_docs):
            out.write({"id": f"doc/{i}", "text": chr(97 + i % 26) * size + str(i), "source": "x", "quality": 1.0})
    return [tmp_path / n for n in out.names]


def test_tail_size_fraction_floor_and_caps():
    cum = np.cumsum(np.full(100, 1000))
    assert tail_size(cum, 5000) == 5  # the rule before sizing keys: until the target is reached
    assert tail_size(cum, 5000, {"eval_tail_fraction": 0.1}) == 10
    assert tail_size(cum, 5000, {"eval_tail_fraction": 0.1, "eval_tail_min_bytes": 20_000}) == 20
    assert tail_size(cum, 5000, {"eval_tail_fraction": 0.5, "eval_tail_max_bytes": 30_000}) == 30
    assert tail_size(cum, 5000, {"eval_tail_min_docs": 40, "eval_tail_max_docs": 25}) == 25  # caps win
    assert tail_size(cum, 5000, {"eval_tail_fraction": None}) == 5


def test_small_tail_warns_in_manifest(tmp_path):
    art = Art(tmp_path / "out")
    shard_documents(parts(tmp_path, 60), 2, 3000, art, None, {"eval_tail_warn_below": 10})
    assert art.counters["eval_docs"] < 10
    assert "eval_tail_warn_below=10" in art.extra["warnings"][0]
    art = Art(tmp_path / "out2")
    shard_documents(parts(tmp_path, 60), 2, 3000, art, None, {"eval_tail_warn_below": 0})
    assert "warnings" not in art.extra


def test_tail_that_swallows_the_corpus_says_what_to_change(tmp_path):
    with pytest.raises(SystemExit, match="eval_tail_fraction") as e:
        shard_documents(parts(tmp_path, 5), 2, 10_000_000, Art(tmp_path / "out"), None)
    assert "are the document ids unique" not in str(e.value)
