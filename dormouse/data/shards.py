"""The shard artifact's layout: written by the shard stage, read by pretrain, sft, anchors, export, rl and bench.
One owner of its paths, so that no reader spells them.

    train/shard-NNNN.bin        documents' UTF-8 bytes back to back, in hash order
    train/shard-NNNN.idx.npy    int64 offsets, n_docs + 1 (the document boundaries)
    train/shard-NNNN.ids.jsonl  one JSON id per document
    eval/tail.{bin,idx.npy,ids.jsonl}   the held-out eval tail, the same three files
    shards.json                 counts and the balance check

and the stage's work that writes it (shard_documents: pass 1 decodes and hashes, the eval tail's cutoff, pass 2
routes), as dormouse/stages/shard.py documents.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dormouse.data.docs_io import read_parts
from dormouse.data.fnv import doc_hash
from dormouse.core import progress

TRAIN_DIR = "train/"
# Keys added to data.shard after digests were pinned: left out of the params at their default, so every preset
# that does not set them keeps its digest (shard_documents applies the same defaults when a key is absent).
SHARD_DEFAULTS_NOT_DIGESTED = {"eval_tail_fraction": None, "eval_tail_min_bytes": None, "eval_tail_max_bytes": None,
                               "eval_tail_min_docs": None, "eval_tail_max_docs": None, "eval_tail_warn_below": 100,
                               "eval_tail_max_share": 0.2}
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


def content_key(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def balance(shard_bytes: np.ndarray, doc_sizes: np.ndarray) -> dict:
    """Stated bound: routing by a uniform hash puts each document in a shard with probability 1/N,
    so shard bytes have mean S/N and std sqrt((1/N)(1-1/N) * sum(s_i^2)). Every shard must lie
    within 5 std of the mean (a chance failure has probability ~N * 6e-7)."""
    n = len(shard_bytes)
    sq = float(np.square(doc_sizes.astype(np.float64)).sum())
    std = (sq * (1 / n) * (1 - 1 / n)) ** 0.5
    mean = float(shard_bytes.mean()) if n else 0.0
    return {
        "mean_bytes": mean,
        "expected_std_bytes": std,
        "bound_bytes": 5 * std,
        "max_abs_deviation_bytes": float(np.abs(shard_bytes - mean).max()) if n else 0.0,
    }


def group_of(doc_id: str, part_pattern: re.Pattern | None) -> str:
    """The id of the document's group: `part_pattern` deleted from its id (an id that is all pattern is its own group)."""
    return (part_pattern.sub("", doc_id) or doc_id) if part_pattern is not None else doc_id


def tail_size(cum_bytes: np.ndarray, eval_target: int, sizing: dict | None = None) -> int:
    """How many documents, in group-hash order (`cum_bytes` their cumulative bytes), the tail takes before its
    last group is completed: to `eval_target` bytes, or `eval_tail_fraction` of the corpus within
    [eval_tail_min_bytes, eval_tail_max_bytes]; then at least eval_tail_min_docs, at most eval_tail_max_docs,
    eval_tail_max_bytes and eval_tail_max_share of the corpus's bytes (caps win; at least one document). No sizing
    keys: the plain byte target (the stage passes the defaults, eval_tail_max_share 0.2 among them)."""
    sizing = {k: v for k, v in (sizing or {}).items() if v is not None}
    if not len(cum_bytes):
        return 0
    target = eval_target
    if "eval_tail_fraction" in sizing:
        target = int(sizing["eval_tail_fraction"] * int(cum_bytes[-1]))
    target = max(target, sizing.get("eval_tail_min_bytes", 0))
    n = int(np.searchsorted(cum_bytes, target) + 1)
    n = max(n, sizing.get("eval_tail_min_docs", 0))
    if "eval_tail_max_bytes" in sizing:
        n = min(n, max(1, int(np.searchsorted(cum_bytes, sizing["eval_tail_max_bytes"], side="right"))))
    if "eval_tail_max_docs" in sizing:
        n = min(n, sizing["eval_tail_max_docs"])
    if "eval_tail_max_share" in sizing:
        cap = sizing["eval_tail_max_share"] * int(cum_bytes[-1])
        n = min(n, max(1, int(np.searchsorted(cum_bytes, cap, side="right"))))
    return n


def whole_groups(n: int, keys: np.ndarray, cum_bytes: np.ndarray, cap: float | None = None) -> int:
    """The tail's document count once its last group is whole (`keys`: the documents' group hashes in tail order,
    so a group's documents are adjacent): `n` rounded up to its group's end; over `cap` bytes, back to the last
    group end within the cap (the first group at least: a tail is never empty)."""
    if n == 0:
        return 0
    ends = np.flatnonzero(np.r_[keys[1:] != keys[:-1], True]) + 1  # each group's exclusive end
    m = int(ends[np.searchsorted(ends, min(n, len(keys)))])  # a target past the corpus: every group
    if cap is not None and cum_bytes[m - 1] > cap:
        within = ends[cum_bytes[ends - 1] <= cap]
        m = int(within[-1]) if len(within) else int(ends[0])
    return m


TAIL_ADVICE = ("lower data.shard.eval_tail_bytes, or size the tail from the corpus: data.shard.eval_tail_fraction "
               "(e.g. 0.05) with eval_tail_min_bytes / eval_tail_max_bytes / eval_tail_max_docs")


def warn(art, warning: str) -> None:
    """A warning in the manifest (bench.json carries it up; the run's closing summary prints it) and on the terminal."""
    art.extra.setdefault("warnings", []).append(warning)
    progress.note(f"[shard] WARNING: {warning}")


def _decode_pass(parts: list[Path], pattern: re.Pattern | None, texts_path: Path):
    """Pass 1: decode every document once into `texts_path`; (ids, id hashes, group hashes, byte offsets)."""
    ids, hashes, group_hashes, offsets = [], [], [], [0]
    with open(texts_path, "wb") as texts:
        for doc in progress.track(read_parts(parts), "shard", "doc", label="pass 1"):
            data = doc["text"].encode("utf-8")
            texts.write(data)
            ids.append(doc["id"])
            hashes.append(doc_hash(doc["id"]))
            group_hashes.append(doc_hash(group_of(doc["id"], pattern)))
            offsets.append(offsets[-1] + len(data))
    return (ids, np.asarray(hashes, dtype=np.uint64), np.asarray(group_hashes, dtype=np.uint64),
            np.asarray(offsets, dtype=np.int64))


def eval_cutoff(gh: np.ndarray, sz: np.ndarray, eval_target: int, sizing: dict, share: float | None, art,
                part_pattern: str | None, warn_below: int) -> int:
    """The tail's cutoff group hash (a document is eval iff its group hash <= it): the smallest group hashes to the
    target (tail_size), whole groups, the share cap; fails when the tail would take the whole corpus, warns (in the
    manifest) when a cap cut it or it is small."""
    by_group = np.argsort(gh, kind="stable")  # a group's documents share a hash: they are taken together
    cum, keys = np.cumsum(sz[by_group]), gh[by_group]
    n_eval, n_groups = tail_size(cum, eval_target, sizing), len(np.unique(gh))
    corpus = f"the corpus has {int(sz.sum())} bytes in {len(gh)} documents, {n_groups} groups"
    if n_eval >= len(gh):
        raise SystemExit(f"shard: the eval tail (eval_tail_bytes={eval_target}, sizing {sizing or 'none'}) takes the "
                         f"whole corpus: {corpus}; {TAIL_ADVICE}")
    # the share cap holds after the last group is made whole (the byte caps, as before it, hold before)
    n_eval = whole_groups(n_eval, keys, cum, None if share is None else share * int(cum[-1]))
    cutoff = int(keys[n_eval - 1])
    is_eval = gh <= np.uint64(cutoff)
    if is_eval.all():
        if n_groups == 1:  # ids that tie (e.g. one constant id for every document)
            raise SystemExit(f"shard: every document hashed into the eval tail ({corpus}: they share one group "
                             f"hash); are the document ids unique (data.reader.id_field), and does "
                             f"data.shard.part_pattern={part_pattern!r} leave them distinct?")
        raise SystemExit(f"shard: every document went to the eval tail: its last group completes the corpus "
                         f"({corpus}; the tail needed {n_eval} documents to reach its target); {TAIL_ADVICE}")
    groups, group_sizes = np.unique(gh, return_counts=True)
    art.counters["groups"] = len(groups)
    art.counters["groups_of_several_parts"] = int((group_sizes > 1).sum())
    art.counters["eval_groups"] = int((groups <= np.uint64(cutoff)).sum())
    n_eval_docs = int(is_eval.sum())
    tail_bytes, kept = int(sz[is_eval].sum()), int(sz.sum())
    uncapped = whole_groups(tail_size(cum, eval_target, {k: v for k, v in sizing.items() if k != "eval_tail_max_share"}),
                            keys, cum)
    if share is not None and n_eval < uncapped:
        warn(art, f"the eval tail was capped at eval_tail_max_share={share} of the corpus: {tail_bytes} bytes "
                  f"({tail_bytes / kept:.1%} of {kept}) where eval_tail_bytes / the sizing keys asked for more; "
                  f"the rest trains (a small corpus: its eval BPB rests on a small tail)")
    if share is not None and tail_bytes > share * kept:
        warn(art, f"the eval tail holds {tail_bytes / kept:.1%} of the corpus's {kept} bytes, over "
                  f"eval_tail_max_share={share}: its one group is that large (a tail holds whole groups); "
                  f"{TAIL_ADVICE}")
    if warn_below and (n_eval_docs < warn_below or art.counters["eval_groups"] < warn_below):
        warn(art, f"the eval tail holds {n_eval_docs} documents in {art.counters['eval_groups']} groups "
                  f"(< eval_tail_warn_below={warn_below}): every eval BPB rests on them; {TAIL_ADVICE}")
    return cutoff


def _route_pass(art, texts_path: Path, ids: list, h: np.ndarray, off: np.ndarray, is_eval: np.ndarray,
                n_shards: int) -> tuple[dict, list[dict]]:
    """Pass 2: write every document from the scratch bytes, in hash order, to the tail or its train shard; a train
    text byte-identical to an eval text is dropped (counted). Returns (tail info, per-shard info)."""
    sz = np.diff(off)
    buf = np.memmap(texts_path, dtype=np.uint8, mode="r") if off[-1] else np.zeros(0, np.uint8)
    text_of = lambda i: buf[off[i] : off[i + 1]].tobytes()
    # Copies of eval texts can only hide among train documents of the same length.
    eval_idx = np.flatnonzero(is_eval)
    eval_keys = {content_key(text_of(i)) for i in eval_idx}
    eval_sizes = set(sz[eval_idx].tolist())
    c = art.counters
    tail = ShardWriter(art, EVAL_STEM)
    shards = [ShardWriter(art, train_stem(i)) for i in range(n_shards)]
    seen_ids = set()
    # Documents are written in hash order, not corpus order: the input is grouped by source
    # file (one domain after another) and a trainer reads a shard front to back.
    order = np.argsort(h, kind="stable")
    for i in progress.track(order, "shard", "doc", total=len(order), label="pass 2"):
        data = text_of(i)
        c["docs_in"] += 1
        c["bytes_in"] += len(data)
        if ids[i] in seen_ids:
            c["docs_duplicate_id"] += 1
        seen_ids.add(ids[i])
        if is_eval[i]:
            tail.write(ids[i], data)
            c["eval_docs"] += 1
            c["eval_bytes"] += len(data)
        elif len(data) in eval_sizes and content_key(data) in eval_keys:
            c["train_docs_dropped.duplicate_of_eval"] += 1
            c["train_bytes_dropped.duplicate_of_eval"] += len(data)
        else:
            shards[int(h[i]) % n_shards].write(ids[i], data)
            c["train_docs"] += 1
            c["train_bytes"] += len(data)
    tail_info, shard_info = tail.close(), [s.close() for s in shards]
    assert c["docs_in"] == c["eval_docs"] + c["train_docs"] + c["train_docs_dropped.duplicate_of_eval"]
    assert c["bytes_in"] == c["eval_bytes"] + c["train_bytes"] + c["train_bytes_dropped.duplicate_of_eval"]
    return tail_info, shard_info


def shard_documents(parts: list[Path], n_shards: int, eval_target: int, art, part_pattern: str | None = None,
                    sizing: dict | None = None) -> None:
    """The shard stage's work: route the documents of `parts` into `art` (anything with path(name),
    counters and extra, as an ArtifactWriter); the benchmark calls this same function. `sizing`: the
    eval_tail_* keys of data.shard (tail_size); eval_tail_warn_below (default 100) warns on a small tail."""
    sizing = {**SHARD_DEFAULTS_NOT_DIGESTED, **(sizing or {})}  # a key at its default is absent from the params
    warn_below = sizing.pop("eval_tail_warn_below")
    share = sizing["eval_tail_max_share"]
    sizing = {k: v for k, v in sizing.items() if v is not None}
    pattern = re.compile(part_pattern) if part_pattern else None
    scratch = Path(tempfile.mkdtemp(prefix="dormouse-shard-"))
    try:
        ids, h, gh, off = _decode_pass(parts, pattern, scratch / "texts.bin")
        sz = np.diff(off)
        cutoff = eval_cutoff(gh, sz, eval_target, sizing, share, art, part_pattern, warn_below)
        is_eval = gh <= np.uint64(cutoff)
        tail_info, shard_info = _route_pass(art, scratch / "texts.bin", ids, h, off, is_eval, n_shards)
        shard_bytes = np.array([s["bytes"] for s in shard_info], dtype=np.float64)
        summary_doc = {
            "balance": balance(shard_bytes, sz[~is_eval]),
            "num_shards": n_shards,
            "eval_cutoff_hash": f"{cutoff:016x}",  # fnv.doc_hash of the group id
            "part_pattern": part_pattern,
            "eval": tail_info,
            "train": shard_info,
            "train_bytes_max_over_mean": float(shard_bytes.max() / shard_bytes.mean()) if shard_bytes.mean() else None,
        }
        art.path("shards.json").write_text(json.dumps(summary_doc, indent=1))
        art.extra["shards"] = {k: v for k, v in summary_doc.items() if k != "train"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
