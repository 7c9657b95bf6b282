"""The per-row seeded sampler (dormouse/posttrain/rowrng.py): its hash against a plain-int reference, a row's draws
independent of the rows beside it, greedy at temperature 0, top-k, and the distribution it draws from."""

from __future__ import annotations

import math

import pytest
import torch

from interpret_util import run_interpreted
from dormouse.posttrain.rowrng import mix32, row_uniforms, row_uniforms_torch, sample_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def lowbias32(x: int) -> int:  # the published mixer on python ints
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_the_hash_is_lowbias32_exactly_and_the_uniforms_lie_inside_zero_one():
    xs = [0, 1, 2, 255, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF] + list(range(1000, 1100))
    assert mix32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 12345])  # the whole int64 range is a seed
    u = row_uniforms(seeds, torch.tensor([0, 0, 5, 9, 2**40, 3]), 256)
    assert u.dtype == torch.float32 and u.shape == (6, 256) and (u > 0).all() and (u < 1).all()
    assert len({tuple(r) for r in u.tolist()}) == 6  # distinct keys, distinct draws
    big = row_uniforms(torch.zeros(4096, dtype=torch.long), torch.arange(4096), 256).flatten()
    assert abs(float(big.mean()) - 0.5) < 2e-3 and abs(float(big.var()) - 1 / 12) < 1e-3
    # neighbouring seeds and counters are not correlated (a weak mixer would show it here)
    a = row_uniforms(torch.arange(4096), torch.zeros(4096, dtype=torch.long), 1)[:, 0]
    b = row_uniforms(torch.arange(1, 4097), torch.zeros(4096, dtype=torch.long), 1)[:, 0]
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.05


def test_a_rows_bytes_do_not_depend_on_the_rows_beside_it_or_their_order():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 256, generator=g) * 3
    seed = torch.tensor([7, 7, 123, -4, 2**62, 9])
    temp = torch.tensor([1.0, 0.7, 1.3, 0.0, 2.0, 1.0])
    top_k = torch.tensor([256, 40, 5, 256, 1, 100])
    for step in range(20):
        counter = torch.full((6,), step)
        full = sample_rows(logits, seed, counter, temp, top_k)
        for i in range(6):  # each row alone
            alone = sample_rows(logits[i:i + 1], seed[i:i + 1], counter[i:i + 1], temp[i:i + 1], top_k[i:i + 1])
            assert alone.item() == full[i].item()
        perm = torch.randperm(6, generator=g)
        others = torch.randn(3, 256, generator=g)  # and among strangers, shuffled
        mixed = sample_rows(torch.cat([logits[perm], others]), torch.cat([seed[perm], torch.tensor([1, 2, 3])]),
                            torch.cat([counter, torch.tensor([0, 5, step])]),
                            torch.cat([temp[perm], torch.ones(3)]), torch.cat([top_k[perm], torch.full((3,), 256)]))
        assert torch.equal(mixed[:6], full[perm])
    # the draw moves with the seed and with the counter
    many = torch.zeros(64, dtype=torch.long)
    row = torch.zeros(64, 256)  # flat: 64 draws give ~56 distinct bytes
    assert len(set(sample_rows(row, torch.arange(64), many, 1.0).tolist())) > 40
    assert len(set(sample_rows(row, many, torch.arange(64), 1.0).tolist())) > 40


def test_temperature_zero_is_argmax_and_top_k_masks():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 256, generator=g)
    seeds, counters = torch.arange(32), torch.arange(32) * 3
    assert torch.equal(sample_rows(logits, seeds, counters, 0.0), logits.argmax(-1))
    assert torch.equal(sample_rows(logits, seeds, counters, 1e-7, 5), logits.argmax(-1))  # under GREEDY_BELOW
    assert torch.equal(sample_rows(logits, seeds, counters, 1.5, 1), logits.argmax(-1))
    top5 = logits.topk(5, -1).indices
    for step in range(30):
        d = sample_rows(logits, seeds, counters + step, torch.full((32,), 5.0), 5)  # hot: would stray without the mask
        assert (top5 == d[:, None]).any(-1).all()
    # per-row temperature: greedy rows beside sampled ones
    t = torch.where(torch.arange(32) % 2 == 0, 0.0, 3.0)
    d = sample_rows(logits, seeds, counters, t)
    assert torch.equal(d[::2], logits[::2].argmax(-1)) and not torch.equal(d[1::2], logits[1::2].argmax(-1))
    with pytest.raises(ValueError):
        sample_rows(logits, seeds, counters, -1.0)
    with pytest.raises(ValueError):
        sample_rows(logits, seeds, counters, 1.0, 0)


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal quantile z (3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.6, None), (1.7, 6)])
def test_draws_follow_softmax_of_logits_over_temperature(temperature, top_k):
    """Pearson's chi-square over 40 000 draws (fixed seeds, so the test is deterministic) against softmax(logits / T)
    restricted to the top k, bytes of expected count under 5 pooled; a wrong temperature or mask fails it by far."""
    n = 40_000
    logits = torch.full((256,), -30.0)
    logits[[3, 10, 65, 66, 97, 200, 201, 255]] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 1.2])
    draws = sample_rows(logits.expand(n, -1), torch.full((n,), 42), torch.arange(n), temperature, top_k)
    z = logits / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k).values[-1], float("-inf"))
    expect = z.softmax(-1).double() * n
    seen = torch.bincount(draws, minlength=256).double()
    big = expect >= 5
    obs = torch.cat([seen[big], seen[~big].sum()[None]])
    exp = torch.cat([expect[big], expect[~big].sum()[None]])
    keep = exp > 0
    assert seen[~big].sum() <= max(5.0, 3 * float(exp[-1]))  # masked or negligible bytes are (nearly) never drawn
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert stat < chi_square_critical(dof), (stat, dof)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_uniforms_are_the_same_bits_on_cuda():
    """Integer ops and an exact int-to-float conversion: a seed draws the same uniforms on either device, and the
    draws are the CPU's (the Gumbel noise may differ in an ulp of its log, which flips only exact near-ties)."""
    seed, counter = torch.arange(-50, 50) * 7919, torch.arange(100) * 31
    u_cpu = row_uniforms(seed, counter, 256)
    c = {}
    assert torch.equal(row_uniforms(seed.cuda(), counter.cuda(), 256, c).cpu(), u_cpu)  # the Triton kernel
    assert c == {"rng_path.triton": 1}
    assert torch.equal(row_uniforms_torch(seed.cuda(), counter.cuda(), 256).cpu(), u_cpu)  # and the torch ops
    logits = torch.randn(100, 256, generator=torch.Generator().manual_seed(3)) * 2
    on_gpu = sample_rows(logits.cuda(), seed.cuda(), counter.cuda(), 1.0, 50).cpu()
    assert (on_gpu == sample_rows(logits, seed, counter, 1.0, 50)).float().mean() >= 0.99


_INTERPRETED = r"""
import json, torch
from benchmarks import triton_interpret
triton_interpret.apply()
from dormouse.posttrain.rowrng import row_uniforms
from dormouse.posttrain.rowrng_triton import row_uniforms_triton

seed = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 12345, 0x7FFFFFFF, 0x80000000, -0x80000001])
counter = torch.tensor([0, 0, 5, 9, 2**40, 3, 2**32 - 1, 2**32, 2**62 + 7])
out = {}
for n in (256, 300, 1):  # one block, a partial second block, one column
    want, got = row_uniforms(seed, counter, n), row_uniforms_triton(seed, counter, n)
    out[n] = {"equal": torch.equal(want, got), "differ": int((want != got).sum()), "shape": list(got.shape)}
print(json.dumps(out))
"""


def test_the_triton_kernel_draws_the_torch_forms_bits_under_triton_interpreter():
    """The CUDA path's one-kernel hash (`rowrng_triton`) gives the torch form's uniforms bit for bit, over seeds and
    counters that reach every 32-bit half's edge (negative seeds, 2**63 - 1, counters past 2**32)."""
    pytest.importorskip("triton", reason="the kernel is Triton")
    res = run_interpreted(_INTERPRETED)
    assert res == {str(n): {"equal": True, "differ": 0, "shape": [9, n]} for n in (256, 300, 1)}, res
