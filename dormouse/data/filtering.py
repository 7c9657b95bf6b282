"""The filter's core: each document's drop reason (size, chat-template bytes, the Gopher/C4 heuristics) and fastText
score, over worker processes, then keep by threshold or top fraction, counted per reason and per raw file. The stage
(dormouse/stages/filter.py) reads the corpus, trains or loads the classifier and writes the manifest."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from dormouse.data import quality
from dormouse.data.docs_io import PartWriter, read_parts
from dormouse.data.heuristics import heuristic_drop_reason
from dormouse.data.chat import RESERVED_PATTERN

JUDGE_BATCH = 64  # documents per task: one fastText call, one round trip to a worker
IN_FLIGHT_PER_WORKER = 4  # tasks ahead of the one being consumed: bounds memory whatever the corpus size


def judged(records, params: dict, model, model_path: Path, workers: int):
    """(record, drop reason or None, P(hq) or None) for every record, in corpus order. The reasons (size, chat
    bytes, the Gopher/C4 heuristics: pure Python, most of the filter's time) and the fastText scores of the
    documents they keep are computed by `workers` processes (each loads the model from `model_path`) over
    batches of documents when workers > 1, with a bounded number of batches in flight; the result is the same
    whatever the worker count (tests/test_filter_workers.py)."""
    from itertools import islice

    records = iter(records)
    if workers <= 1:
        while batch := list(islice(records, JUDGE_BATCH)):
            yield from zip(batch, *_judge([(r.text, r.nbytes, r.skip) for r in batch], params, model), strict=True)
        return
    import multiprocessing
    from collections import deque

    # spawn: no fork of a parent that holds threads (tqdm's monitor) and a loaded model
    with multiprocessing.get_context("spawn").Pool(workers, _load_worker_model, (str(model_path),)) as pool:
        pending: deque = deque()
        while True:
            batch = list(islice(records, JUDGE_BATCH))
            if batch:
                work = [(r.text, r.nbytes, r.skip) for r in batch]
                pending.append((batch, pool.apply_async(_judge_in_worker, (work, params))))
            while pending and (not batch or len(pending) > workers * IN_FLIGHT_PER_WORKER):
                done, result = pending.popleft()
                yield from zip(done, *result.get(), strict=True)
            if not batch:
                return


_WORKER_MODEL = None


def _load_worker_model(path: str) -> None:
    global _WORKER_MODEL
    _WORKER_MODEL = quality.load(Path(path))


def _judge_in_worker(work: list[tuple], params: dict):
    return _judge(work, params, _WORKER_MODEL)


def _judge(work: list[tuple], params: dict, model) -> tuple[list, list]:
    """Drop reasons for a batch of (text, nbytes, skip), and P(hq) of the documents that pass them."""
    reasons = [_reason(text, nbytes, skip, params) for text, nbytes, skip in work]
    keep = [i for i, r in enumerate(reasons) if r is None]
    scores: list = [None] * len(work)
    got = quality.score(model, [quality.prepare(work[i][0]) for i in keep], params["quality"]["label_hq"])
    for i, sc in zip(keep, got, strict=True):
        scores[i] = sc
    return reasons, scores


def _reason(text: str, nbytes: int, skip: str | None, params: dict) -> str | None:
    """Why a document is dropped before the classifier, or None."""
    if skip is not None:
        return skip
    if nbytes < params["min_doc_bytes"]:
        return "too_small"
    if RESERVED_PATTERN.search(text):
        return "chat_control_bytes"
    return heuristic_drop_reason(text, params["heuristics"])


def granted_workers() -> int:
    """The cores this job may use: Snakemake's grant to the rule (it exports OMP_NUM_THREADS = threads to every
    shell job; SLURM's cpus-per-task lands there too), else the cores this process may run on."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return len(os.sched_getaffinity(0))


def filter_documents(records, params: dict, model, model_path: Path, c: Counter, path_for, per_file: dict,
                     workers: int = 1) -> float | None:
    """The filter proper: heuristics and fastText scores (over `workers` processes), then keep by threshold or
    top fraction. Writes docs-*.jsonl.zst through `path_for(name)`; returns the score cutoff used."""
    qcfg = params["quality"]
    if qcfg["top_fraction"] is None:  # a threshold: each document's fate is known as it is scored, one pass
        with PartWriter(path_for, "docs") as out:
            for rec, reason, score in judged(records, params, model, model_path, workers):
                _count_read(c, per_file, rec, reason)
                if reason is None:
                    _keep_or_drop(c, per_file, out, {"id": rec.id, "text": rec.text, "source": rec.source,
                                                     "quality": round(score, 6)}, rec.nbytes, score >= qcfg["threshold"])
        return qcfg["threshold"]
    # a top fraction: the cutoff is known once every document is scored, so candidates wait in scratch parts
    scratch = Path(tempfile.mkdtemp(prefix="dormouse-filter-"))
    try:
        cand = PartWriter(lambda n: scratch / n, "cand")
        scores: list[float] = []
        for rec, reason, score in judged(records, params, model, model_path, workers):
            _count_read(c, per_file, rec, reason)
            if reason is None:
                cand.write({"id": rec.id, "text": rec.text, "source": rec.source, "quality": round(score, 6)})
                scores.append(score)
        cand.close()
        scores_arr = np.asarray(scores, dtype=np.float64)
        k = int(np.ceil(qcfg["top_fraction"] * len(scores_arr)))
        order = np.argsort(-scores_arr, kind="stable")  # ties keep corpus order
        keep = np.zeros(len(scores_arr), dtype=bool)
        keep[order[:k]] = True
        with PartWriter(path_for, "docs") as out:
            for i, doc in enumerate(read_parts([scratch / n for n in cand.names])):
                _keep_or_drop(c, per_file, out, doc, len(doc["text"].encode("utf-8")), keep[i])
        return float(scores_arr[order[k - 1]]) if k else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _count_read(c: Counter, per_file: dict, rec, reason: str | None) -> None:
    c["docs_read"] += 1
    c["bytes_read"] += rec.nbytes
    per_file[rec.source]["docs_read"] += 1
    if reason is not None:
        c[f"docs_dropped.{reason}"] += 1
        c[f"bytes_dropped.{reason}"] += rec.nbytes


def _keep_or_drop(c: Counter, per_file: dict, out, doc: dict, nbytes: int, keep: bool) -> None:
    if keep:
        out.write(doc)
        c["docs_kept"] += 1
        c["bytes_kept"] += nbytes
        per_file[doc["source"]]["docs_kept"] += 1
    else:
        c["docs_dropped.quality_low_score"] += 1
        c["bytes_dropped.quality_low_score"] += nbytes
