"""The eval tail (issue 24, case 7): sized as a fraction with floors and caps, a warning when it is small, and
an error that says what to change when it swallows the corpus."""

from collections import Counter

import numpy as np
import pytest

from dormouse.data.docs_io import PartWriter
from dormouse.data.shards import shard_documents, tail_size, whole_groups


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
    with pytest.raises(SystemExit, match="eval_tail_fraction") as e:  # the share cap off: the byte target alone
        shard_documents(parts(tmp_path, 5), 2, 10_000_000, Art(tmp_path / "out"), None, {"eval_tail_max_share": None})
    assert "are the document ids unique" not in str(e.value)


def test_tail_size_share_cap_wins_and_keeps_one_document():
    cum = np.cumsum(np.full(100, 1000))
    assert tail_size(cum, 50_000, {"eval_tail_max_share": 0.1}) == 10
    assert tail_size(cum, 5000, {"eval_tail_max_share": 0.1}) == 5  # under the cap: the target as before
    assert tail_size(cum, 5000, {"eval_tail_min_docs": 40, "eval_tail_max_share": 0.2}) == 20  # caps win over floors
    assert tail_size(cum, 50_000, {"eval_tail_max_share": 0.0001}) == 1  # one document (its group) at least


def test_a_small_corpus_keeps_most_of_its_text_for_training_and_says_so(tmp_path, capsys):
    """Issue #46 item 1: a 1 MB byte target took 69 % of a 1.47 MB corpus; by default the tail is capped at a fifth
    of the corpus, the cap is a warning on the terminal and in the manifest, and the rest trains."""
    art = Art(tmp_path / "out")
    shard_documents(parts(tmp_path, 200, size=7000), 2, 1_000_000, art, None)  # 1.4 MB of 200 documents
    c = art.counters
    assert c["eval_bytes"] <= 0.2 * c["bytes_in"] and c["train_bytes"] >= 0.8 * c["bytes_in"]
    assert c["eval_docs"] == 39 and c["train_docs"] == 161  # 40 documents of 7 001-7 003 bytes would pass a fifth
    capped = [w for w in art.extra["warnings"] if "capped at eval_tail_max_share=0.2" in w]
    assert len(capped) == 1 and "[shard] WARNING: the eval tail was capped" in capsys.readouterr().out
    art = Art(tmp_path / "small")  # a byte target past the whole corpus: capped too, not an error
    shard_documents(parts(tmp_path, 50, size=7000), 2, 1_000_000, art, None)
    assert art.counters["eval_docs"] == 10 and art.counters["train_docs"] == 40
    art = Art(tmp_path / "out2")  # the cap off: the byte target as before (the corpus's most)
    shard_documents(parts(tmp_path, 200, size=7000), 2, 1_000_000, art, None, {"eval_tail_max_share": None})
    assert art.counters["eval_bytes"] >= 1_000_000 and not any("capped" in w for w in art.extra.get("warnings", []))


def test_the_share_cap_holds_after_the_last_group_is_made_whole():
    keys, cum = np.array([1, 1, 2, 2, 2, 3], dtype=np.uint64), np.cumsum(np.full(6, 100))
    assert whole_groups(3, keys, cum) == 5  # into group 2: the tail takes it whole
    assert whole_groups(3, keys, cum, cap=250) == 2  # whole, group 2 would pass the cap: back to group 1's end
    assert whole_groups(2, keys, cum, cap=250) == 2 and whole_groups(1, keys, cum, cap=50) == 2  # one group at least
    assert whole_groups(0, keys, cum) == 0
    assert whole_groups(7, keys, cum) == 6 and whole_groups(7, keys, cum, cap=250) == 2  # a target past the corpus
