"""dormouse corpus-slice: a uniform, deterministic draw of a built corpus's documents that keeps the parts of a cut file
together, is checked against the corpus's BUILD.json, and says what it kept."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import zstandard

from dormouse.data.corpus_slice import build, keeps
from dormouse.data.scale_corpus import sha256_file
from dormouse.engine.config import load_preset

PATTERN = load_preset("b1")["data"]["shard"]["part_pattern"]


def write_corpus(root: Path, n_docs: int = 3000) -> dict:
    """Two sources of real-looking records (ids, domains, a file cut into parts), BUILD.json last, as scale-corpus
    writes them."""
    rng = random.Random(0)
    (root / "data").mkdir(parents=True)
    sources, total = {}, 0
    for name in ("alpha-1.0", "beta-2.0"):
        path = root / "data" / f"{name}.jsonl.zst"
        with path.open("wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as zw:
            for i in range(n_docs):
                text = " ".join(rng.choice(["int", "main", "return", "the", "manual", "page"]) for _ in range(40))
                ids = [f"{name}/src/file{i}.c#{k:03d}" for k in range(3)] if i % 10 == 0 else [f"{name}/doc{i}.txt"]
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
    s = build(corpus, tmp_path / "slice", total // 5, PATTERN)
    assert abs(s["totals"]["text_bytes"] / total - 0.2) < 0.03  # a uniform draw lands near the share asked
    assert s["parent"]["build_sha256"] == sha256_file(corpus / "BUILD.json") and s["fraction"] == pytest.approx(0.2, 1e-3)
    for src in s["sources"].values():
        ids = read_ids(tmp_path / "slice" / src["file"])
        assert src["file_sha256"] == sha256_file(tmp_path / "slice" / src["file"]) and src["docs_read"] == 3000 + 300 * 2
        assert 0.15 < len(ids) / src["docs_read"] < 0.25 and src["docs.code"] + src["docs.docs"] == len(ids)
        parts = [i for i in ids if "#" in i]
        groups = {i.split("#")[0] for i in parts}
        assert groups and len(parts) == 3 * len(groups)  # a cut file's three parts kept together, never one or two
        assert all(keeps(i if "#" not in i else i.split("#")[0], int(s["fraction"] * 2**64)) for i in ids)
    again = build(corpus, tmp_path / "again", total // 5, PATTERN)
    assert [v["file_sha256"] for v in again["sources"].values()] == [v["file_sha256"] for v in s["sources"].values()]
    assert (tmp_path / "slice" / "BUILD.json").exists() and not (tmp_path / "slice" / ".data.tmp").exists()


def test_the_slice_refuses_a_changed_corpus_file_or_an_incomplete_build(tmp_path):
    corpus = tmp_path / "corpus"
    total = write_corpus(corpus, 200)["text_bytes"]
    with pytest.raises(SystemExit, match="asks"):
        build(corpus, tmp_path / "s", total * 2, PATTERN)
    damaged = corpus / "data" / "beta-2.0.jsonl.zst"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    with pytest.raises(SystemExit, match=r"beta-2.0.jsonl.zst: sha256 .* rebuild the corpus"):
        build(corpus, tmp_path / "s", total // 4, PATTERN)
    assert not (tmp_path / "s" / "BUILD.json").exists()  # no slice marked complete
    (corpus / "BUILD.json").unlink()
    with pytest.raises(SystemExit, match="not a complete build"):
        build(corpus, tmp_path / "s", total // 4, PATTERN)
