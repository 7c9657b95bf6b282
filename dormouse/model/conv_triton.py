"""The KDA layer's short conv from the sequence start (causal depthwise conv, width W, then SiLU) in Triton,
forward and backward: the training shape, x [B, T, C] with no cache.

Written by hand because FLA's `causal_conv1d` backward runs its forward again, re-derives SiLU' at every tap
and reduces the weight gradient over rows per 64-row tile and tap: 213 + 47 us a call at medium, about 5 x its
memory traffic, 7 ms of a 108.6 ms step (benchmarks/records/2026-12-04-throughput-h200-run6). Here backward is two passes over
memory: `_bwd_g` forms g = dy * SiLU'(pre) once per element, with the weight gradient's products accumulated in
registers over up to 512 rows, and `_bwd_dx` sums W shifted taps of g. At medium: forward 54 us, backward
97 + 43 us, against FLA's 47 and 47 + 213 us; the layer 6.66 against 7.06 ms with FLA's conv ("Run 7").

g is stored in dy's dtype, as torch's own autograd of `F.silu` on a bf16 tensor stores it; the weight gradient
uses g before that rounding. Sums are fp32. Inputs may be column views (row stride > C, unit last stride): the
KDA layer hands q, k and v over as slices of one projection product. Checked against the torch path
(`regions.silu_conv`) on CPU under TRITON_INTERPRET=1 (tests/test_conv_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_W = 4  # `_bwd_g` keeps one accumulator per tap; `kda.short_conv` sends wider convs elsewhere
# BT rows x BD channels a tile; the product bounded so that W tap tiles (and `_bwd_g`'s W accumulators) stay in registers
_CONFIGS = [triton.Config({"BT": bt, "BD": bd}, num_warps=nw)
            for bt in (32, 64, 128) for bd in (32, 64, 128) for nw in (4, 8) if bt * bd <= 8192]
_CONFIGS_G = [triton.Config({"BT": bt, "BD": bd}, num_warps=nw)
              for bt in (16, 32, 64) for bd in (32, 64, 128) for nw in (4, 8) if bt * bd <= 4096]


@triton.autotune(configs=_CONFIGS, key=["D", "W"], cache_results=True)
@triton.jit
def _fwd(x, w, y, T, D, sx_b, sx_t, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    x_b = x + i_b.to(tl.int64) * sx_b
    pre = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):  # tap i multiplies x[t - (W - 1) + i]
        src = o_t - (W - 1) + i
        m = ((src >= 0) & (src < T))[:, None] & m_d[None, :]
        xi = tl.load(x_b + src[:, None].to(tl.int64) * sx_t + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        wi = tl.load(w + o_d * W + i, mask=m_d, other=0.0).to(tl.float32)
        pre += xi * wi[None, :]
    out = pre * tl.sigmoid(pre)
    p_y = y + (i_b.to(tl.int64) * T + o_t[:, None]) * D + o_d[None, :]
    tl.store(p_y, out.to(y.dtype.element_ty), mask=(o_t < T)[:, None] & m_d[None, :])


@triton.jit
def _tap(x_b, o_t, o_d, m_d, T, sx_t, i: tl.constexpr, W: tl.constexpr):
    """x[t - (W - 1) + i] for the rows o_t, fp32; zeros past the sequence's ends and for taps i >= W."""
    src = o_t - (W - 1) + i
    m = ((src >= 0) & (src < T) & (i < W))[:, None] & m_d[None, :]
    return tl.load(x_b + src[:, None].to(tl.int64) * sx_t + o_d[None, :], mask=m, other=0.0).to(tl.float32)


# (Kernel bodies are part of Triton's autotune cache key: benchmarks/triton_autotune_h200.tgz holds their H200 results.)
@triton.autotune(configs=_CONFIGS_G, key=["D", "W", "ROWS"], cache_results=True)
@triton.jit
def _bwd_g(x, w, dy, g, dw_part, T, D, NC, sx_b, sx_t, W: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr,
           BD: tl.constexpr):
    # One program: ROWS rows, BT at a time. The weight gradient's products accumulate elementwise and are
    # summed over rows once at the end: a cross-warp row reduction per tile and tap cost 3 x the memory time
    # (178 us a call at medium against 119 us with 8 tiles of 64 rows, benchmarks/records/2026-12-04-throughput-h200-run7). Four tap accumulators: W <= 4, as `silu_conv_triton` checks.
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    x_b = x + i_b.to(tl.int64) * sx_b
    w0 = tl.load(w + o_d * W + 0, mask=m_d, other=0.0).to(tl.float32)
    w1 = tl.load(w + o_d * W + 1, mask=m_d & (1 < W), other=0.0).to(tl.float32)
    w2 = tl.load(w + o_d * W + 2, mask=m_d & (2 < W), other=0.0).to(tl.float32)
    w3 = tl.load(w + o_d * W + 3, mask=m_d & (3 < W), other=0.0).to(tl.float32)
    a0 = tl.zeros([BT, BD], dtype=tl.float32)
    a1 = tl.zeros([BT, BD], dtype=tl.float32)
    a2 = tl.zeros([BT, BD], dtype=tl.float32)
    a3 = tl.zeros([BT, BD], dtype=tl.float32)
    for s in range(ROWS // BT):
        o_t = i_c * ROWS + s * BT + tl.arange(0, BT)
        x0 = _tap(x_b, o_t, o_d, m_d, T, sx_t, 0, W)
        x1 = _tap(x_b, o_t, o_d, m_d, T, sx_t, 1, W)
        x2 = _tap(x_b, o_t, o_d, m_d, T, sx_t, 2, W)
        x3 = _tap(x_b, o_t, o_d, m_d, T, sx_t, 3, W)
        pre = x0 * w0[None, :] + x1 * w1[None, :] + x2 * w2[None, :] + x3 * w3[None, :]
        m_row = (o_t < T)[:, None] & m_d[None, :]
        off = (i_b.to(tl.int64) * T + o_t[:, None]) * D + o_d[None, :]
        sg = tl.sigmoid(pre)
        gv = tl.load(dy + off, mask=m_row, other=0.0).to(tl.float32) * sg * (1.0 + pre * (1.0 - sg))
        tl.store(g + off, gv.to(g.dtype.element_ty), mask=m_row)
        a0 += gv * x0
        a1 += gv * x1
        a2 += gv * x2
        a3 += gv * x3
    part = dw_part + (i_b.to(tl.int64) * NC + i_c) * D * W + o_d * W
    tl.store(part + 0, tl.sum(a0, axis=0), mask=m_d)
    tl.store(part + 1, tl.sum(a1, axis=0), mask=m_d & (1 < W))
    tl.store(part + 2, tl.sum(a2, axis=0), mask=m_d & (2 < W))
    tl.store(part + 3, tl.sum(a3, axis=0), mask=m_d & (3 < W))


@triton.autotune(configs=_CONFIGS, key=["D", "W"], cache_results=True)
@triton.jit
def _bwd_dx(w, g, dx, T, D, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    g_b = g + i_b.to(tl.int64) * T * D
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):  # x[t] fed tap i of output t + (W - 1) - i
        dst = o_t + (W - 1) - i
        m = (dst < T)[:, None] & m_d[None, :]
        gi = tl.load(g_b + dst[:, None].to(tl.int64) * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        wi = tl.load(w + o_d * W + i, mask=m_d, other=0.0).to(tl.float32)
        acc += gi * wi[None, :]
    p = dx + (i_b.to(tl.int64) * T + o_t[:, None]) * D + o_d[None, :]
    tl.store(p, acc.to(dx.dtype.element_ty), mask=(o_t < T)[:, None] & m_d[None, :])


def _grid(D: int, T: int, B: int, rows: int | None = None):
    return lambda meta: (triton.cdiv(D, meta["BD"]), triton.cdiv(T, rows or meta["BT"]), B)


def _rows_per_program(B: int, T: int) -> int:
    """`_bwd_g`'s rows per program (the weight gradient's partials are per batch row and ROWS rows): up to 512
    (medium's 2048 in 4 programs) while at least 64 programs stand along batch x time (times the D blocks:
    enough to fill the GPU) and no more than T needs; at least the largest tile (the kernel loops ROWS // BT)."""
    least = max(c.kwargs["BT"] for c in _CONFIGS_G)
    rows = 512
    while rows > least and (B * triton.cdiv(T, rows) < 64 or rows // 2 >= T):
        rows //= 2
    return rows


class SiluConvFunction(torch.autograd.Function):
    """y = SiLU(causal depthwise conv(x, weight)) from the sequence start; x [B, T, C] (unit last stride),
    weight [C, W] -> y [B, T, C] contiguous, x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        W = weight.shape[1]
        if x.stride(-1) != 1:
            x = x.contiguous()
        weight = weight.contiguous()
        y = torch.empty((B, T, D), dtype=x.dtype, device=x.device)
        _fwd[_grid(D, T, B)](x, weight, y, T, D, x.stride(0), x.stride(1), W=W)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        B, T, D = x.shape
        W = weight.shape[1]
        dy = dy.contiguous()
        rows = _rows_per_program(B, T)
        NC = triton.cdiv(T, rows)
        g = torch.empty_like(dy)
        dw_part = torch.empty((B * NC, D, W), dtype=torch.float32, device=x.device)
        _bwd_g[_grid(D, T, B, rows)](x, weight, dy, g, dw_part, T, D, NC, x.stride(0), x.stride(1), W=W, ROWS=rows)
        dx = torch.empty((B, T, D), dtype=x.dtype, device=x.device)
        _bwd_dx[_grid(D, T, B)](weight, g, dx, T, D, W=W)
        return dx, dw_part.sum(0).to(weight.dtype)


def silu_conv_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`regions.silu_conv` of x with no history: x [B, T, C], weight [C, 1, W <= MAX_W] -> [B, T, C] in x's dtype."""
    if weight.shape[-1] > MAX_W:
        raise ValueError(f"conv_triton: conv width {weight.shape[-1]} > {MAX_W}")
    return SiluConvFunction.apply(x, weight[:, 0])
