"""fastText quality classifier, DCLM style: train on hq/cc example sets, score P(hq) per document.

DCLM prepares text as `" ".join(text.strip().splitlines())`. fasttext 0.9.3's Python `predict`
breaks under numpy 2 ("Unable to avoid copy"), so scoring calls the binding (`model.f`) directly.
"""

from __future__ import annotations

import multiprocessing
import random
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import fasttext
import numpy as np

LABEL_LQ = "__label__cc"


def prepare(text: str, max_bytes: int | None = None) -> str:
    flat = " ".join(text.strip().splitlines())
    if max_bytes is not None and len(flat) > max_bytes // 4:  # cheap guard before encoding
        flat = flat.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")  # cut at a char boundary
    return flat


def example_pieces(text: str, piece_bytes: int) -> list[str]:
    """Cut an example document into pieces of about `piece_bytes` at line boundaries: a small example
    set then still gives fastText enough rows to learn from. Each piece is prepared (lines joined)."""
    pieces, cur, size = [], [], 0
    for line in text.splitlines():
        cur.append(line)
        size += len(line) + 1
        if size >= piece_bytes:
            pieces.append(prepare("\n".join(cur), piece_bytes * 2))
            cur, size = [], 0
    if cur and (size >= piece_bytes // 4 or not pieces):
        pieces.append(prepare("\n".join(cur), piece_bytes * 2))
    return [p for p in pieces if p.strip()]


def write_training_file(path: Path, examples: list[tuple[str, str]], seed: int) -> None:
    rows = [f"{label} {text}" for label, text in examples if text]
    random.Random(seed).shuffle(rows)
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


NAN_HALVINGS = 3


def train(train_file: Path, cfg: dict, counters, source: str) -> tuple[fasttext.FastText._FastText, float]:
    """Train on `train_file`; returns the model and the learning rate it trained at.

    fastText raises "Encountered NaN." when training diverges, which its authors put down to too high
    a learning rate for the data. Policy: retry once at the same rate (a fault that does not repeat
    leaves the model every other machine gets), then halve the rate up to NAN_HALVINGS times. Each NaN
    is counted in `quality.train_nan`; `source` names the example sets in the final error."""
    lr = cfg["lr"]
    counters["quality.train_nan"] += 0  # the key is in the manifest, zero or not
    for attempt in range(2 + NAN_HALVINGS):
        if attempt >= 2:
            lr /= 2
        try:
            return _train_once(train_file, cfg, lr), lr
        except RuntimeError as e:
            if "NaN" not in str(e):
                raise
            counters["quality.train_nan"] += 1
            print(f"[quality] fastText diverged (NaN) at lr {lr:g}", flush=True)
    raise SystemExit(f"{source}: fastText training diverged (NaN) at every learning rate tried, "
                     f"{cfg['lr']:g} down to {lr:g}; lower data.filter.quality.train.lr")


def _train_once(train_file: Path, cfg: dict, lr: float) -> fasttext.FastText._FastText:
    """One training in a process of its own, the model back through a file. fasttext 0.9.3 trained again in one
    process diverges where a fresh process does not (measured: 16 trainings in a row at lr 0.5 on the test examples,
    one process, hit NaN at 0.5 and every halving below it; a fresh process trains there every time), so a retry
    in the same process would not be one. Spawned, not forked: a fresh interpreter, nothing of this one's memory."""
    with tempfile.TemporaryDirectory() as tmp, \
            ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        path = Path(tmp) / "model.bin"
        pool.submit(_train_and_save, str(train_file), cfg, lr, str(path)).result()  # a NaN raises its RuntimeError here
        return load(path)


def _train_and_save(train_file: str, cfg: dict, lr: float, path: str) -> None:
    _train_here(Path(train_file), cfg, lr).save_model(path)


def _train_here(train_file: Path, cfg: dict, lr: float) -> fasttext.FastText._FastText:
    return fasttext.train_supervised(
        input=str(train_file),
        epoch=cfg["epoch"],
        lr=lr,
        wordNgrams=cfg["word_ngrams"],
        dim=cfg["dim"],
        minCount=cfg["min_count"],
        bucket=cfg.get("bucket", 200_000),  # fastText's 2M default makes a 500 MB model at dim 64
        seed=cfg["seed"],
        thread=1,  # one thread: the only deterministic setting
        verbose=0,
    )


def load(path: Path):
    return fasttext.load_model(str(path))


def _dictionary(model) -> list[str]:
    """The words then the labels, as bytes decoded with surrogateescape: exactly what is saved, whatever the bytes."""
    return [*model.f.getVocab("surrogateescape")[0], *model.f.getLabels("surrogateescape")[0]]


def saved_size(model) -> int:
    """The bytes fastText 0.9's saveModel writes for a model as train_supervised leaves it (not quantized): magic and
    version, 12 int args and a double, the dictionary (3 int32 and 2 int64 sizes, then per entry its bytes, a NUL,
    an int64 count and an int8 type), the quant flag, the input matrix (int64 rows and cols, float32s), the qout
    flag and the output matrix."""
    if model.is_quantized():
        raise ValueError("saved_size: a quantized model's file has another layout")
    entries = sum(len(w.encode("utf-8", "surrogateescape")) + 1 + 8 + 1 for w in _dictionary(model))
    matrices = 4 * (model.get_input_matrix().size + model.get_output_matrix().size)
    return 8 + (12 * 4 + 8) + (3 * 4 + 2 * 8) + entries + 1 + 16 + 1 + 16 + matrices


def save(model, path: Path) -> None:
    """save_model, then check the file: fastText ignores a failed write (a full disk left 5 MB of a 51 MB model),
    and a cut file still loads, its matrices zero-filled. So its size must be what the model takes, and reloaded it
    must be the model: same labels, words and matrices."""
    model.save_model(str(path))
    size, expected = path.stat().st_size, saved_size(model)
    if size != expected:
        raise SystemExit(f"{path}: fastText saved {size} bytes of the {expected} its model takes "
                         f"(a short write: is the disk full?)")
    back = load(path)
    same = (_dictionary(back) == _dictionary(model)
            and np.array_equal(back.get_input_matrix(), model.get_input_matrix())
            and np.array_equal(back.get_output_matrix(), model.get_output_matrix()))
    if not same:
        raise SystemExit(f"{path}: the fastText model reloaded from it differs from the one trained (a corrupt write)")


def score(model, texts: list[str], label_hq: str) -> list[float]:
    """P(label_hq) for each (already prepared) text."""
    if not texts:
        return []
    labels, probs = model.f.multilinePredict(texts, 2, 0.0, "strict")
    out = []
    for ls, ps in zip(labels, probs, strict=True):
        p = dict(zip(ls, map(float, ps)))
        if label_hq not in p and len(model.labels) > 2:
            raise ValueError(f"model has labels {model.labels}; {label_hq} not among the top two")
        out.append(p.get(label_hq, 0.0))
    return out


def check_labels(model, label_hq: str, source: str) -> None:
    if label_hq not in model.labels:
        raise ValueError(f"{source}: fastText model has labels {model.labels}, not {label_hq!r}")
