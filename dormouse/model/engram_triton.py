"""`Engram.row_ids` as one Triton kernel: every table's row for every position in one launch, the same ids.

The torch form is ~22 small int64 kernels an Engram layer (the shifted byte views, one multiply and XOR per byte
of each hashed order, the remainders, the reserved-row selects, a stack), a sixth of a graphed decode step's
launches for small (benchmarks/records/2026-12-06-decode-launches-cpu). Here a program takes a block of positions of
one row and loops over the tables: byte k back comes from the input or, before it, from the state's history; a
hashed table XORs byte k times its multiplier over every k (the multipliers past its order are 0, so those terms
vanish), then takes the remainder by its prime; the exact tables are the byte (order 1) or prev * vocab + byte
(order 2); positions with fewer bytes of history than the order read the reserved last row. int64 throughout:
bytes < 2**8 times multipliers < 2**31 stay far from overflow. Checked against the torch form under
TRITON_INTERPRET=1 (tests/test_model.py) and compiled for sm_90 on the CPU (tests/test_triton_compile.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 64  # positions a program


@triton.jit
def _row_ids(idx, s_idx, hist, s_hist, start, mult, moduli, orders, nrows, offsets, out, T, M1, VOCAB,
             HAS_HIST: tl.constexpr, HAS_START: tl.constexpr, N_TABLES: tl.constexpr, MAX_ORDER: tl.constexpr,
             BT: tl.constexpr):
    i_b = tl.program_id(1).to(tl.int64)
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    m_t = o_t < T
    pos = o_t.to(tl.int64)
    if HAS_START:
        pos += tl.load(start + i_b)
    for i in tl.static_range(N_TABLES):
        order = tl.load(orders + i)
        modulus = tl.load(moduli + i)
        mix = tl.zeros([BT], dtype=tl.int64)
        b0 = tl.zeros([BT], dtype=tl.int64)
        b1 = tl.zeros([BT], dtype=tl.int64)
        for k in tl.static_range(MAX_ORDER):
            src = o_t - k  # byte k back: the input's, or the history's before it (0 where there is none)
            byte = tl.load(idx + i_b * s_idx + src, mask=m_t & (src >= 0), other=0).to(tl.int64)
            if HAS_HIST:
                past = tl.load(hist + i_b * s_hist + (M1 + src), mask=m_t & (src < 0) & (M1 + src >= 0), other=0)
                byte = tl.where(src >= 0, byte, past.to(tl.int64))
            mix = mix ^ (byte * tl.load(mult + i * MAX_ORDER + k))
            if k == 0:
                b0 = byte
            if k == 1:
                b1 = byte
        hashed = mix % tl.where(modulus > 0, modulus, 1)
        exact = tl.where(order == 1, b0, b1 * VOCAB + b0)
        ids = tl.where(modulus > 0, hashed, exact)
        ids = tl.where(pos >= order - 1, ids, tl.load(nrows + i) - 1) + tl.load(offsets + i)
        tl.store(out + (i_b * T + o_t) * N_TABLES + i, ids, mask=m_t)


def row_ids_triton(idx: torch.Tensor, history: torch.Tensor | None, start: torch.Tensor | None, mult: torch.Tensor,
                   moduli: torch.Tensor, orders: torch.Tensor, nrows: torch.Tensor, offsets: torch.Tensor,
                   vocab: int) -> torch.Tensor:
    """idx [B, T] long, history [B, max_order - 1] long or None (zeros), start [B] long or None (0), the layer's
    table constants (contiguous int64 [n_tables, max_order] multipliers, [n_tables] moduli, orders, rows, offsets)
    -> global rows [B, T, n_tables] int64, as `Engram.row_ids`."""
    B, T = idx.shape
    n_tables, max_order = mult.shape
    for t in (idx, history, start):  # a last dim of one may have any stride (a decode step's column of bytes)
        if t is not None and (t.dtype != torch.long or (t.shape[-1] > 1 and t.stride(-1) != 1)):
            raise ValueError(f"engram_triton: int64 inputs with a unit last stride, got {t.dtype} {tuple(t.stride())}")
    out = torch.empty(B, T, n_tables, dtype=torch.long, device=idx.device)
    if B and T:
        _row_ids[(triton.cdiv(T, BT), B)](
            idx, idx.stride(0), idx if history is None else history, 0 if history is None else history.stride(0),
            idx if start is None else start, mult, moduli, orders, nrows, offsets, out, T, max_order - 1, vocab,
            HAS_HIST=history is not None, HAS_START=start is not None, N_TABLES=n_tables, MAX_ORDER=max_order, BT=BT)
    return out
