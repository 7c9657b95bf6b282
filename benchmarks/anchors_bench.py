"""Time the anchor ladder (dormouse.data.ngram) on real text: counting vs. evaluation.

Documents are whole text files found on the machine (Debian docs under /usr/share/doc, .gz
ones decompressed, plus the Python standard library sources), shuffled with a fixed seed and
split into an eval set and a training set of the requested sizes. Single-threaded on purpose:
the project target is "10 MB eval, max_order 5, all rungs, <= 10 s on one core".

    .venv/bin/python -m benchmarks.anchors_bench [--eval-mb 10] [--train-mb 20] [--order 5]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported

import argparse
import glob
import gzip
import platform
import random
import sys
import time

import numpy as np

from benchmarks.bench_env import cpu_model
from dormouse.data import ngram

SOURCES = ("/usr/share/doc/**/*", "/usr/lib/python3*/**/*.py")


def real_text_docs(limit_bytes: int, seed: int = 0) -> list[bytes]:
    paths = sorted({p for pat in SOURCES for p in glob.glob(pat, recursive=True)})
    random.Random(seed).shuffle(paths)
    docs, total = [], 0
    for path in paths:
        if total >= limit_bytes or not os.path.isfile(path) or os.path.islink(path):
            continue
        try:
            if path.endswith(".gz"):
                with gzip.open(path, "rb") as fh:
                    data = fh.read(1 << 20)
            else:
                if os.path.getsize(path) > 1 << 20:
                    continue
                with open(path, "rb") as fh:
                    data = fh.read()
        except (OSError, EOFError):
            continue
        if len(data) < 64 or b"\0" in data[:4096]:  # binaries are not text
            continue
        docs.append(data)
        total += len(data)
    return docs


def split(docs: list[bytes], eval_bytes: int) -> tuple[list[bytes], list[bytes]]:
    total = 0
    for i, doc in enumerate(docs):
        total += len(doc)
        if total >= eval_bytes:
            return docs[: i + 1], docs[i + 1 :]
    raise SystemExit(f"only {total} bytes of text found")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-mb", type=float, default=10.0)
    ap.add_argument("--train-mb", type=float, default=20.0)
    ap.add_argument("--order", type=int, default=5)
    args = ap.parse_args()
    mb = 1_000_000
    t = time.perf_counter()
    eval_docs, train_docs = split(
        real_text_docs(int((args.eval_mb + args.train_mb) * mb)), int(args.eval_mb * mb)
    )
    t_read = time.perf_counter() - t
    n_eval, n_train = sum(map(len, eval_docs)), sum(map(len, train_docs))

    print(f"python {platform.python_version()}  numpy {np.__version__}  {platform.platform()}")
    print(f"cpu: {cpu_model()}  cores visible: {os.cpu_count()}"
          f"  loadavg: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"data: train {n_train / mb:.2f} MB ({len(train_docs)} docs), "
          f"eval {n_eval / mb:.2f} MB ({len(eval_docs)} docs), read in {t_read:.1f} s")

    t = time.perf_counter()
    counts = ngram.count_ngrams(train_docs, args.order)
    t_count = time.perf_counter() - t
    t = time.perf_counter()
    _ = counts._stats  # one-off derived tables (continuation counts, context totals, discounts)
    t_stats = time.perf_counter() - t
    t = time.perf_counter()
    es = ngram.prepare_eval(eval_docs, args.order)
    t_prep = time.perf_counter() - t
    t = time.perf_counter()
    rows = ngram.anchor_ladder(counts, es, args.order)
    t_score = time.perf_counter() - t

    types = ", ".join(f"{n + 1}:{len(k)}" for n, k in enumerate(counts.keys))
    print(f"train n-gram types per order: {types}")
    print(f"count_ngrams (train)            {t_count:7.2f} s  ({n_train / mb / t_count:.1f} MB/s)")
    print(f"derived tables (train, once)    {t_stats:7.2f} s")
    print(f"prepare_eval                    {t_prep:7.2f} s")
    print(f"score all rungs                 {t_score:7.2f} s")
    print(f"eval total incl. derived tables {t_stats + t_prep + t_score:7.2f} s  (target <= 10 s)")
    for r in rows:
        print(f"  {r['name']:<11} order {r['order']}  bpb {r['bpb']:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
