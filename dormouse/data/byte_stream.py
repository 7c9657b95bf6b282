"""Byte batches over the train shards, resumable to the exact byte, and the fixed eval window.

Train: each epoch visits every shard once in an order drawn from (seed, epoch); the shards' bytes
are read as one stream cut into B equal lanes, and row b of a batch is the next T+1 bytes of lane
b (targets = inputs shifted by one), so the rows of a batch come from B distant parts of the corpus
rather than from one or two neighbouring documents. The position (epoch, cursor within a lane) is
the whole data state: saving and restoring it resumes at the same byte. Documents are concatenated as they are in the shard (no separator byte:
every byte value is text to a byte model; the shard's .idx.npy keeps the boundaries).

Data parallelism: every rank builds the same stream (same shards, B, seed) and reads only its
`rows` of each global batch (rank r of W: rows r*B/W .. (r+1)*B/W - 1, contiguous); the position
advances by the global batch on every rank, so the state is the same everywhere and a checkpoint
taken under one world size resumes under any other.

Eval: the first `eval_bytes` of the eval tail, cut into rows of T+1 bytes, identical for every
evaluation (rewound each time) and reported with its byte count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class StreamState:
    epoch: int = 0
    cursor: int = 0  # bytes of this epoch's stream already consumed

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


class TrainStream:
    def __init__(self, shard_bins: list[Path], batch_size: int, seq_len: int, seed: int, state: StreamState | None = None,
                 rows: range | None = None):
        # An empty shard has nothing to give (and cannot be memory-mapped).
        self.shards = [np.memmap(p, dtype=np.uint8, mode="r") for p in shard_bins if Path(p).stat().st_size > 0]
        if not self.shards:
            raise ValueError(f"every train shard is empty: {[str(p) for p in shard_bins]}")
        self.B, self.T, self.seed = batch_size, seq_len, seed  # B: the global batch (all ranks)
        self.rows = range(batch_size) if rows is None else rows  # the rows of each batch this process reads
        if not self.rows or self.rows.step != 1 or self.rows.start < 0 or self.rows.stop > batch_size:
            raise ValueError(f"rows {self.rows} is not a contiguous non-empty slice of the {batch_size} batch rows")
        self.state = state or StreamState()
        self.epoch_bytes = sum(len(s) for s in self.shards)
        self.lane_bytes = self.epoch_bytes // batch_size
        if self.lane_bytes < seq_len + 1:
            raise ValueError(f"train shards hold {self.epoch_bytes} bytes, too few for {batch_size} lanes of {seq_len}+1")
        self._order_epoch = None

    def _order(self, epoch: int) -> list[np.ndarray]:
        if self._order_epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
            self._order_cache = [self.shards[i] for i in perm]
            self._order_epoch = epoch
        return self._order_cache

    def _read(self, epoch: int, start: int, n: int) -> np.ndarray:
        out, pos = [], 0
        for shard in self._order(epoch):
            end = pos + len(shard)
            if end > start and pos < start + n:
                a, b = max(start - pos, 0), min(start + n - pos, len(shard))
                out.append(np.asarray(shard[a:b]))
            pos = end
        return np.concatenate(out)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.state.cursor + self.T + 1 > self.lane_bytes:  # each lane's tail is skipped, not wrapped
            self.state = StreamState(self.state.epoch + 1, 0)
        rows = [self._read(self.state.epoch, b * self.lane_bytes + self.state.cursor, self.T + 1) for b in self.rows]
        buf = torch.from_numpy(np.stack(rows).astype(np.int64))  # (len(rows), T+1)
        self.state = StreamState(self.state.epoch, self.state.cursor + self.T)
        return buf[:, :-1], buf[:, 1:]

    def bytes_seen(self) -> int:
        """Train bytes consumed so far by all ranks together (all epochs); each lane's unread tail is not counted."""
        steps_per_epoch = (self.lane_bytes - 1) // self.T
        return (self.state.epoch * steps_per_epoch * self.T + self.state.cursor) * self.B

    def epochs_seen(self) -> float:
        return self.bytes_seen() / self.epoch_bytes


def planned_epochs(train_bytes: int, batch_size: int, seq_len: int, steps: int) -> float:
    """Passes over the train shards a run of `steps` batches reads (TrainStream's epochs_seen at its end, up to
    the lane tails it skips)."""
    return steps * batch_size * seq_len / max(train_bytes, 1)


def check_epochs(who: str, n: int, where, *, steps: int, batch_size: int, seq_len: int, max_epochs: float | None) -> None:
    """Refuse a run planned past `max_epochs` passes over its `n` bytes of train shards (None: no ceiling); print the
    planned passes otherwise."""
    passes = planned_epochs(n, batch_size, seq_len, steps)
    if max_epochs is not None and passes > max_epochs:
        raise SystemExit(
            f"{who} plans {steps} steps x {batch_size} x {seq_len} = {steps * batch_size * seq_len:,} bytes, "
            f"{passes:.1f} passes over its {n:,} bytes of train shards ({where}), past train.max_epochs "
            f"{max_epochs}: a repeated corpus is memorised and the eval BPB stops measuring the model. "
            "Bring more text (corpus=...), lower train.steps, or raise train.max_epochs if the repeats are meant.")
    print(f"[pretrain] planned passes over the train shards: {passes:.2f} ({n:,} bytes; max_epochs {max_epochs})",
          flush=True)


def eval_targets(n_tail_bytes: int, eval_bytes: int, seq_len: int) -> tuple[int, int]:
    """[start, stop) of the eval tail's bytes that the eval window scores: rows of seq_len targets from byte 1
    (each row's inputs start one byte earlier), as many whole rows as eval_bytes and the tail allow. The
    anchors stage scores the same bytes."""
    rows = min(eval_bytes, n_tail_bytes - 1) // seq_len
    return 1, 1 + max(rows, 0) * seq_len


def eval_window(eval_bin: Path, eval_bytes: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(inputs, targets, n_target_bytes): rows of seq_len+1 bytes from the start of the eval tail."""
    data = np.fromfile(eval_bin, dtype=np.uint8)
    rows = (eval_targets(len(data), eval_bytes, seq_len)[1] - 1) // seq_len
    if rows < 1:
        raise ValueError(f"{eval_bin}: {len(data)} bytes; cannot fill one eval row of {seq_len + 1}")
    usable = data[: rows * seq_len + 1]
    x = np.lib.stride_tricks.sliding_window_view(usable, seq_len + 1)[::seq_len][:rows]
    t = torch.from_numpy(np.ascontiguousarray(x).astype(np.int64))
    return t[:, :-1], t[:, 1:], rows * seq_len
