"""The shard artifact's layout: written by the shard stage, read by pretrain, sft, anchors, export, rl and bench.
One owner of its paths, so that no reader spells them.

    train/shard-NNNN.bin        documents' UTF-8 bytes back to back, in hash order
    train/shard-NNNN.idx.npy    int64 offsets, n_docs + 1 (the document boundaries)
    train/shard-NNNN.ids.jsonl  one JSON id per document
    eval/tail.{bin,idx.npy,ids.jsonl}   the held-out eval tail, the same three files
    shards.json                 counts and the balance check
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TRAIN_DIR = "train/"
EVAL_STEM = "eval/tail"
EVAL_BIN = f"{EVAL_STEM}.bin"


def train_stem(i: int) -> str:
    return f"{TRAIN_DIR}shard-{i:04d}"


class ShardWriter:
    """One shard's three files, written in a single pass over its documents."""

    def __init__(self, art, stem: str):
        self.bin = open(art.path(f"{stem}.bin"), "wb")
        self.ids = open(art.path(f"{stem}.ids.jsonl"), "w", encoding="utf-8")
        self.idx_path = art.path(f"{stem}.idx.npy")
        self.offsets = [0]

    def write(self, doc_id: str, data: bytes) -> None:
        self.bin.write(data)
        self.ids.write(json.dumps(doc_id, ensure_ascii=False) + "\n")
        self.offsets.append(self.offsets[-1] + len(data))

    def close(self) -> dict:
        self.bin.close()
        self.ids.close()
        np.save(self.idx_path, np.asarray(self.offsets, dtype=np.int64))
        return {"docs": len(self.offsets) - 1, "bytes": self.offsets[-1]}


def eval_bin(art) -> Path:
    """The eval tail's bytes (verified against the manifest on first read)."""
    return art.file(EVAL_BIN)


def train_stems(art) -> list[str]:
    return [n[: -len(".bin")] for n in art.files(TRAIN_DIR) if n.endswith(".bin")]


def train_bins(art) -> list[Path]:
    return [art.file(f"{stem}.bin") for stem in train_stems(art)]


def train_bytes(manifest: dict) -> int:
    """Bytes of the train shards from a shard manifest, without reading them (what TrainStream reads)."""
    return sum(m["size"] for name, m in manifest["files"].items() if name.startswith(TRAIN_DIR) and name.endswith(".bin"))


def doc_offsets(bin_path: Path, idx_path: Path) -> np.ndarray:
    """A shard's document offsets, checked to span its .bin (the documents are the file's bytes, as the eval window
    reads them)."""
    offsets = np.load(idx_path)
    size = bin_path.stat().st_size
    if offsets[0] != 0 or offsets[-1] != size:
        raise SystemExit(f"{idx_path}: offsets {offsets[0]}..{offsets[-1]} do not span the {size} bytes of {bin_path}")
    return offsets


def iter_docs(bin_path: Path, idx_path: Path) -> Iterator[bytes]:
    """The documents in order, read one at a time: memory is one document, not the shard (it held the shard twice)."""
    offsets = doc_offsets(bin_path, idx_path)
    with open(bin_path, "rb", buffering=1 << 20) as f:
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            yield f.read(b - a)


def docs(art, stems: list[str]) -> Iterator[bytes]:
    """The documents of the named shards (stems as train_stems gives them, or EVAL_STEM), in order."""
    for stem in stems:
        yield from iter_docs(art.file(f"{stem}.bin"), art.file(f"{stem}.idx.npy"))
