"""anchors: bits per byte of byte n-gram models on the eval tail — the ladder a trained LM must beat.

    dormouse anchors --job "$(dormouse plan --preset tiny --stage anchors)"

Rungs (dormouse.data.ngram): uniform (exactly 8.0), unigram, and for k = 2..max_order a simple backoff
model and interpolated Kneser-Ney, trained on every train shard. `ladder` scores exactly the bytes the
model's eval window scores (`byte_stream.eval_targets`: the preset's train.eval_bytes and seq_len), each
with its in-document history (the model's context is its row instead); `ladder_tail` scores the whole
eval tail. Where the window covers the tail the two differ only in the tail's first byte.
The n-grams are counted over at most anchors.max_train_bytes of train (whole shards in order, then whole
documents: a uniform sample, the shards being hash-routed), which bounds the stage's memory whatever the
corpus; the rest is counted in train_docs/bytes_beyond_cap and every rung carries train_bytes_counted.
Output: anchors.json {ladder, eval_bytes, eval_docs, eval_window, ladder_tail, tail_bytes, tail_docs,
train_bytes, train_bytes_counted, max_train_bytes, train_docs, max_order}.
"""

from __future__ import annotations

import json
import time

import numpy as np

from dormouse.data import ngram
from dormouse.data import shards as layout
from dormouse.data.byte_stream import eval_targets
from dormouse.core import progress
from dormouse.planner.job import input_artifact, parse_job, summary, writer


def capped(shards, stems: list[str], cap: int | None, c):
    """Whole train documents until the next would pass `cap` bytes (None: all); the rest counted as not counted,
    from the shards' offsets without reading them (reading them only to count held memory and time)."""
    seen, full = 0, False
    for stem in stems:
        idx_path = shards.file(f"{stem}.idx.npy")
        if full:  # counted from the offsets: the .bin is neither read nor hashed
            sizes = np.diff(layout.doc_offsets(shards.path / f"{stem}.bin", idx_path))
            c["train_docs_beyond_cap"] += len(sizes)
            c["train_bytes_beyond_cap"] += int(sizes.sum())
            continue
        bin_path = shards.file(f"{stem}.bin")
        sizes = np.diff(layout.doc_offsets(bin_path, idx_path))
        for i, d in enumerate(layout.iter_docs(bin_path, idx_path)):
            if cap is not None and seen + len(d) > cap:
                full = True
                c["train_docs_beyond_cap"] += len(sizes) - i
                c["train_bytes_beyond_cap"] += int(sizes[i:].sum())
                break
            seen += len(d)
            yield d


def main(argv=None) -> int:
    job = parse_job(argv, "anchors", __doc__)
    p = job["params"]
    shards = input_artifact(job, "shard")
    train_stems = layout.train_stems(shards)
    with writer(job) as art:
        c = art.counters
        t0 = time.time()
        cap = p["max_train_bytes"]
        c.update({"train_docs_beyond_cap": 0, "train_bytes_beyond_cap": 0})  # listed at 0 too
        counts = ngram.count_ngrams(progress.track(capped(shards, train_stems, cap, c), "anchors", "doc", label="n-gram counts"),
                                      p["max_order"])
        c["train_bytes_counted"] = int(counts.n_bytes)
        t1 = time.time()
        eval_docs = list(layout.docs(shards, [layout.EVAL_STEM]))
        tail_bytes = sum(map(len, eval_docs))
        start, stop = eval_targets(tail_bytes, p["eval"]["eval_bytes"], p["eval"]["seq_len"])
        if stop <= start:
            raise SystemExit(f"anchors: the eval tail has {tail_bytes} bytes; the eval window needs one row of "
                             f"{p['eval']['seq_len'] + 1}")
        lens = np.array([len(d) for d in eval_docs], np.int64)
        ends = np.cumsum(lens)
        window_docs = int(((lens > 0) & (ends - lens < stop) & (ends > start)).sum())  # documents it touches
        ladder = ngram.anchor_ladder(counts, ngram.prepare_eval(eval_docs, p["max_order"], scored=(start, stop)),
                                     p["max_order"], alpha=p["alpha"])
        ladder_tail = ngram.anchor_ladder(counts, ngram.prepare_eval(eval_docs, p["max_order"]), p["max_order"],
                                          alpha=p["alpha"])
        for row in ladder + ladder_tail:  # every rung says what it was counted on
            row["train_bytes_counted"] = c["train_bytes_counted"]
        t2 = time.time()
        c["eval_bytes"], c["eval_docs"] = stop - start, window_docs
        c["tail_bytes"], c["tail_docs"] = tail_bytes, len(eval_docs)
        info = json.loads(shards.file("shards.json").read_text())
        result = {
            "ladder": ladder,
            "eval_bytes": c["eval_bytes"],
            "eval_docs": c["eval_docs"],
            "eval_window": {"bytes": [start, stop], "seq_len": p["eval"]["seq_len"],
                            "source": f"{layout.EVAL_BIN}; contexts within each document"},
            "ladder_tail": ladder_tail,
            "tail_bytes": tail_bytes,
            "tail_docs": len(eval_docs),
            "train_docs": sum(s["docs"] for s in info["train"]),
            "train_bytes": sum(s["bytes"] for s in info["train"]),
            "train_bytes_counted": c["train_bytes_counted"],
            "max_train_bytes": p["max_train_bytes"],
            "max_order": p["max_order"],
            "seconds": {"count": round(t1 - t0, 3), "eval": round(t2 - t1, 3)},
        }
        if c["train_bytes_counted"] + c["train_bytes_beyond_cap"] != result["train_bytes"]:
            raise SystemExit(f"anchors: counted {c['train_bytes_counted']} + {c['train_bytes_beyond_cap']} beyond the cap "
                             f"train bytes, shards.json says {result['train_bytes']}")
        art.path("anchors.json").write_text(json.dumps(result, indent=2) + "\n")
        for row, whole in zip(ladder, ladder_tail):
            progress.note(f"[anchors] {row['name']:10s} k={row['order']} bpb={row['bpb']:.4f} on the eval window "
                          f"({whole['bpb']:.4f} on the whole tail)")
        summary("anchors", c)
    return 0
