"""Engram: a hashed byte n-gram memory read by the input bytes and gated into the residual stream.

After deepseek-ai/Engram (engram_demo_v1.py), on bytes instead of compressed tokens.

Tables (one per (order, head); `engram_tables(cfg)` is the single source of truth for their sizes):
- order 1: exact, `vocab` rows (the current byte; every position has one).
- order 2: exact, `vocab**2 + 1` rows: row prev*vocab + cur (65 536 rows for bytes), plus one reserved
  "no n-gram" row (index vocab**2) read at position 0 of a sequence, which has no previous byte.
- order n >= 3: `engram_heads` hashed tables of `engram_rows` rows each. Head h of order n mixes the n
  bytes b_0 = x[t], b_1 = x[t-1], ... with its own odd 31-bit multipliers m_{n,h,k}:
      mix = (b_0 * m_0) XOR (b_1 * m_1) XOR ... XOR (b_{n-1} * m_{n-1});   row = mix mod p_{n,h}
  where the p are distinct primes <= engram_rows - 1 (the largest ones), shared by all Engram layers;
  the multipliers differ per layer (seeded by (stack position, order, head)). The last row,
  engram_rows - 1, is never produced by the hash and is the reserved "no n-gram" row for positions
  t < n - 1 (fewer than n - 1 bytes of history in this sequence).
  A reserved row is *read* (and learned: it acts as a "sequence start" embedding), never masked, so
  every position reads exactly one row per table and `rows_read` is exactly B*T*n_tables.
  Multipliers and moduli are persistent int64 buffers, so a checkpoint carries its own hash.

Forward (per position, causal: only x[t-n+1..t] and the hidden state at t; the optional conv looks back):
    e = concat of the looked-up rows                                    [n_tables * engram_dim]
    k = RMSNorm(W_k e),  q = RMSNorm(h),  gate = sigmoid(signed_sqrt(q.k / sqrt(D)))
    v = gate * W_v e
    out = v + silu(causal_depthwise_conv(RMSNorm(v)))   (kernel ENGRAM_CONV_SIZE, dilation max order)
and the block adds `out` to its residual before its mixer. W_v is the branch's output projection.
`forward(x, idx, counters, state) -> (out, EngramState)`: the state (last max_order - 1 bytes, bytes seen,
the conv's (conv_size - 1) * max_order normed past values) continues a sequence exactly where it stopped.
Counter: counters["engram.rows_read"] += B*T*n_tables per call.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from . import kda as _kda
from .config import ModelConfig
from .regions import silu_conv

# Short causal conv on the gated value (as the Engram demo). There is no config field for it; a
# ModelConfig.engram_conv_size, if one is ever added, is picked up here (0 turns the conv off).
ENGRAM_CONV_SIZE = 4


def _row_ids_kernel():
    """`engram_triton.row_ids_triton`, or None where triton is not installed."""
    m = _kda._optional("dormouse.model.engram_triton")
    return None if m is None else m.row_ids_triton


def engram_conv_size(cfg: ModelConfig) -> int:
    return int(getattr(cfg, "engram_conv_size", ENGRAM_CONV_SIZE))


@dataclass(frozen=True)
class TableSpec:
    order: int
    head: int  # 0 for the exact tables
    rows: int  # parameter rows, the reserved row included
    modulus: int  # hashed: the prime p; exact: 0

    @property
    def hashed(self) -> bool:
        return self.modulus > 0


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _largest_primes(limit: int, count: int) -> list[int]:
    """The `count` largest primes <= limit, descending."""
    out, c = [], limit
    while len(out) < count and c >= 2:
        if _is_prime(c):
            out.append(c)
        c -= 1
    if len(out) < count:
        raise ValueError(f"engram_rows={limit + 1} is too small for {count} distinct hash moduli")
    return out


def engram_tables(cfg: ModelConfig) -> list[TableSpec]:
    """The tables of one Engram layer, in lookup/concatenation order."""
    orders = tuple(cfg.engram_orders)
    if not orders or len(set(orders)) != len(orders) or min(orders) < 1:
        raise ValueError(f"engram_orders must be distinct positive ints, got {orders}")
    if cfg.engram_heads < 1:
        raise ValueError("engram_heads must be >= 1")
    v = cfg.vocab_size
    n_hashed = sum(cfg.engram_heads for n in orders if n >= 3)
    primes = iter(_largest_primes(cfg.engram_rows - 1, n_hashed)) if n_hashed else iter(())
    specs = []
    for n in sorted(orders):
        if n == 1:
            specs.append(TableSpec(1, 0, v, 0))
        elif n == 2:
            specs.append(TableSpec(2, 0, v * v + 1, 0))
        else:
            specs.extend(TableSpec(n, h, cfg.engram_rows, next(primes)) for h in range(cfg.engram_heads))
    return specs


class EngramState(NamedTuple):
    """What a later call needs to continue a sequence (batch first; sizes fixed by the config, not by T)."""

    bytes: torch.Tensor  # the last max_order - 1 bytes, oldest first (0 where the sequence has none)  [B, max_order-1]
    n_seen: torch.Tensor  # bytes of the sequence consumed so far (picks the reserved rows)       long [B]
    conv: torch.Tensor | None  # normed gated values of the last (conv_size-1)*max_order steps   fp32 [B, ., D]


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, position: int):
        super().__init__()
        self.position = position
        self.specs = engram_tables(cfg)
        self.max_order = max(s.order for s in self.specs)
        self.d_model, self.vocab = cfg.d_model, cfg.vocab_size
        d, mem = cfg.d_model, len(self.specs) * cfg.engram_dim
        offsets = np.cumsum([0] + [s.rows for s in self.specs[:-1]])
        mult = np.zeros((len(self.specs), self.max_order), dtype=np.int64)
        for i, s in enumerate(self.specs):
            if s.hashed:
                rng = np.random.default_rng([position, s.order, s.head])
                mult[i, : s.order] = rng.integers(0, 2**30, size=s.order, dtype=np.int64) * 2 + 1
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long))
        self.register_buffer("hash_multipliers", torch.from_numpy(mult))
        self.register_buffer("hash_moduli", torch.tensor([s.modulus for s in self.specs], dtype=torch.long))
        # the specs as tensors for `engram_triton` (derived from the config: not in checkpoints)
        self.register_buffer("table_orders", torch.tensor([s.order for s in self.specs], dtype=torch.long),
                             persistent=False)
        self.register_buffer("table_rows", torch.tensor([s.rows for s in self.specs], dtype=torch.long),
                             persistent=False)
        self.table = nn.Embedding(sum(s.rows for s in self.specs), cfg.engram_dim)
        self.key_proj = nn.Linear(mem, d, bias=False)
        self.value_proj = nn.Linear(mem, d, bias=False)
        self.key_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.query_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.conv_size = engram_conv_size(cfg)
        if self.conv_size > 0:
            self.conv_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
            self.conv = nn.Conv1d(d, d, self.conv_size, groups=d, bias=False, dilation=self.max_order)

    @property
    def n_tables(self) -> int:
        return len(self.specs)

    def local_ids(self, idx: torch.Tensor, history: torch.Tensor | None = None,
                  start: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, T] bytes -> [B, T, n_tables] row index inside each table (reserved row included).

        Continuing a sequence: history [B, max_order - 1] the bytes just before idx (any value where the
        sequence has none), start [B] how many bytes of the sequence precede idx; None = sequence start."""
        B, t_len = idx.shape
        idx = idx.long()
        if history is None:
            history = idx.new_zeros(B, self.max_order - 1)
        full = torch.cat([history.long(), idx], 1)  # [B, max_order - 1 + T]
        m1 = self.max_order - 1
        shifted = [full[:, m1 - k : m1 - k + t_len] for k in range(self.max_order)]  # x[t-k]
        pos = torch.arange(t_len, device=idx.device)  # absolute position in the sequence   [T] or [B, T]
        if start is not None:
            pos = start.long()[:, None] + pos
        cols = []
        for i, s in enumerate(self.specs):
            if s.order == 1:
                cols.append(idx)
                continue
            if s.hashed:
                mix = shifted[0] * self.hash_multipliers[i, 0]
                for k in range(1, s.order):
                    mix = torch.bitwise_xor(mix, shifted[k] * self.hash_multipliers[i, k])
                ids = torch.remainder(mix, self.hash_moduli[i])
            else:  # exact bigram: prev * V + cur
                ids = shifted[1] * self.vocab + shifted[0]
            cols.append(torch.where(pos >= s.order - 1, ids, s.rows - 1))
        return torch.stack(cols, dim=-1)

    def row_ids(self, idx: torch.Tensor, history: torch.Tensor | None = None,
                start: torch.Tensor | None = None) -> torch.Tensor:
        """Global rows of `self.table.weight` read at each position: [B, T, n_tables] (args as local_ids)."""
        return self.local_ids(idx, history, start) + self.offsets

    def forward(self, x: torch.Tensor, idx: torch.Tensor, counters: Counter | None = None,
                state: EngramState | None = None) -> tuple[torch.Tensor, EngramState]:
        """x [B, T, D], idx [B, T] -> (branch output [B, T, D], the state after idx). state None = sequence start."""
        if counters is not None:
            counters["engram.rows_read"] += idx.numel() * self.n_tables  # one row per table per position
        return self.compute(x, idx, state, self.rows(idx, state, counters))

    def rows(self, idx: torch.Tensor, state: EngramState | None, counters: Counter | None = None) -> torch.Tensor:
        """`row_ids` of idx continuing `state`: on CUDA one Triton kernel (`engram_triton`, the same ids; ~22 small
        kernels a layer otherwise), else the torch form. Outside the compiled region: integers, no gradient.
        Counts `engram.hash_path.triton` / `engram.hash_path.torch` once per call."""
        hist, start = (None, None) if state is None else (state.bytes, state.n_seen)
        kernel = _row_ids_kernel() if _kda.on_gpu(idx) else None
        if counters is not None:
            counters["engram.hash_path.triton" if kernel is not None else "engram.hash_path.torch"] += 1
        if kernel is None:
            return self.row_ids(idx, hist, start)
        return kernel(idx.long(), hist, start, self.hash_multipliers, self.hash_moduli, self.table_orders,
                      self.table_rows, self.offsets, self.vocab)

    def regions(self) -> tuple[str, ...]:
        return ("compute",)

    def compute(self, x: torch.Tensor, idx: torch.Tensor, state: EngramState | None,
                rows: torch.Tensor) -> tuple[torch.Tensor, EngramState]:
        """`forward` past the row ids (a torch.compile region, see dormouse.model.regions): rows [B, T, n_tables]
        are the global table rows to read (`rows`)."""
        B, T = idx.shape
        n_hist, n_conv = self.max_order - 1, (self.conv_size - 1) * self.max_order
        if state is None:
            state = EngramState(idx.new_zeros(B, n_hist, dtype=torch.long), idx.new_zeros(B, dtype=torch.long),
                                x.new_zeros(B, n_conv, self.d_model, dtype=torch.float32) if self.conv_size else None)
        e = self.table(rows).flatten(-2)
        # gate in fp32 (the norms also get fp32 inputs under autocast: torch's fused rms_norm wants them)
        key = self.key_norm(self.key_proj(e).float())
        query = self.query_norm(x.float())
        g = (query * key).sum(dim=-1, keepdim=True) / math.sqrt(self.d_model)
        g = torch.sigmoid(g.abs().clamp_min(1e-6).sqrt() * g.sign())
        v = g.to(x.dtype) * self.value_proj(e)
        conv_hist = None
        if self.conv_size > 0:
            c = torch.cat([state.conv, self.conv_norm(v.float())], 1)  # normed values, history first [B, n_conv+T, D]
            conv_hist = c[:, c.shape[1] - n_conv :]
            v = v + silu_conv(c, self.conv.weight, self.max_order).to(v.dtype)
        seen = torch.cat([state.bytes, idx.long()], 1)
        return v, EngramState(seen[:, seen.shape[1] - n_hist :], state.n_seen + T, conv_hist)

    def output_projections(self) -> list[torch.Tensor]:
        return [self.value_proj.weight]
