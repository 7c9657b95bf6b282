"""StackedMuon (batched Newton–Schulz) against torch.optim.Muon: the same state, the same steps up to
bf16 rounding."""

import copy

import pytest
import torch

from dormouse.optim import StackedMuon


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


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # fp32 bit patterns: torch.equal alone takes -0.0 for 0.0


def test_a_step_refused_on_the_device_changes_no_bit():
    """step(ok=False) with non-finite gradients (NaN in one matrix, inf in another) leaves every weight and
    momentum bit as it was, a -0.0 weight included; step(ok=True) is step() bit for bit."""
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn=None)
    a_p, b_p = params(), params()
    a, b = StackedMuon(a_p, **kw), StackedMuon(b_p, **kw)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for x, y in zip(a_p, b_p):
            x.grad = torch.randn(x.shape, generator=gen)
            y.grad = x.grad.clone()
        a.step()
        b.step(ok=torch.tensor(True))
    for x, y in zip(a_p, b_p):
        assert torch.equal(bits(x.detach()), bits(y.detach()))
        assert torch.equal(bits(a.state[x]["momentum_buffer"]), bits(b.state[y]["momentum_buffer"]))
    with torch.no_grad():
        b_p[3][0] = -0.0
    before = [bits(y.detach()).clone() for y in b_p], [bits(b.state[y]["momentum_buffer"]).clone() for y in b_p]
    for i, y in enumerate(b_p):
        y.grad = torch.randn(y.shape, generator=gen)
        y.grad[0, 0] = float("nan") if i == 3 else float("inf") if i == 5 else y.grad[0, 0]
    b.step(ok=torch.tensor(False))
    for y, w, m in zip(b_p, *before):
        assert torch.equal(bits(y.detach()), w) and torch.equal(bits(b.state[y]["momentum_buffer"]), m)
