"""dormouse corpus-slice: a uniform, deterministic draw of a built corpus's documents (a cut file's parts drawn one by
one, so a dictionary of many parts keeps its share), checked against the corpus's BUILD.json, saying what it kept."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import zstandard

from dormouse.data.corpus_slice import build, keeps
from dormouse.data.scale_corpus import sha256_file


def write_corpus(root: Path, n_docs: int = 3000) -> dict:
    """Two sources of real-looking records (ids, domains, every tenth file cut into parts), a dictionary (one file
    cut into 400 parts) and a source of one small file, BUILD.json last, as scale-corpus writes them."""
    rng = random.Random(0)
    (root / "data").mkdir(parents=True)
    sources, total = {}, 0
    for name, n in (("alpha-1.0", n_docs), ("beta-2.0", n_docs), ("dict-1.0", 1), ("gamma-3.0", 1)):
        path = root / "data" / f"{name}.jsonl.zst"
        with path.open("wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as zw:
            for i in range(n):
                text = " ".join(rng.choice(["int", "main", "return", "the", "manual", "page"]) for _ in range(40))
                parts = 400 if name == "dict-1.0" else 3 if i % 10 == 0 and name != "gamma-3.0" else 0
                ids = [f"{name}/src/file{i}.c#{k:03d}" for k in range(parts)] or [f"{name}/doc{i}.txt"]
                for doc_id in ids:
                    rec = {"id": doc_id, "text": text, "source": name,
                           "metadata": {"domain": "docs" if i % 3 else "code", "path": doc_id, "license": "MIT"}}
                    zw.write((json.dumps(rec) + "\n").encode())
                    total += len(text.encode())
        sources[name] = {"file": f"data/{path.name}", "file_sha256": sha256_file(path)}
    (root / "BUILD.json").write_text(json.dumps({"format_version": 2, "sources": sources,
                                                 "totals": {"text_bytes": total}}))
    return {"text_bytes": total}


def read_ids(path: Path) -> list[str]:
    with path.open("rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r:
        return [json.loads(line)["id"] for line in io.BufferedReader(r)]


def test_the_slice_is_a_deterministic_uniform_draw_that_keeps_parts_together(tmp_path):
    corpus = tmp_path / "corpus"
    total = write_corpus(corpus)["text_bytes"]
    s = build(corpus, tmp_path / "slice", total // 5)
    assert abs(s["totals"]["text_bytes"] / total - 0.2) < 0.03  # a uniform draw lands near the share asked
    assert s["parent"]["build_sha256"] == sha256_file(corpus / "BUILD.json") and s["fraction"] == pytest.approx(0.2, 1e-3)
    # gamma's one document is not drawn (its salted hash lies above the threshold): no file, not an empty one
    assert s["sources"]["gamma-3.0"] == {"file": None, "docs_read": 1} and not (tmp_path / "slice/data/gamma-3.0.jsonl.zst").exists()
    assert s["sources_without_a_document"] == ["gamma-3.0"]
    for name, read in (("alpha-1.0", 3000 + 300 * 2), ("beta-2.0", 3000 + 300 * 2), ("dict-1.0", 400)):
        src = s["sources"][name]
        ids = read_ids(tmp_path / "slice" / src["file"])
        assert src["file_sha256"] == sha256_file(tmp_path / "slice" / src["file"]) and src["docs_read"] == read
        assert 0.15 < len(ids) / read < 0.25 and sum(v for k, v in src.items() if k.startswith("docs.")) == len(ids)
        assert all(keeps(i, int(s["fraction"] * 2**64)) for i in ids)
    again = build(corpus, tmp_path / "again", total // 5)
    assert [v.get("file_sha256") for v in again["sources"].values()] == [v.get("file_sha256") for v in s["sources"].values()]
    assert (tmp_path / "slice" / "BUILD.json").exists() and not (tmp_path / "slice" / ".data.tmp").exists()


def test_the_slice_refuses_a_changed_corpus_file_or_an_incomplete_build(tmp_path):
    corpus = tmp_path / "corpus"
    total = write_corpus(corpus, 200)["text_bytes"]
    with pytest.raises(SystemExit, match="asks"):
        build(corpus, tmp_path / "s", total * 2)
    damaged = corpus / "data" / "beta-2.0.jsonl.zst"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    with pytest.raises(SystemExit, match=r"beta-2.0.jsonl.zst: sha256 .* rebuild the corpus"):
        build(corpus, tmp_path / "s", total // 4)
    assert not (tmp_path / "s" / "BUILD.json").exists()  # no slice marked complete
    (corpus / "BUILD.json").unlink()
    with pytest.raises(SystemExit, match="not a complete build"):
        build(corpus, tmp_path / "s", total // 4)
