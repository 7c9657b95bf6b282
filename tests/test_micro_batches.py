"""train.micro_batch_size: a step's rows as micro-batches whose gradients add up before one optimizer step. It must
train as the whole batch does (up to float summation order), on either firewall path, skip a step when any part is
not finite, and refuse a size that does not divide the rows."""

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_pretrain import TINY_MODEL, TINY_TRAIN

from dormouse.core.config import ConfigError, load_preset
from dormouse.planner.registry import stage_params
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM
from dormouse.train.optim import build_optimizers
from dormouse.train.trainer import PretrainStep
from dormouse.train.settings import OptimSettings, TrainSettings

TRAIN = {**load_preset("tiny", Path(__file__).resolve().parents[1])["train"], **TINY_TRAIN,
         "dtype": "float32", "lr": 3e-3, "muon_lr": 0.02, "optimizer": "muon", "weight_decay": 0.1,
         "grad_clip": 1.0, "max_bad_steps": 3, "moe_aux_coef": 0.01, "cuda_graphs": "never"}


def batches(n: int = 3, rows: int = 4):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        b = torch.randint(0, 256, (rows, 33), generator=g)
        out.append((b[:, :-1].contiguous(), b[:, 1:].contiguous()))
    return out


def train_steps(model, micro, on_device: bool, data, nan_at=frozenset(), cfg=None, train=None):
    """Steps over `data`; nan_at holds (step, forward call within the step) pairs whose loss is made NaN. Returns the
    logged losses, the counters, the skipped steps, each step's gradients as the optimizers took them, and the step."""
    train = {**(train or TRAIN), "micro_batch_size": micro}
    step = PretrainStep(model, build_optimizers(model, OptimSettings.of(train)), cfg or ModelConfig.from_dict(TINY_MODEL),
                        TrainSettings.of(train),
                        torch.device("cpu"), graphs="eager", firewall_on_device=on_device)
    forward, where, grads = step.forward, {"step": 0, "call": 0}, []

    def poisoned(x, y, counters):
        loss, total = forward(x, y, counters)
        if (where["step"], where["call"]) in nan_at:
            loss, total = loss * float("nan"), total * float("nan")
        where["call"] += 1
        return loss, total

    def finish(*args, _finish=step.firewall.finish, **kwargs):
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return _finish(*args, **kwargs)

    step.forward, step.firewall.finish = poisoned, finish
    counters, losses = Counter(), []
    for i, (x, y) in enumerate(data):
        where.update(step=i, call=0)
        step(x, y, counters, f"step {i}")
        losses.append(float(step.firewall.read(f"step {i}")))
    return losses, counters, step.firewall.take_skipped(), grads, step


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("moe", [False, True])
def test_micro_batches_train_as_the_whole_batch(on_device, moe):
    """Each step's summed gradients equal the whole batch's up to summation order, one optimizer step per batch. (The
    MoE's balancing term is off here: it is taken per micro-batch, as under DDP per rank, so it differs by design.)
    Later steps' weights are not compared: AdamW turns a 1e-10 gradient of an unseen byte's row into a step of ~lr."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({**TINY_MODEL, **({"moe": True, "n_experts": 4, "moe_top_k": 1} if moe else {})})
    whole = ByteLM(cfg)
    with torch.no_grad():  # no zero-initialised projection: every weight gets a gradient in the first step
        for p in whole.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    parts = copy.deepcopy(whole)
    data, train = batches(), {**TRAIN, "moe_aux_coef": 0.0}
    la, ca, _, ga, _ = train_steps(whole, None, on_device, data, cfg=cfg, train=train)
    lb, cb, _, gb, step = train_steps(parts, 2, on_device, data, cfg=cfg, train=train)
    assert cb["micro_batches"] == 3 * 2 and "micro_batches" not in ca
    assert set(cb) - {"micro_batches"} == set(ca)  # the same arms ran (their counts are per forward call: twice as many)
    assert la == pytest.approx(lb, rel=1e-4) and len(ga) == len(gb) == 3
    assert set(ga[0]) == set(gb[0]) == {n for n, _ in whole.named_parameters()}
    for k, a in ga[0].items():  # the first step, from the same weights (later ones start from weights Adam moved apart)
        assert a.abs().max() > 0
        torch.testing.assert_close(gb[0][k], a, rtol=1e-4, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    adam = step.firewall.opts[-1]
    assert {int(st["step"]) for st in adam.state.values()} == {3}  # one optimizer step per batch, not per micro-batch


@pytest.mark.parametrize("part", [0, 1])
@pytest.mark.parametrize("on_device", [False, True])
def test_a_non_finite_micro_batch_skips_the_whole_step(on_device, part):
    torch.manual_seed(0)
    model = ByteLM(ModelConfig.from_dict(TINY_MODEL))
    clean = copy.deepcopy(model)
    data = batches(2)
    # one of step 0's micro-batches is NaN: nothing of step 0 may land, and step 1 trains from the untouched weights
    skipped = train_steps(model, 2, on_device, data, nan_at={(0, part)})[2]
    train_steps(clean, 2, on_device, data[1:])
    assert skipped == 1
    for (k, a), b in zip(clean.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_a_micro_batch_size_that_does_not_divide_is_refused():
    step = PretrainStep(ByteLM(ModelConfig.from_dict(TINY_MODEL)), [], ModelConfig.from_dict(TINY_MODEL),
                        TrainSettings.of({**TRAIN, "micro_batch_size": 3}), torch.device("cpu"), graphs="eager", firewall_on_device=False)
    assert step.parts(6) == 2 and step.parts(3) == 1 and step.parts(2) == 1  # not smaller than the rows: one part
    with pytest.raises(ValueError, match="does not divide this rank's 4 rows"):
        step.parts(4)
    preset = load_preset("tiny", Path(__file__).resolve().parents[1])
    base = stage_params("pretrain", preset)
    assert "micro_batch_size" not in base["train"]  # null: out of the digest
    preset["train"] = {**preset["train"], "micro_batch_size": 3}
    with pytest.raises(ConfigError, match=f"micro_batch_size 3 does not divide train.batch_size {preset['train']['batch_size']}"):
        stage_params("pretrain", preset)
    preset["train"]["micro_batch_size"] = 1
    assert stage_params("pretrain", preset)["train"]["micro_batch_size"] == 1
