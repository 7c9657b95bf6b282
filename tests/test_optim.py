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


@pytest.mark.parametrize("nesterov,wd", [(True, 0.0), (False, 0.1)])
def test_stacked_muon_takes_torchs_steps(nesterov, wd):
    ref_p, new_p = params(), params()
    kw = dict(lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=wd, adjust_lr_fn="match_rms_adamw")
    ref, new = torch.optim.Muon(ref_p, **kw), StackedMuon(new_p, **kw)
    start = [p.detach().clone() for p in ref_p]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for a, b in zip(ref_p, new_p):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
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
