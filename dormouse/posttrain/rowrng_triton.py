"""`rowrng.row_uniforms` as one Triton kernel: the same hash, bit for bit, in one launch instead of ~200.

The torch form is ~200 elementwise kernels on [B] and [B, V] int64 tensors (mix32 alone is 18), a third of a graphed
decode step's launches for small, and a step is launch-bound (benchmarks/records/2026-12-06-serve-h100). Here each
program hashes one row's (seed, counter) into its two keys once and a block of byte indices into uniforms. The
arithmetic is rowrng's exactly: int64 holding 32-bit values, products through 16-bit limbs (no intermediate reaches
2**49), shifts arithmetic, the 23-bit mantissa trick; literals above 2**31 are uint32 in Triton and widen to int64
by value. Checked bit for bit against the torch form on the CPU under TRITON_INTERPRET=1 (tests/test_rowrng.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # byte indices a program: the byte vocabulary in one


@triton.jit
def _mul32(x, c: tl.constexpr):
    return ((((x * (c >> 16)) & 0xFFFF) << 16) + x * (c & 0xFFFF)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _key(lane: tl.constexpr, s_lo, s_hi, c_lo, c_hi):
    k = _mix32(s_lo ^ lane)
    k = _mix32(k ^ s_hi)
    k = _mix32(k ^ c_lo)
    return _mix32(k ^ c_hi)


@triton.jit
def _uniforms(seed, counter, out, n, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(seed + row).to(tl.int64)
    c = tl.load(counter + row).to(tl.int64)
    s_lo, s_hi = s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF
    c_lo, c_hi = c & 0xFFFFFFFF, (c >> 32) & 0xFFFFFFFF
    k0 = _key(0x243F6A88, s_lo, s_hi, c_lo, c_hi)  # rowrng._LANES
    k1 = _key(0x85A308D3, s_lo, s_hi, c_lo, c_hi)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _mix32(_mix32(k0 ^ _mul32(j.to(tl.int64), 0x9E3779B9)) ^ k1)  # rowrng._GOLDEN spreads the byte index
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # (m + 0.5) / 2**23
    tl.store(out + row * stride_out + j, u, mask=j < n)


def row_uniforms_triton(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """`rowrng.row_uniforms`: seed, counter int64 [B] -> fp32 [B, n], the same bits."""
    B = seed.shape[0]
    out = torch.empty(B, n, dtype=torch.float32, device=seed.device)
    if B and n:
        _uniforms[(B, triton.cdiv(n, BLOCK))](seed.long().contiguous(), counter.long().contiguous(), out, n,
                                              out.stride(0), BLOCK=BLOCK)
    return out
