"""The KDA layer's three short convs for one decode step (T == 1, continuing their caches) in one Triton launch.

A decode step is launch-bound (benchmarks/records/2026-12-06-serve-h100); per layer the q, k and v convs were three
launches each there (FLA's `causal_conv1d` behind a padded, transposed copy of the cache, then a cat for the new
cache). Here one program computes a block of channels of one row of one of q, k, v: SiLU(the W - 1 cached inputs
and the new one against the taps) in fp32, stored in x's dtype, and the new cache (the last W - 1 inputs, the new
one last) beside it. Checked against the torch path on the CPU under TRITON_INTERPRET=1 (tests/test_kda.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_W = 4
BD = 128  # channels a program


@triton.jit
def _one(x, sx, c, sc_b, sc_t, w, y, n, i_b, C, W: tl.constexpr, BD: tl.constexpr):
    o_d = tl.program_id(0) * BD + tl.arange(0, BD)
    m = o_d < C
    b = i_b.to(tl.int64)
    xv = tl.load(x + b * sx + o_d, mask=m, other=0.0)
    acc = xv.to(tl.float32) * tl.load(w + o_d * W + (W - 1), mask=m, other=0.0).to(tl.float32)
    n_b = n + b * (W - 1) * C
    for i in tl.static_range(W - 1):  # cached input i (the oldest first) meets tap i
        ci = tl.load(c + b * sc_b + i * sc_t + o_d, mask=m, other=0.0)
        acc += ci.to(tl.float32) * tl.load(w + o_d * W + i, mask=m, other=0.0).to(tl.float32)
        if i > 0:
            tl.store(n_b + (i - 1) * C + o_d, ci, mask=m)  # the caches' dtype is x's: moved, not rounded
    tl.store(n_b + (W - 2) * C + o_d, xv, mask=m)
    tl.store(y + b * C + o_d, (acc * tl.sigmoid(acc)).to(y.dtype.element_ty), mask=m)


@triton.jit
def _step3(xq, xk, xv, sxq, sxk, sxv, cq, ck, cv, scq_b, scq_t, sck_b, sck_t, scv_b, scv_t, wq, wk, wv,
           yq, yk, yv, nq, nk, nv, C, W: tl.constexpr, BD: tl.constexpr):
    which, i_b = tl.program_id(1), tl.program_id(2)
    if which == 0:
        _one(xq, sxq, cq, scq_b, scq_t, wq, yq, nq, i_b, C, W, BD)
    elif which == 1:
        _one(xk, sxk, ck, sck_b, sck_t, wk, yk, nk, i_b, C, W, BD)
    else:
        _one(xv, sxv, cv, scv_b, scv_t, wv, yv, nv, i_b, C, W, BD)


def silu_conv_step3(xs: tuple, weights: tuple, caches: tuple) -> tuple[tuple, tuple]:
    """`kda.short_conv` of q, k and v for one token continuing their caches: xs three [B, 1, C] (unit last stride;
    column views of one product are fine), weights three [C, 1, W] (2 <= W <= MAX_W), caches three [B, W - 1, C]
    (unit last stride, x's dtype). Returns ((y_q, y_k, y_v) [B, 1, C] in x's dtype, (new caches) [B, W - 1, C] in x's dtype)."""
    B, T, C = xs[0].shape
    W = weights[0].shape[-1]
    if T != 1 or not 2 <= W <= MAX_W:
        raise ValueError(f"conv_step_triton: one token and 2 <= W <= {MAX_W}, got T={T}, W={W}")
    for t in (*xs, *caches):
        if t.stride(-1) != 1 or t.dtype != xs[0].dtype:  # the caches move over as they are: no rounding
            raise ValueError(f"conv_step_triton: inputs need a unit last stride and one dtype, got "
                             f"{tuple(t.stride())} {t.dtype} beside {xs[0].dtype}")
    ws = [w.contiguous() for w in weights]
    ys = [torch.empty(B, 1, C, dtype=x.dtype, device=x.device) for x in xs]
    ns = [torch.empty(B, W - 1, C, dtype=x.dtype, device=x.device) for x in xs]
    if B:
        _step3[(triton.cdiv(C, BD), 3, B)](
            *xs, *(x.stride(0) for x in xs), *caches, *(s for c in caches for s in (c.stride(0), c.stride(1))),
            *ws, *ys, *ns, C, W=W, BD=BD)
    return tuple(ys), tuple(ns)
