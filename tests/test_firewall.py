"""The NaN firewall decides on the host (CPU runs) or on the device (CUDA, no sync in the step): both
must skip exactly the same steps and leave bit-identical weights and optimizer state."""

import pytest
import torch

from dormouse.train.distributed import World
from dormouse.train.firewall import BadStepsError, Firewall
from dormouse.train.optim import StackedMuon

ONE = World(rank=0, size=1, local_rank=0)


def setup(fused: bool, device: str = "cpu", muon=torch.optim.Muon):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4),
                                torch.nn.Linear(4, 16)).to(device)  # StackedMuon: 16x4 joins 4x16's stack
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim == 1]
    opts = [muon(mats, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1),
            torch.optim.AdamW(vecs, lr=0.01, betas=(0.9, 0.95), fused=fused)]
    return model, opts


def run(on_device: bool, fused: bool, bad: set[int], steps: int = 6, max_bad: int = 3, device: str = "cpu",
        muon=torch.optim.Muon, bad_grad: frozenset[int] = frozenset()):
    """Steps in `bad` have a NaN loss; steps in `bad_grad` a finite loss and an inf in one weight's gradient."""
    model, opts = setup(fused, device, muon)
    now = [None]
    model[2].weight.register_hook(lambda g: g * float("inf") if now[0] in bad_grad else g)
    fw = Firewall(opts, model.parameters(), 1.0, max_bad, ONE, on_device=on_device)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        x, y = (torch.randn(32, n, generator=gen).to(device) for n in (8, 16))
        loss = torch.nn.functional.mse_loss(model(x), y)
        if i in bad:
            loss = loss * float("nan")
        now[0] = i
        fw.step(loss, loss, f"step {i}")
        losses.append(fw.read(f"step {i}"))
    state = {f"{j}.{id_}.{k}": v.clone() for j, o in enumerate(opts)
             for id_, (p, st) in enumerate(o.state.items()) for k, v in st.items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, state, fw.take_skipped(), losses


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (torch.equal takes -0.0 for 0.0)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else torch.equal(a, b)


@pytest.mark.parametrize("muon", [torch.optim.Muon, StackedMuon])
@pytest.mark.parametrize("fused", [False, True])
def test_device_decision_skips_the_same_steps_bit_for_bit(fused, muon):
    """torch's Muon is put back with torch.where; StackedMuon takes the decision as step(ok=...). A NaN loss
    at step 0, an inf gradient in one weight at step 3. Compared bit by bit (-0.0 is not 0.0)."""
    w_host, s_host, n_host, l_host = run(False, fused, bad={0}, bad_grad={3}, muon=muon)
    w_dev, s_dev, n_dev, l_dev = run(True, fused, bad={0}, bad_grad={3}, muon=muon)
    assert n_host == n_dev == 2
    assert s_host.keys() == s_dev.keys()
    for k in w_host:
        assert same(w_host[k], w_dev[k]), k
    for k in s_host:
        assert same(s_host[k], s_dev[k]), k
    w_clean, *_ = run(True, fused, bad=set(), muon=muon)
    assert not all(torch.equal(w_clean[k], w_dev[k]) for k in w_dev)  # the skips did change the run
    assert [x != x for x in l_dev] == [x != x for x in l_host] == [i == 0 for i in range(6)]  # the NaN loss


@pytest.mark.parametrize("muon", [torch.optim.Muon, StackedMuon])
def test_a_skipped_first_step_leaves_no_optimizer_state_behind(muon):
    w_dev, s_dev, *_ = run(True, False, bad={0}, steps=1, muon=muon)
    model, _ = setup(False)
    assert all(torch.equal(w_dev[k], v) for k, v in model.state_dict().items())
    assert all(not v.any() for v in s_dev.values())  # lazily made state is back at zero


@pytest.mark.parametrize("on_device", [False, True])
def test_too_many_bad_steps_in_a_row_abort(on_device):
    with pytest.raises(BadStepsError, match="3 non-finite steps in a row"):
        run(on_device, False, bad={1, 2, 3}, max_bad=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_device_decision_matches_the_host_one():
    """As the pretrain stage runs on CUDA (fused AdamW + StackedMuon, the decision on the device) against the
    host decision on the same GPU."""
    w_host, s_host, n_host, _ = run(False, True, bad={1, 4}, device="cuda", muon=StackedMuon)
    w_dev, s_dev, n_dev, _ = run(True, True, bad={1, 4}, device="cuda", muon=StackedMuon)
    assert n_host == n_dev == 2
    for k in w_host:
        torch.testing.assert_close(w_host[k], w_dev[k], rtol=0, atol=1e-6)
    for k in s_host:
        torch.testing.assert_close(s_host[k], s_dev[k], rtol=0, atol=1e-6)
