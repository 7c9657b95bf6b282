"""Per-row seeded sampling on the device: a byte drawn from each row's logits with randomness that is a pure
function of (the row's seed, the row's step counter, the byte index), so no host round trip, no torch.Generator
and nothing shared between rows.

    nxt = sample_rows(logits [B, V], seed [B] int64, counter [B] int64, temperature [B] | float, top_k [B] | int | None)

Hand-written because torch's generators are per tensor, not per row (a row's draws would depend on the rows
beside it), and a CPU generator (what the eager serve path uses to stay device-independent) forces a host round
trip per step, which a CUDA graph cannot hold.

- The uniforms: a counter-based hash (Wellons' lowbias32 mixer, chained over the seed's and the counter's 32-bit
  halves, then over the byte index) in int64 tensors holding 32-bit values, so every op is exact and identical
  on CPU and CUDA; multiplications go through 16-bit limbs so that no intermediate overflows int64 (signed
  overflow is undefined in C++). A uniform keeps 23 bits: (m + 0.5) / 2**23 is exact in fp32 and never 0 or 1.
- The draw: Gumbel-max, argmax(logits / temperature + Gumbel noise) over the top_k largest logits (ties at the
  k-th kept, as `decode.sample_next`), which is a draw from softmax(logits / temperature) restricted to them.
- temperature below GREEDY_BELOW: argmax of the raw logits (sample_next's temperature 0; logits / 1e-40 would
  overflow), whatever the seed.
The bytes differ from `sample_next`'s and the serve batcher's (another generator), not their distribution.
"""

from __future__ import annotations

import torch

from dormouse.model.kda import _optional

GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (the limit they tend to)

_M32 = 0xFFFFFFFF
_LANES = (0x243F6A88, 0x85A308D3)  # two independent 32-bit keys per (seed, counter): 64 bits of key per draw
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x int64 in [0, 2**32) and a constant c < 2**32, every intermediate below 2**49."""
    return ((((x * (c >> 16)) & 0xFFFF) << 16) + x * (c & 0xFFFF)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' hash prospector): a bijection of [0, 2**32) with full avalanche; x int64 in that range."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int64's low and high 32 bits (two's complement: a negative seed is a seed like any other)."""
    return x & _M32, (x >> 32) & _M32


def on_gpu(t: torch.Tensor) -> bool:
    """Whether the CUDA path runs (a seam: benchmarks/decode_launches.py drives it on the CPU, Triton interpreted)."""
    return t.is_cuda


def _triton_kernel():
    """`rowrng_triton.row_uniforms_triton`, or None where triton is not installed (CPU-only set-ups)."""
    return _optional("dormouse.posttrain.rowrng_triton", "row_uniforms_triton")


def row_uniforms(seed: torch.Tensor, counter: torch.Tensor, n: int, counters=None) -> torch.Tensor:
    """seed, counter int64 [B] -> fp32 [B, n] uniforms in (0, 1), element [i, j] a function of (seed_i, counter_i, j) only.
    On CUDA one Triton kernel (`rowrng_triton`, the same bits); otherwise the torch ops below. Counts `rng_path.triton`
    / `rng_path.torch` once per call."""
    kernel = _triton_kernel() if on_gpu(seed) else None
    if counters is not None:
        key = "rng_path.triton" if kernel is not None else "rng_path.torch"
        counters[key] = counters.get(key, 0) + 1
    if kernel is not None:
        return kernel(seed, counter, n)
    return row_uniforms_torch(seed, counter, n)


def row_uniforms_torch(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """`row_uniforms` in torch ops (the definition; exact and identical on any device)."""
    s_lo, s_hi = _halves(seed.long())
    c_lo, c_hi = _halves(counter.long())
    keys = []
    for lane in _LANES:
        k = mix32(s_lo ^ lane)
        for part in (s_hi, c_lo, c_hi):
            k = mix32(k ^ part)
        keys.append(k[:, None])
    j = _mul32(torch.arange(n, device=seed.device, dtype=torch.long), _GOLDEN)[None, :]  # spread the byte index
    h = mix32(mix32(keys[0] ^ j) ^ keys[1])  # [B, n]
    return ((h >> 9).float() + 0.5) * 2.0**-23


def _per_row(x, b: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A python scalar broadcast to [b] (a fill: no host-to-device copy, so it may sit in a CUDA graph), or the tensor."""
    return x.to(dtype) if isinstance(x, torch.Tensor) else torch.full((b,), x, dtype=dtype, device=device)


def sample_rows(logits: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor,
                temperature: torch.Tensor | float = 0.0, top_k: torch.Tensor | int | None = None,
                counters=None) -> torch.Tensor:
    """logits [B, V] -> bytes [B] (long, on logits' device); see the module docstring. temperature and top_k per row
    (tensors [B]) or for all rows; top_k None or >= V keeps every byte. No host read: python-scalar arguments are
    checked here, tensors are not (a check would read them)."""
    B, V = logits.shape
    if not isinstance(temperature, torch.Tensor) and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not isinstance(top_k, torch.Tensor) and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    t = _per_row(temperature, B, torch.float32, logits.device)
    k = _per_row(V if top_k is None else top_k, B, torch.long, logits.device).clamp(1, V)
    greedy = t < GREEDY_BELOW
    z = logits.float() / torch.where(greedy, 1.0, t)[:, None]
    kth = z.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # the k-th largest of each row
    z = z.masked_fill(z < kth, float("-inf"))
    gumbel = -torch.log(-torch.log(row_uniforms(seed, counter, V, counters)))
    return torch.where(greedy, logits.argmax(-1), (z + gumbel).argmax(-1))
