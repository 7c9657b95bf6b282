"""filter: raw corpus -> documents that pass the heuristics and the fastText quality classifier.

    dormouse filter --job "$(dormouse plan --preset tiny --stage filter)"

Outputs: docs-*.jsonl.zst ({id, text, source, quality}), quality_model.bin (when trained here),
per_file.json (read/kept per raw file). Corpus discovery (data/raw.py) resolves links, never out of the corpus
root, and reads each real file once; every path it does not read is in the manifest's corpus_files_ignored with its reason. Counters: docs_/bytes_ read, kept, dropped.<reason>; the
stage asserts read = kept + sum(dropped) for both. A document holding a chat-template byte (0x01-0x03)
is dropped (`chat_control_bytes`): those bytes mean turn boundaries to sft, rl and bench.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from dormouse.data import quality
from dormouse.data.filtering import filter_documents, granted_workers
from dormouse.data.fnv import fnv1a_64
from dormouse.data.readers import ReaderConfig, iter_records
from dormouse.core import progress
from dormouse.planner.job import check_raw_input, parse_job, summary, writer
from dormouse.core.store import sha256_file


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
