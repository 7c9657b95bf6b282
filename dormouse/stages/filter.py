"""filter: raw corpus -> documents that pass the heuristics and the fastText quality classifier.

    dormouse filter --job "$(dormouse plan --preset tiny --stage filter)"

Outputs: docs-*.jsonl.zst ({id, text, source, quality}), quality_model.bin (when trained here),
per_file.json (read/kept per raw file). Corpus discovery (engine/raw.py) resolves links, never out of the corpus
root, and reads each real file once; every path it does not read is in the manifest's corpus_files_ignored with its reason. Counters: docs_/bytes_ read, kept, dropped.<reason>; the
stage asserts read = kept + sum(dropped) for both. A document holding a chat-template byte (0x01-0x03)
is dropped (`chat_control_bytes`): those bytes mean turn boundaries to sft, rl and bench.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from dormouse.data import quality
from dormouse.data.docs_io import PartWriter, read_parts
from dormouse.data.fnv import fnv1a_64
from dormouse.data.heuristics import heuristic_drop_reason
from dormouse.data.readers import ReaderConfig, read_file
from dormouse.engine import progress
from dormouse.engine.raw import RAW_SUFFIXES, expand_raw, ignored_files, scan_raw
from dormouse.engine.stage import check_raw_input, parse_job, summary, writer
from dormouse.engine.store import sha256_file
from dormouse.posttrain.chat import RESERVED_PATTERN

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


def iter_records(specs: list[str], cfg: ReaderConfig, counters: Counter, files_out: list | None = None,
                 ignored_out: list | None = None):
    for spec in specs:
        base = Path(spec)
        scan = scan_raw(spec)
        counters["corpus_links_followed"] += scan.links_followed
        counters["corpus_duplicate_paths"] += scan.duplicate_paths
        for entry in ignored_files(spec):
            reason = entry["reason"].split(":")[0]
            counters[f"reader.files_ignored.{reason}"] += 1
            if ignored_out is not None:
                ignored_out.append(entry)
            why = (f"no reader for its suffix (expected {', '.join(RAW_SUFFIXES)})" if reason == "unknown_suffix"
                   else f"a link to {entry['resolves_to']}, outside {spec} (link_outside_root; to read it, point the "
                        f"corpus at a directory holding both)" if reason == "link_outside_root"
                   else entry["reason"] + (f" (the same as {entry['same_as']})" if "same_as" in entry else ""))
            print(f"[filter] not reading {entry['path']}: {why}", flush=True)
        for path in expand_raw(spec):
            rel = path.relative_to(base).as_posix() if base.is_dir() else path.as_posix()
            if files_out is not None:
                files_out.append({"path": str(path), "size": path.stat().st_size, "sha256": sha256_file(path)})
            yield from read_file(path, rel, cfg, counters)


def train_classifier(job, art, qcfg, reader_cfg, counters) -> tuple[object, dict]:
    """(model, metrics); the model is saved as the artifact's quality_model.bin (the workers load it there)."""
    tcfg = qcfg["train"]
    examples = {"train": [], "valid": []}
    for side, label in (("positive", qcfg["label_hq"]), ("negative", quality.LABEL_LQ)):
        specs = check_raw_input(job, side)
        read = Counter()  # the example sets' reader counts (skips, ignored files) into the manifest, by side
        for rec in iter_records(specs, reader_cfg, read):
            if rec.skip or not rec.text.strip():
                counters[f"quality.examples_skipped.{side}"] += 1
                continue
            split = "valid" if fnv1a_64(f"{side}:{rec.id}") % 10 == 0 else "train"  # fixed 10% held out
            pieces = quality.example_pieces(rec.text, tcfg["example_piece_bytes"])
            examples[split].extend((label, piece) for piece in pieces)
            counters[f"quality.example_docs_{split}.{side}"] += 1
            counters[f"quality.example_pieces_{split}.{side}"] += len(pieces)
        for k, v in read.items():
            counters[f"quality.examples.{side}.{k}"] += v
    for side in ("positive", "negative"):
        if not counters[f"quality.example_pieces_train.{side}"]:
            raise SystemExit(f"filter: the {side} example set {job['inputs'][side]['specs']} yields no text")
    with tempfile.TemporaryDirectory() as tmp:
        train_file, valid_file = Path(tmp) / "train.txt", Path(tmp) / "valid.txt"
        quality.write_training_file(train_file, examples["train"], tcfg["seed"])
        source = f"the example sets {job['inputs']['positive']['specs']} / {job['inputs']['negative']['specs']}"
        model, lr = quality.train(train_file, tcfg, counters, source)
        metrics = {"train_lr": lr}
        if examples["valid"]:
            quality.write_training_file(valid_file, examples["valid"], tcfg["seed"])
            n, precision, recall = model.test(str(valid_file))
            metrics |= {"valid_examples": n, "valid_precision_at_1": precision, "valid_recall_at_1": recall}
    quality.save(model, art.path("quality_model.bin"))  # checked: a short write fails the stage here
    print(f"[filter] quality classifier trained: {metrics}", flush=True)
    return model, metrics


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


def main(argv=None) -> int:
    job = parse_job(argv, "filter", __doc__)
    params = job["params"]
    reader_cfg = ReaderConfig(**params["reader"])
    qcfg = params["quality"]
    if (qcfg["threshold"] is None) == (qcfg["top_fraction"] is None):
        raise SystemExit("filter: set exactly one of data.filter.quality.threshold and top_fraction")
    corpus_specs = check_raw_input(job, "corpus")

    with writer(job) as art:
        c = art.counters
        if qcfg["model"] == "train":
            model, metrics = train_classifier(job, art, qcfg, reader_cfg, c)
            model_path = art.path("quality_model.bin")
            art.extra["quality_model"] = {"trained": True, **metrics}
        else:
            (model_path,) = check_raw_input(job, "quality_model")
            model = quality.load(Path(model_path))
            art.extra["quality_model"] = {"trained": False, "path": model_path, "sha256": sha256_file(Path(model_path))}
        quality.check_labels(model, qcfg["label_hq"], "data.filter.quality.model")

        per_file: dict[str, Counter] = defaultdict(Counter)
        corpus_files: list[dict] = []
        ignored: list[str] = []
        records = iter_records(corpus_specs, reader_cfg, c, corpus_files, ignored)
        records = progress.track(records, "filter", "doc")
        workers = granted_workers()
        print(f"[filter] heuristics on {workers} worker process{'es' if workers > 1 else ''}", flush=True)
        art.extra["quality_cutoff"] = filter_documents(records, params, model, Path(model_path), c, art.path, per_file, workers)
        art.extra["workers"] = workers  # not a param: every worker count writes the same documents

        for unit in ("docs", "bytes"):
            dropped = sum(v for k, v in c.items() if k.startswith(f"{unit}_dropped."))
            assert c[f"{unit}_read"] == c[f"{unit}_kept"] + dropped, f"{unit}: read != kept + dropped ({dict(c)})"
        if not c["docs_kept"]:
            raise SystemExit(f"filter: no document survived; counters: {dict(c)}")
        art.extra["corpus_files"] = corpus_files
        art.extra["corpus_files_ignored"] = ignored
        art.extra["corpus_sha256"] = hashlib.sha256("".join(f["sha256"] for f in corpus_files).encode()).hexdigest()
        art.path("per_file.json").write_text(json.dumps({k: dict(v) for k, v in sorted(per_file.items())}, indent=1))
        summary("filter", c)
    return 0
