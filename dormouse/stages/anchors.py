"""anchors: bits per byte of byte n-gram models on the eval tail — the ladder a trained LM must beat.

    dormouse anchors --job "$(dormouse plan --preset tiny --stage anchors)"

Rungs (dormouse.ngram): uniform (exactly 8.0), unigram, and for k = 2..max_order a simple backoff
model and interpolated Kneser-Ney, trained on every train shard and scored on the whole eval tail.
Output: anchors.json {ladder, train_bytes, train_docs, eval_bytes, eval_docs}.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dormouse import ngram
from dormouse.stage import input_artifact, parse_job, summary, writer


def iter_docs(bin_path: Path, idx_path: Path):
    data = np.fromfile(bin_path, dtype=np.uint8)
    offsets = np.load(idx_path)
    if offsets[-1] != len(data):
        raise SystemExit(f"{idx_path}: last offset {offsets[-1]} != {len(data)} bytes in {bin_path}")
    buf = data.tobytes()
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        yield buf[a:b]


def shard_docs(art, stems: list[str]):
    for stem in stems:
        yield from iter_docs(art.file(f"{stem}.bin"), art.file(f"{stem}.idx.npy"))


def main(argv=None) -> int:
    job = parse_job(argv, "anchors", __doc__)
    p = job["params"]
    shards = input_artifact(job, "shard")
    train_stems = [n[: -len(".bin")] for n in shards.files("train/") if n.endswith(".bin")]
    with writer(job) as art:
        c = art.counters
        t0 = time.time()
        counts = ngram.count_ngrams(shard_docs(shards, train_stems), p["max_order"], progress=True)
        c["train_bytes"] = int(counts.n_bytes)
        t1 = time.time()
        eval_docs = list(shard_docs(shards, ["eval/tail"]))
        ladder = ngram.anchor_ladder(counts, ngram.prepare_eval(eval_docs, p["max_order"]), p["max_order"], alpha=p["alpha"])
        t2 = time.time()
        c["eval_docs"] = len(eval_docs)
        c["eval_bytes"] = sum(map(len, eval_docs))
        info = json.loads(shards.file("shards.json").read_text())
        result = {
            "ladder": ladder,
            "train_docs": sum(s["docs"] for s in info["train"]),
            "train_bytes": sum(s["bytes"] for s in info["train"]),
            "eval_docs": c["eval_docs"],
            "eval_bytes": c["eval_bytes"],
            "max_order": p["max_order"],
            "seconds": {"count": round(t1 - t0, 3), "eval": round(t2 - t1, 3)},
        }
        if c["train_bytes"] != result["train_bytes"]:
            raise SystemExit(f"anchors: counted {c['train_bytes']} train bytes, shards.json says {result['train_bytes']}")
        art.path("anchors.json").write_text(json.dumps(result, indent=2) + "\n")
        for row in ladder:
            print(f"[anchors] {row['name']:10s} k={row['order']} bpb={row['bpb']:.4f}", flush=True)
        summary("anchors", c)
    return 0
