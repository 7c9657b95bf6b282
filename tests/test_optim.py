"""StackedMuon (batched Newton–Schulz) against torch.optim.Muon: the same state, the same steps up to
bf16 rounding."""

import copy

import pytest
import torch

from dormouse.train import optim
from dormouse.train.optim import StackedMuon


def params():
    torch.manual_seed(0)
    shapes = [(32, 32)] * 3 + [(64, 32), (64, 32), (32, 64), (32, 96), (48, 16)]  # stacks, tall and wide: 64x32 joins 32x64
    return [torch.nn.Parameter(torch.randn(s) * 0.05) for s in shapes]


@pytest.mark.parametrize("nesterov,wd,adjust", [(True, 0.0, "match_rms_adamw"), (False, 0.1, "match_rms_adamw"),
                                                 (True, 0.1, None), (True, 0.0, "original")])
def test_stacked_muon_takes_torchs_steps(nesterov, wd, adjust):
    """Every lr adjustment (two of them depend on a matrix's orientation, and a tall matrix shares its
    transpose's stack), with steps where a matrix has no gradient: the stacks change, and steps 1 and 2 put
    different shapes (64x32 + 32x64, then 64x32 twice) at the same stack positions."""
    ref_p, new_p = params(), params()
    kw = dict(lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=wd, adjust_lr_fn=adjust)
    ref, new = torch.optim.Muon(ref_p, **kw), StackedMuon(new_p, **kw)
    start = [p.detach().clone() for p in ref_p]
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        for i, (a, b) in enumerate(zip(ref_p, new_p)):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = (None, None) if (step, i) in ((1, 3), (2, 5)) else (g.clone(), g.clone())
        ref.step()
        new.step()
    for a, b, s in zip(ref_p, new_p, start):
        moved = (a - s).abs().max()
        assert moved > 0.01  # the steps did something
        assert (a - b).abs().max() <= 0.02 * moved, (a.shape, float((a - b).abs().max()), float(moved))
    for a, b in zip(ref_p, new_p):  # the momentum is fp32 arithmetic on the same grads: equal
        assert torch.equal(ref.state[a]["momentum_buffer"], new.state[b]["momentum_buffer"])
    new2 = StackedMuon(copy.deepcopy(new_p), **kw)
    new2.load_state_dict(ref.state_dict())  # torch's state loads as is
    for a, b in zip(ref_p, new2.param_groups[0]["params"]):
        assert torch.equal(ref.state[a]["momentum_buffer"], new2.state[b]["momentum_buffer"])


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_a_bank_steps_as_its_matrices_would_alone(monkeypatch, backend):
    """A 3-D bank (an MoE's experts) takes, matrix by matrix, the very steps E separate 2-D parameters take:
    each orthogonalised, normalised and lr-adjusted on its own (a tall bank in a stack of its own, iterated in its
    own layout: at these shapes to the same bits as its matrices transposed into the wide stack); the wide bank
    shares its stack with a 2-D matrix of its shape."""
    monkeypatch.setattr(optim, "ELEMENTWISE_BACKEND", backend)
    torch.manual_seed(0)
    banks = [torch.randn(3, 48, 32) * 0.05, torch.randn(4, 32, 48) * 0.05]  # tall and wide
    lone = torch.randn(32, 48) * 0.05
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    as_banks = [torch.nn.Parameter(b.clone()) for b in banks] + [torch.nn.Parameter(lone.clone())]
    as_mats = [torch.nn.Parameter(m.clone()) for b in banks for m in b] + [torch.nn.Parameter(lone.clone())]
    opt_b, opt_m = StackedMuon(as_banks, **kw), StackedMuon(as_mats, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in as_banks:
            p.grad = torch.randn(p.shape, generator=gen)
        grads = [m for p in as_banks[:2] for m in p.grad] + [as_banks[2].grad]
        for p, g in zip(as_mats, grads):
            p.grad = g.clone()
        opt_b.step()
        opt_m.step()
    got = [m for p in as_banks[:2] for m in p.detach()] + [as_banks[2].detach()]
    for a, b, start in zip(got, as_mats, [m for bank in banks for m in bank] + [lone]):
        assert (b.detach() - start).abs().max() > 0.01  # the steps moved the weights
        torch.testing.assert_close(a, b.detach(), atol=0, rtol=0)
    assert torch.equal(opt_b.state[as_banks[0]]["momentum_buffer"][1], opt_m.state[as_mats[1]]["momentum_buffer"])


def test_a_tall_bank_at_a_real_shape_steps_as_its_matrices_to_bf16_rounding():
    """At b1-like shapes the tall iteration (X <- aX + X(bG + cG^2)) and the transposed wide one round apart by a
    bf16 ulp in places: the weights after a few steps agree to that, not bit for bit."""
    torch.manual_seed(0)
    bank = torch.randn(2, 256, 64) * 0.05
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    as_bank, as_mats = torch.nn.Parameter(bank.clone()), [torch.nn.Parameter(m.clone()) for m in bank]
    opt_b, opt_m = StackedMuon([as_bank], **kw), StackedMuon(as_mats, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        as_bank.grad = torch.randn(as_bank.shape, generator=gen)
        for p, g in zip(as_mats, as_bank.grad):
            p.grad = g.clone()
        opt_b.step()
        opt_m.step()
    moved = (as_bank.detach() - bank).abs().max()
    for a, b in zip(as_bank.detach(), as_mats):
        torch.testing.assert_close(a, b.detach(), atol=2**-6 * moved.item(), rtol=0)  # a wrong iteration is off by ~moved


@pytest.mark.parametrize("tall", [False, True])
def test_newton_schulz_with_a_folded_into_the_polynomial_is_the_same_iteration(monkeypatch, tall):
    """optim.NS_FOLD_A (X <- (bG + cG^2 + aI) X, one bmm instead of a baddbmm): in fp32 the iteration's result to
    float rounding, wide and tall; in bf16 within its rounding of the unfolded one (it is off until a GPU shows it
    faster: benchmarks/muon_bench.py)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 48, 32, generator=gen) if tall else torch.randn(3, 32, 48, generator=gen)
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    coefficients = (3.4445, -4.7750, 2.0315)
    ref = {dt: optim._newton_schulz_iterations(x.to(dt), coefficients, 5, tall) for dt in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(optim, "NS_FOLD_A", True)
    fold = {dt: optim._newton_schulz_iterations(x.to(dt), coefficients, 5, tall) for dt in (torch.float32, torch.bfloat16)}
    assert torch.allclose(fold[torch.float32], ref[torch.float32], atol=1e-5, rtol=1e-5)
    assert not torch.equal(x, ref[torch.float32])  # the iteration moved it
    err = (fold[torch.bfloat16].float() - ref[torch.float32]).abs().max()
    assert err <= 2 * (ref[torch.bfloat16].float() - ref[torch.float32]).abs().max() + 1e-2


def test_stacked_muon_refuses_what_is_no_matrix():
    with pytest.raises(ValueError, match=r"2-D matrices and 3-D banks.*\(5,\)"):
        StackedMuon([torch.nn.Parameter(torch.zeros(5))], lr=0.02)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # fp32 bit patterns: torch.equal alone takes -0.0 for 0.0


def twins(kw: dict, device: str = "cpu"):
    """Two StackedMuons over equal copies of `params()`."""
    a_p, b_p = ([torch.nn.Parameter(p.detach().to(device)) for p in params()] for _ in range(2))
    return a_p, b_p, StackedMuon(a_p, **kw), StackedMuon(b_p, **kw)


def same_grads(a_p, b_p, gen: torch.Generator) -> None:
    for x, y in zip(a_p, b_p):
        x.grad = torch.randn(x.shape, generator=gen, device=x.device)
        y.grad = x.grad.clone()



def snapshot(opt, ps) -> tuple[list, list]:
    """The bits of every weight and momentum of `opt` over `ps`."""
    return [bits(y.detach()).clone() for y in ps], [bits(opt.state[y]["momentum_buffer"]).clone() for y in ps]


def assert_unchanged(opt, ps, before) -> None:
    for y, w, m in zip(ps, *before):
        assert torch.equal(bits(y.detach()), w) and torch.equal(bits(opt.state[y]["momentum_buffer"]), m)


def eager_and_compiled_step(monkeypatch, a, b, ok) -> None:
    """`a` steps with the elementwise functions eager, `b` as the device runs them."""
    with monkeypatch.context() as eager:
        eager.setattr(optim, "ELEMENTWISE_BACKEND", None)
        a.step(ok=ok)
    b.step(ok=ok)

def test_a_step_refused_on_the_device_changes_no_bit():
    """step(ok=False) with non-finite gradients (NaN in one matrix, inf in another) leaves every weight and
    momentum bit as it was, a -0.0 weight included; step(ok=True) is step() bit for bit."""
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn=None)
    a_p, b_p, a, b = twins(kw)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        same_grads(a_p, b_p, gen)
        a.step()
        b.step(ok=torch.tensor(True))
    for x, y in zip(a_p, b_p):
        assert torch.equal(bits(x.detach()), bits(y.detach()))
        assert torch.equal(bits(a.state[x]["momentum_buffer"]), bits(b.state[y]["momentum_buffer"]))
    with torch.no_grad():
        b_p[3][0] = -0.0
    before = snapshot(b, b_p)
    for i, y in enumerate(b_p):
        y.grad = torch.randn(y.shape, generator=gen)
        y.grad[0, 0] = float("nan") if i == 3 else float("inf") if i == 5 else y.grad[0, 0]
    b.step(ok=torch.tensor(False))
    assert_unchanged(b, b_p, before)


def compiled_on_cpu(monkeypatch):
    """Route StackedMuon through `optim._fused`'s compiled path on CPU, traced with aot_eager (the same fullgraph
    capture as on CUDA, no C++ build)."""
    torch._dynamo.reset()
    monkeypatch.setattr(optim, "_COMPILED", {})
    monkeypatch.setattr(optim, "ELEMENTWISE_BACKEND", "aot_eager")


def test_the_compiled_elementwise_graphs_trace_whole_and_match_the_eager_step(monkeypatch):
    """On CUDA `_momentum` and `_apply` run as torch.compile graphs: no graph break, the same bits as the eager
    step over steps with a new lr each (no recompile for it), and a refused step with a NaN gradient and a -0.0
    weight changes no bit; one graph per function and firewall form."""
    from torch._dynamo.utils import counters

    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    a_p, b_p, a, b = twins(kw)
    gen = torch.Generator().manual_seed(3)
    compiled_on_cpu(monkeypatch)
    counters.clear()
    for step in range(4):
        same_grads(a_p, b_p, gen)
        for opt in (a, b):
            opt.param_groups[0]["lr"] = 0.02 * (1 - step / 8)
        ok = torch.tensor(step != 2)
        if step == 2:
            with torch.no_grad():
                a_p[3][0, 0] = b_p[3][0, 0] = -0.0
            a_p[5].grad[1, 1] = b_p[5].grad[1, 1] = float("nan")
            before = snapshot(b, b_p)
        eager_and_compiled_step(monkeypatch, a, b, ok)
        if step == 2:
            assert_unchanged(b, b_p, before)
        for x, y in zip(a_p, b_p):
            assert torch.equal(bits(x.detach()), bits(y.detach())), step
            assert torch.equal(bits(a.state[x]["momentum_buffer"]), bits(b.state[y]["momentum_buffer"])), step
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"]


def test_more_stack_layouts_than_dynamos_recompile_limit_each_compile_once(monkeypatch):
    """Dynamo allows 8 recompiles per code object and a fullgraph compile past them raises; a process can hold more
    optimizer layouts than that (the GPU tests, a benchmark's models), so each layout compiles its own copy."""
    from torch._dynamo.utils import counters

    compiled_on_cpu(monkeypatch)
    counters.clear()
    for n in range(1, 11):  # ten layouts: 1..10 matrices of 8 x 16
        ps = [torch.nn.Parameter(torch.randn(8, 16)) for _ in range(n)]
        for p in ps:
            p.grad = torch.randn_like(p)
        StackedMuon(ps, lr=0.02, weight_decay=0.1).step(ok=torch.tensor(True))
    assert counters["stats"]["unique_graphs"] == 20, dict(counters["stats"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the inductor graphs of the step)")
def test_the_inductor_step_on_cuda_matches_the_eager_step(monkeypatch):
    """The CUDA path (`_momentum` and `_apply` as inductor graphs) against the same functions eager on CUDA:
    momentum to fp32 rounding, weights to bf16 rounding of the Newton–Schulz input; a refused step changes
    no bit, a -0.0 weight included; steps with and without the firewall's flag compile at most one graph
    per function and form (none when an earlier test compiled this layout)."""
    from torch._dynamo.utils import counters

    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    a_p, b_p, a, b = twins(kw, "cuda")
    start = [p.detach().clone() for p in a_p]
    gen = torch.Generator(device="cuda").manual_seed(4)
    counters.clear()
    for step in range(5):
        same_grads(a_p, b_p, gen)
        for opt in (a, b):
            opt.param_groups[0]["lr"] = 0.02 * (1 - step / 8)
        if step == 2:
            with torch.no_grad():
                a_p[3][0, 0] = b_p[3][0, 0] = -0.0
            b_p[3].grad[0, 0] = float("nan")
            before = snapshot(b, b_p)
        ok = None if step == 4 else torch.tensor(step != 2, device="cuda")
        eager_and_compiled_step(monkeypatch, a, b, ok)
        if step == 2:
            assert_unchanged(b, b_p, before)
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])  # (_momentum, _apply) x (ok, None)
    for x, y, s in zip(a_p, b_p, start):
        moved = (x - s).abs().max()
        assert (x - y).abs().max() <= 0.02 * moved
        mx, my = a.state[x]["momentum_buffer"], b.state[y]["momentum_buffer"]
        assert (mx - my).abs().max() <= 1e-6 * mx.abs().max()
