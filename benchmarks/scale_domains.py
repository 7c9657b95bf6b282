"""What the filter kept and dropped per domain of the scale corpus (issue #29 item 3).

    .venv/bin/python -m benchmarks.scale_domains --filter results/store/filter/<digest> [--corpus corpus/scale/data]

Joins the filter artifact's kept documents (their ids, from its docs-*.jsonl.zst) with the domain every raw
document carries (`metadata.domain`: docs, code, lowq; corpus/scale/README.md), and prints bytes and documents
read and kept per domain and per source. The artifact's own per_file.json counts per raw file only.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections import Counter
from pathlib import Path

import zstandard


def lines(path: Path):
    with path.open("rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
        yield from io.TextIOWrapper(r, encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--filter", type=Path, required=True, help="the filter artifact directory")
    ap.add_argument("--corpus", type=Path, default=Path("corpus/scale/data"))
    args = ap.parse_args(argv)
    kept = set()
    for part in sorted(args.filter.glob("docs-*.jsonl.zst")):
        kept.update(json.loads(line)["id"] for line in lines(part))
    read, keep = Counter(), Counter()
    for f in sorted(args.corpus.glob("*.jsonl.zst")):
        for line in lines(f):
            rec = json.loads(line)
            n = len(rec["text"].encode("utf-8"))
            for key in (rec["metadata"]["domain"], f"{rec['source']}/{rec['metadata']['domain']}"):
                read[key, "bytes"] += n
                read[key, "docs"] += 1
                if rec["id"] in kept:
                    keep[key, "bytes"] += n
                    keep[key, "docs"] += 1
    keys = sorted({k for k, _ in read}, key=lambda k: ("/" in k, k))
    print(f"{'domain / source':34s} {'read MB':>9} {'kept MB':>9} {'kept %':>7} {'docs read':>10} {'docs kept':>10}")
    for k in keys:
        r, kb = read[k, "bytes"], keep[k, "bytes"]
        print(f"{k:34s} {r / 1e6:9.1f} {kb / 1e6:9.1f} {100 * kb / max(r, 1):6.1f}% {read[k, 'docs']:10d} {keep[k, 'docs']:10d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
