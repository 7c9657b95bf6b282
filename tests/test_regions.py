"""torch.compile regions (dormouse.model.regions): the compiled model computes what the eager one does,
counts the same, and compiles one graph per region for the whole stack (not one per block). CPU, with
dynamo's aot_eager backend (traces forward and backward as inductor would, no C compiler needed)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from model_util import live_model, rand_bytes

from dormouse.model.config import ModelConfig
from dormouse.model.regions import causal_depthwise_conv, compile_regions

torch.set_num_threads(1)

CFG = dict(d_model=32, n_heads=2, head_dim=16, ffn_hidden=48, n_core=3, kda_chunk_size=16,
           engram=True, engram_layers=(0, 1, 2), engram_rows=97, engram_dim=8)


@pytest.mark.parametrize("dilation", [1, 3])
def test_causal_depthwise_conv_is_torchs_conv1d(dilation):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 20, 6, generator=g, requires_grad=True)
    w = torch.randn(6, 1, 4, generator=g, requires_grad=True)
    ours = causal_depthwise_conv(x, w, dilation)
    ref = F.conv1d(x.transpose(1, 2), w, dilation=dilation, groups=6).transpose(1, 2)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    gy = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(ours, (x, w), gy), torch.autograd.grad(ref, (x, w), gy),
                               atol=1e-5, rtol=1e-5)


def test_causal_depthwise_conv_sums_bf16_inputs_in_fp32():
    """One rounding at the end, as F.conv1d under autocast (not one per product and sum)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 8, generator=g).bfloat16()
    w = torch.randn(8, 1, 4, generator=g)
    out = causal_depthwise_conv(x, w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, causal_depthwise_conv(x.float(), w).bfloat16())


def loss_grads_counts(model, idx):
    c = Counter()
    model.zero_grad(set_to_none=True)
    _, loss = model(idx[:, :-1], idx[:, 1:], counters=c)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, c


def test_compiled_regions_match_eager_and_compile_once_for_the_stack():
    torch._dynamo.reset()
    model = live_model(ModelConfig(**CFG)).train()
    idx = rand_bytes(2, 49)
    loss0, grads0, c0 = loss_grads_counts(model, idx)

    names = compile_regions(model, backend="aot_eager")
    assert names == ["logits", "blocks.0.mix_ffn", "blocks.0.engram.compute", "blocks.0.mixer.in_proj",
                     "blocks.0.mixer.gates", "blocks.0.mixer.finish", "blocks.1.mix_ffn", "blocks.1.engram.compute",
                     "blocks.1.mixer.in_proj", "blocks.1.mixer.gates", "blocks.1.mixer.finish", "blocks.2.mix_ffn",
                     "blocks.2.engram.compute", "blocks.2.mixer.in_proj", "blocks.2.mixer.gates", "blocks.2.mixer.finish"]
    assert compile_regions(model, backend="aot_eager") == []  # idempotent
    torch._dynamo.utils.counters.clear()
    for _ in range(2):  # the second call must hit the cache
        loss1, grads1, c1 = loss_grads_counts(model, idx)
        torch.testing.assert_close(loss1, loss0, atol=1e-6, rtol=1e-6)
        for n, g in grads0.items():
            torch.testing.assert_close(grads1[n], g, atol=1e-6, rtol=1e-5, msg=n)
        assert c1 == c0 and c1["engram.rows_read"] > 0 and c1["kda_path.torch"] == 3
    # six regions (logits, mix_ffn, engram.compute, in_proj, gates, finish): one graph each for all three blocks
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 6


def test_an_moe_compiles_whole_and_matches_eager():
    """The grouped-GEMM MoE is a region (`apply_experts`, fullgraph: routing, sort, grouped GEMMs, un-sort) with
    one graph for every block; loss, gradients and routing counts equal the eager model's."""
    torch._dynamo.reset()
    model = live_model(ModelConfig(**{**CFG, "moe": True, "n_experts": 4, "moe_top_k": 2})).train()
    idx = rand_bytes(2, 49)
    loss0, grads0, c0 = loss_grads_counts(model, idx)
    names = compile_regions(model, backend="aot_eager")
    assert [n for n in names if n.endswith("apply_experts")] == [f"blocks.{i}.ffn.apply_experts" for i in range(3)]
    torch._dynamo.utils.counters.clear()
    loss1, grads1, c1 = loss_grads_counts(model, idx)
    torch.testing.assert_close(loss1, loss0, atol=1e-6, rtol=1e-6)
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, atol=1e-6, rtol=1e-5, msg=n)
    assert c1 == c0 and sum(v for k, v in c1.items() if k.startswith("moe.tokens.")) == 2 * 48 * 2 * 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 7  # the six of a dense stack and apply_experts


def test_compiled_regions_continue_a_state():
    """Decode-style calls (a state in, T == 1) run through the same regions and give the eager logits."""
    torch._dynamo.reset()
    model = live_model(ModelConfig(**CFG))
    idx = rand_bytes(2, 12)
    with torch.no_grad():
        want, state = model.prefill(idx[:, :8])
        want_step, _ = model.step(idx[:, 8], state)
        compile_regions(model, backend="aot_eager")
        got, state = model.prefill(idx[:, :8])
        got_step, _ = model.step(idx[:, 8], state)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_step, want_step, atol=1e-5, rtol=1e-5)


def test_a_deepcopy_of_a_compiled_model_computes_with_its_own_weights():
    """rl deep-copies its model (the frozen reference): the copy's regions must read the copy's parameters."""
    import copy

    torch._dynamo.reset()
    model = live_model(ModelConfig(**CFG))
    compile_regions(model, backend="aot_eager")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    eager = live_model(ModelConfig(**CFG))
    eager.load_state_dict(twin.state_dict())
    idx = rand_bytes(2, 17)
    with torch.no_grad():
        torch.testing.assert_close(twin(idx)[0], eager(idx)[0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(idx)[0], twin(idx)[0], atol=1e-3)
