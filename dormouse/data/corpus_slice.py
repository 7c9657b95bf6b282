"""A deterministic slice of a built corpus that keeps its mix: what b1's whole chain reads on one GPU machine.

    dormouse corpus-slice --corpus corpus/scale --text-mb 200 --out corpus/scale_slice     # or: make scale-slice
    snakemake --config corpus=corpus/scale_slice/data set=... -- results/b1@slice/bench.json

Why: a GPU machine here takes 64 MiB with the checkout (wheels included) and reaches no network, so b1's chain
(issue #41) cannot read the 4.3 GB scale corpus; it reads a slice made here that travels. The slice is documents of
the corpus (`<corpus>/data/*.jsonl.zst`, BUILD.json marking a complete build), nothing rewritten: a document is kept
when `fnv.doc_hash("slice\\0" + its id)` falls below fraction x 2^64, fraction = the text bytes asked / the corpus's
(its BUILD.json). Each part of a cut file (`<id>#NNN`, ~100 KB) is drawn on its own: a dictionary is one file of
hundreds of parts, and drawing whole files would keep all of it or none; the shard stage still holds the parts that
are drawn together. The salt makes the draw independent of the shard stage's routing hash, so the slice's eval tail
is a uniform draw of it, not a run of the corpus's eval tail. Every source and domain keeps about the same share.
Output: `<out>/data/<source>.jsonl.zst` (the corpus's file names, zstd level 19: the slice is made to travel) and
`<out>/BUILD.json`, written last: the parent's BUILD.json sha256, the rule, per source the documents read and kept,
bytes and domains kept, each file's sha256 (a source that keeps no document gets no file, named in
sources_without_a_document: the corpus readers refuse a file that yields no text); totals as the corpus's. Each
input file is checked against the sha256 its BUILD.json names before it is read (a changed, damaged or missing corpus
file is refused, naming it).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import time
from collections import Counter
from pathlib import Path

import zstandard

from dormouse.data.fnv import doc_hash
from dormouse.data.scale_corpus import publish, sha256_file

FORMAT_VERSION = 1
ZSTD_LEVEL = 19  # ~15 % smaller than level 3 on code and prose: the slice is carried, once


def keeps(doc_id: str, threshold: int) -> bool:
    """Whether the slice keeps a document: its salted routing hash below the threshold."""
    return doc_hash("slice\0" + doc_id) < threshold


def build(corpus: Path, out: Path, text_bytes: int) -> dict:
    t0 = time.time()
    build_json = corpus / "BUILD.json"
    if not build_json.exists():
        raise SystemExit(f"corpus-slice: {build_json} missing: {corpus} is not a complete build (make scale)")
    parent = json.loads(build_json.read_text())
    total = parent.get("totals", {}).get("text_bytes")
    if not total or not parent.get("sources"):
        raise SystemExit(f"corpus-slice: {build_json} names no sources or no totals.text_bytes")
    if not 0 < text_bytes < total:
        raise SystemExit(f"corpus-slice: --text-mb asks {text_bytes} bytes of a corpus of {total}")
    fraction = text_bytes / total
    threshold = int(fraction * 2**64)
    (out / "BUILD.json").unlink(missing_ok=True)
    tmp = out / ".data.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    summary = {"format_version": FORMAT_VERSION, "parent": {"path": str(corpus), "build_sha256": sha256_file(build_json),
               "format_version": parent.get("format_version"), "text_bytes": total},
               "rule": "doc_hash('slice\\0' + id) < fraction * 2^64", "fraction": round(fraction, 8),
               "text_bytes_asked": text_bytes, "zstd_level": ZSTD_LEVEL, "sources": {}}
    for name, src in sorted(parent["sources"].items()):
        if not src.get("file"):  # a slice's source that kept no document (slicing a slice)
            summary["sources"][name] = {"file": None, "docs_read": 0}
            continue
        path = corpus / src["file"]
        got = sha256_file(path) if path.exists() else "missing"
        if got != src["file_sha256"]:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(f"corpus-slice: {path}: sha256 {got} is not the {src['file_sha256']} {build_json} "
                             f"names (a changed, damaged or missing corpus file: rebuild the corpus)")
        stats: Counter = Counter()
        dst = tmp / path.name
        with path.open("rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r, dst.open("wb") as f, \
                zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(f) as zw:
            for line in io.BufferedReader(r, buffer_size=1 << 20):
                stats["docs_read"] += 1
                rec = json.loads(line)
                if not keeps(rec["id"], threshold):
                    continue
                zw.write(line)
                domain = rec.get("metadata", {}).get("domain", "unknown")
                stats[f"docs.{domain}"] += 1
                stats[f"bytes.{domain}"] += len(rec["text"].encode("utf-8"))
        kept = {k: v for k, v in stats.items() if k.startswith(("docs.", "bytes."))}
        if not kept:  # a source too small to keep a document: no file (the readers refuse one that yields no text)
            dst.unlink()
            summary["sources"][name] = {"file": None, "docs_read": stats["docs_read"]}
            continue
        summary["sources"][name] = {"file": f"data/{dst.name}", "file_sha256": sha256_file(dst),
                                    "file_bytes": dst.stat().st_size, "docs_read": stats["docs_read"],
                                    **dict(sorted(kept.items()))}
    summary["file_bytes"] = sum(s.get("file_bytes", 0) for s in summary["sources"].values())
    summary["sources_without_a_document"] = sorted(n for n, s in summary["sources"].items() if not s["file"])
    return publish(out, tmp, summary, t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse corpus-slice", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path("corpus/scale"), help="a built corpus (its BUILD.json)")
    ap.add_argument("--text-mb", type=float, required=True, help="text bytes to keep, in MB (10^6)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    s = build(args.corpus, args.out, int(args.text_mb * 1e6))
    print(f"[corpus-slice] {s['totals']['text_bytes'] / 1e6:.1f} MB of text ({s['fraction']:.4%} of {args.corpus}) in "
          f"{s['file_bytes'] / 2**20:.1f} MiB of files, {s['build_seconds']:.0f} s -> {args.out}/data", flush=True)
    return 0
