"""dormouse.train.cuda_graphs: when the pretrain step is graphed, how a replay counts, and (on a GPU) that the graphed
step trains as the eager one does."""

import copy
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_pretrain import TINY_MODEL, TINY_TRAIN, job_json, run_stage, set_model, shards_fixture  # noqa: F401 -- the shards fixture

from dormouse.core.config import load_preset
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM
from dormouse.model.regions import compile_regions
from dormouse.train import cuda_graphs, distributed
from dormouse.train.firewall import Firewall
from dormouse.train.optim import build_optimizers
from dormouse.train.runtime import autocast, evaluate
from dormouse.train.trainer import PretrainStep
from dormouse.train.settings import OptimSettings, TrainSettings

ONE = distributed.World()


@pytest.mark.parametrize("asked,device,moe,world,want", [
    ("never", "cuda", False, 1, "eager"),
    ("cuda", "cpu", False, 1, "eager"),  # asked for GPUs only: not a refusal on CPU
    ("cuda", "cuda", True, 1, "graphed"),  # an MoE has fixed shapes and no host sync
    ("cuda", "cuda", False, 2, "refused_ddp"),
    ("cuda", "cuda", False, 1, "graphed"),
])
def test_decide(asked, device, moe, world, want):
    cfg = ModelConfig.from_dict({**TINY_MODEL, "moe": moe})
    assert cuda_graphs.decide(asked, device, cfg, world) == want


def test_a_replay_counts_one_forward_of_the_real_model():
    """The capture's calls all count the same, so a replay adds exactly one eager forward's counts."""
    cfg = ModelConfig.from_dict({**TINY_MODEL, "engram": True, "engram_rows": 256, "engram_dim": 8, "n_prelude": 1,
                                 "n_loop": 2})
    model = ByteLM(cfg)
    x = torch.randint(0, 256, (2, 32))
    one, capture = Counter(), Counter()
    model(x, x, counters=one)
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        model(x, x, counters=capture)
    assert one and cuda_graphs.per_call(capture, cuda_graphs.WARMUP_CALLS + 1) == one


def test_uneven_capture_counts_are_an_error():
    with pytest.raises(RuntimeError, match="kda_path.torch.*not the same on each of the capture's 4"):
        cuda_graphs.per_call(Counter({"kda_path.torch": 6, "engram.lookups": 8}), 4)


ROOT = Path(__file__).resolve().parents[1]


def gpu_setup():
    """A tiny model with Engram and the stage's CUDA training settings (bf16, Muon + AdamW, the firewall's clip) on top
    of a validated preset's train section, as the stage gets it: every key the schema fills in is there (a hand-made
    dict without moe_aux_coef once failed these tests on the GPU only)."""
    cfg = ModelConfig.from_dict({**TINY_MODEL, "engram": True, "engram_rows": 256, "engram_dim": 8})
    train = {**load_preset("tiny", ROOT)["train"], **TINY_TRAIN, "device": "cuda", "dtype": "bfloat16", "lr": 3e-3,
             "muon_lr": 0.02, "optimizer": "muon", "weight_decay": 0.0, "grad_clip": 1.0, "max_bad_steps": 3}
    return cfg, train


def test_the_gpu_tests_settings_train_a_step_on_the_cpu():
    """The GPU tests' set-up, checked where CI runs: one eager step of the stage's PretrainStep with gpu_setup()'s
    settings on the CPU (fp32), with and without an MoE and micro-batches."""
    for moe, micro in ((False, None), (True, 2)):
        cfg, train = gpu_setup()
        if moe:
            cfg = ModelConfig.from_dict({**cfg.to_dict(), "moe": True, "n_experts": 4, "moe_top_k": 1})
        train = {**train, "device": "cpu", "dtype": "float32", "micro_batch_size": micro}
        torch.manual_seed(0)
        model = ByteLM(cfg).train()
        step = PretrainStep(model, build_optimizers(model, OptimSettings.of(train)), cfg, TrainSettings.of(train), torch.device("cpu"), graphs="eager")
        b = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
        loss = step(b[:, :-1], b[:, 1:], Counter(), "test")
        assert math.isfinite(float(loss))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's Triton kernels)")
@pytest.mark.parametrize("graphs", [False, True])
def test_a_cuda_step_never_waits_for_the_host(graphs):
    """Issue #7's "no host synchronisation inside the step": forward, backward, clip, the firewall's decision and
    both optimizers, as the stage runs them on CUDA (regions compiled, FLA's kernels, optionally replayed from a
    graph), under torch's sync debug mode set to raise. Warm-up first: autotuning and compiling sync by design."""
    torch.manual_seed(0)
    cfg, train = gpu_setup()
    model = ByteLM(cfg).cuda().train()
    compile_regions(model)
    opts = build_optimizers(model, OptimSettings.of(train))
    fw = Firewall(opts, model.parameters(), 1.0, 3, ONE, on_device=True)
    x = torch.randint(0, 256, (4, 64), device="cuda")
    counters = Counter()
    graphed = cuda_graphs.GraphedLoss(model, x, x, train["dtype"]) if graphs else None

    def step():
        if graphed is not None:
            loss, total = graphed(x, x, counters)
        else:
            with autocast(x.device, train["dtype"]):
                loss = total = model(x, x, counters=counters)[1]
        fw.step(loss, total, "test")

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(fw.read("test")) and counters["kda_path.fla"] > 0  # the one sync, at a log step


def test_the_graphed_loss_carries_the_moe_balancing_term():
    """What a replay backpropagates is the stage's total: the loss plus moe_aux_coef times the balancing loss
    (an MoE's graphed step once dropped it: R003). make_graphed_callables captures this module; on CPU its forward
    runs as is."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({**TINY_MODEL, "moe": True, "n_experts": 4, "moe_top_k": 1})
    model = ByteLM(cfg)
    train = {**load_preset("tiny", ROOT)["train"], **TINY_TRAIN, "moe_aux_coef": 0.5, "cuda_graphs": "cuda", "grad_clip": 1.0, "max_bad_steps": 3,
             "dtype": "float32", "lr": 1e-3, "muon_lr": 0.02, "optimizer": "muon", "weight_decay": 0.0}
    step = PretrainStep(model, build_optimizers(model, OptimSettings.of(train)), cfg, TrainSettings.of(train), torch.device("cpu"), graphs="eager")
    x = torch.randint(0, 256, (2, 32))
    loss, total = step.forward(x, x, Counter())
    out = cuda_graphs._Loss(model, train["dtype"], Counter(), step.total_of)(x, x)
    assert float(total - loss) > 0
    torch.testing.assert_close(out, torch.stack([loss, total]).detach(), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's Triton kernels)")
@pytest.mark.parametrize("moe", [False, True])
def test_graphed_steps_train_and_count_as_eager_steps(moe):
    """As the stage runs (dormouse.train.trainer.PretrainStep): regions compiled (inductor), the device firewall,
    an eval between steps. Four steps on batches 0, 1, 2, 0 (batch 0's buffer must not have been overwritten by the
    later batches), eager against graphed from the same weights: the same kernels, so the same losses and weights up
    to reduction order; with an MoE the balancing term trains both."""
    torch.manual_seed(0)
    cfg, train = gpu_setup()
    if moe:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "moe": True, "n_experts": 4, "moe_top_k": 1})
        train = {**train, "moe_aux_coef": 0.5}
    eager = ByteLM(cfg).cuda().train()
    twin = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 65), generator=g).cuda() for _ in range(3)]
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]
    losses, counts, evals = {}, {}, {}
    for name, model in (("eager", eager), ("graphed", twin)):
        compile_regions(model)
        model.defer_routing = True  # as the stage
        step = PretrainStep(model, build_optimizers(model, OptimSettings.of(train)), cfg, TrainSettings.of(train), torch.device("cuda"), graphs=name)
        counts[name], losses[name] = Counter(), []
        for i, b in enumerate([0, 1, 2, 0]):
            step(*batches[b], counts[name], "test")
            losses[name].append(float(step.firewall.read("test")))
            if i == 1:  # an eager eval between replays, as the stage's eval_every
                evals[name] = evaluate(model, *batches[2], 4, torch.device("cuda"), train["dtype"], Counter())
        model.take_routing(counts[name])
    assert counts["graphed"] == counts["eager"] and counts["eager"]["kda_path.fla"] > 0
    torch.testing.assert_close(torch.tensor(losses["graphed"]), torch.tensor(losses["eager"]), rtol=1e-3, atol=0)
    assert evals["graphed"] == pytest.approx(evals["eager"], rel=1e-3)
    assert losses["graphed"][3] != losses["graphed"][0]  # batch 0 again, after three updates
    for (k, a), b in zip(eager.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-3, msg=lambda m, k=k: f"{k}: {m}")
    with pytest.raises(ValueError, match="not the captured"):
        step.graphed(batches[0][0][:2], batches[0][1][:2], Counter())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's Triton kernels)")
def test_the_stage_graphs_its_step_and_counts_the_replays(request):
    """The stage under train.cuda_graphs: cuda (its shards need the filter stage, so fasttext: absent from the
    device tool's image, where benchmarks/gpu_small_chain.sh runs the stage, graphed by default)."""
    pytest.importorskip("fasttext", reason="the shards fixture runs the filter stage (fasttext)")
    shards = request.getfixturevalue("shards")
    config = set_model(shards, {**TINY_MODEL, "engram": True, "engram_rows": 256, "engram_dim": 8},
                       {**TINY_TRAIN, "device": "cuda", "steps": 6, "eval_every": 3, "ckpt_every": 100,
                        "cuda_graphs": "cuda"})
    job, out_dir = job_json(shards, config)
    run_stage(shards, job)
    c = json.loads((shards / out_dir / "manifest.json").read_text())["counters"]
    assert c["cuda_graphs.captures"] == 1 and c["cuda_graphs.replays_this_process"] == 6
    assert c["train.kda_path.fla"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's Triton kernels)")
def test_graphed_micro_batches_sum_their_gradients_as_eager_ones():
    """train.micro_batch_size under CUDA graphs: a replayed backward's gradients are views of the graph's own buffers,
    which the next micro-batch's replay overwrites, so the step sums into gradient buffers of its own
    (PretrainStep, Firewall.finish keep_grads). Two steps of 4 rows as 2 micro-batches, graphed against eager from the
    same weights: the gradients the optimizers take agree to bf16 rounding (the bug doubled the second micro-batch's)."""
    torch.manual_seed(0)
    cfg, train = gpu_setup()
    train = {**train, "micro_batch_size": 2}
    eager = ByteLM(cfg).cuda().train()
    twin = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 65), generator=g).cuda() for _ in range(2)]
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]
    grads, counts = {}, {}
    for name, model in (("eager", eager), ("graphed", twin)):
        compile_regions(model)
        step = PretrainStep(model, build_optimizers(model, OptimSettings.of(train)), cfg, TrainSettings.of(train), torch.device("cuda"), graphs=name)
        grads[name], counts[name] = [], Counter()

        def finish(*args, _finish=step.firewall.finish, _model=model, _grads=grads[name], **kwargs):
            _grads.append({n: p.grad.float().clone() for n, p in _model.named_parameters() if p.grad is not None})
            return _finish(*args, **kwargs)

        step.firewall.finish = finish
        for x, y in batches:
            step(x, y, counts[name], "test")
    assert counts["graphed"]["micro_batches"] == counts["eager"]["micro_batches"] == 4
    for i, (a, b) in enumerate(zip(grads["eager"], grads["graphed"])):
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=2e-2, atol=1e-4, msg=lambda m, k=k, i=i: f"step {i} {k}: {m}")
