"""The KDA layer's CUDA branches, driven on the CPU: `kda.on_gpu` patched to True and FLA's ops (and our Triton
conv) replaced by stand-ins that bind their arguments to the real FLA signatures and compute with the torch path.
These branches were once reached only on a GPU, where a shadowed name (`fla_op = fla_op(...)`) crashed sft, rl,
bench and serve while the CPU suite stayed green."""

import inspect
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dormouse.model import kda as kda_mod
from dormouse.model.config import ModelConfig
from dormouse.model.kda import KDAMixer, KDAState, chunk_kda_torch, l2norm, recurrent_kda_torch
from dormouse.model.regions import silu_conv

fla_kda = pytest.importorskip("fla.ops.kda", reason="fla-core (with triton) gives the real signatures")
fla_conv = pytest.importorskip("fla.modules.causal_conv1d.ops", reason="fla-core's causal_conv1d signature")
fla_norm = pytest.importorskip("fla.modules.norm.fused_norm_gate", reason="fla-core's rms_norm_gated signature")


def bound(real, *args, **kwargs):
    """The call's arguments as the real op would take them (a wrong keyword raises TypeError here, unless the op
    takes **kwargs: chunk_kda reads A_log and dt_bias from them)."""
    b = inspect.signature(real).bind(*args, **kwargs)
    b.apply_defaults()
    a = dict(b.arguments)
    return {**a, **a.pop("kwargs", {})}


def in_kernel(a):
    """(q, k, g, beta) after what the kernel's flags ask it to apply itself, as FLA's kernels do."""
    q, k, g, beta = (a[n] for n in ("q", "k", "g", "beta"))
    if a["use_qk_l2norm_in_kernel"]:
        q, k = l2norm(q), l2norm(k)
    if a["use_gate_in_kernel"]:
        H, K = q.shape[2], q.shape[3]
        g = -a["A_log"].float().exp()[:, None] * F.softplus(g.float() + a["dt_bias"].float().view(H, K))
    if a.get("use_beta_sigmoid_in_kernel"):
        beta = beta.sigmoid()
    return q, k, g, beta


def chunk_kda_standin(calls):
    def op(*args, **kwargs):
        a = bound(fla_kda.chunk_kda, *args, **kwargs)
        calls.append(("chunk_kda", a))
        q, k, g, beta = in_kernel(a)
        return chunk_kda_torch(q, k, a["v"], g, beta, initial_state=a["initial_state"],
                               output_final_state=a["output_final_state"], chunk_size=16)
    return op


def recurrent_standin(calls):
    def op(*args, **kwargs):
        a = bound(fla_kda.fused_recurrent_kda, *args, **kwargs)
        calls.append(("fused_recurrent_kda", a))
        assert a["use_qk_l2norm_in_kernel"] == a["use_gate_in_kernel"] == a["use_beta_sigmoid_in_kernel"]
        q, k, g, beta = in_kernel(a)
        return recurrent_kda_torch(q, k, a["v"], g, beta, initial_state=a["initial_state"])
    return op


def causal_conv1d_standin(calls):
    def op(*args, **kwargs):
        a = bound(fla_conv.causal_conv1d, *args, **kwargs)
        calls.append(("causal_conv1d", a))
        x, w, state = a["x"], a["weight"], a["initial_state"]  # w [C, W]; state [B, C, W], oldest slot unread
        head = state[:, :, 1:].transpose(1, 2).to(x.dtype)  # the W-1 inputs before x
        return silu_conv(torch.cat([head, x], 1), w[:, None, :]), None
    return op


def norm_gate_standin(calls):
    def op(*args, **kwargs):
        a = bound(fla_norm.rms_norm_gated, *args, **kwargs)
        calls.append(("rms_norm_gated", a))
        assert a["activation"] == "sigmoid" and a["bias"] is None and a["residual"] is None
        x, g = a["x"].float(), a["g"].float()
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + a["eps"]) * a["weight"].float() * g.sigmoid()
        return y.to(a["x"].dtype)
    return op


@pytest.fixture
def on_gpu(monkeypatch):
    """The CUDA branches with stand-ins; returns the calls they saw."""
    calls = []
    ops = {"chunk_kda": chunk_kda_standin(calls), "fused_recurrent_kda": recurrent_standin(calls)}
    monkeypatch.setattr(kda_mod, "on_gpu", lambda t: True)
    monkeypatch.setattr(kda_mod, "fla_op", lambda name: ops[name])
    monkeypatch.setattr(kda_mod, "_fla_causal_conv1d", lambda: causal_conv1d_standin(calls))

    def silu_conv_triton(x, w):  # no history: zeros before x
        calls.append(("conv_triton", {}))
        return silu_conv(F.pad(x, (0, 0, w.shape[-1] - 1, 0)), w)

    triton_conv = SimpleNamespace(MAX_W=4, silu_conv_triton=silu_conv_triton)
    monkeypatch.setattr(kda_mod, "_conv_triton", lambda: triton_conv)

    def silu_conv_step3(xs, weights, caches):  # one token continuing each cache
        calls.append(("conv_step3", {}))
        full = [torch.cat([c.to(x.dtype), x], 1) for x, c in zip(xs, caches)]
        return tuple(silu_conv(f, w) for f, w in zip(full, weights)), tuple(f[:, 1:] for f in full)

    conv_step = SimpleNamespace(MAX_W=4, silu_conv_step3=silu_conv_step3)
    monkeypatch.setattr(kda_mod, "_conv_step_triton", lambda: conv_step)
    monkeypatch.setattr(kda_mod, "_fla_norm_gate", lambda: norm_gate_standin(calls))
    return calls


def inputs(B=2, T=8, H=2, K=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(B, T, H, K, generator=g)) for _ in range(2))
    v = torch.randn(B, T, H, K, generator=g)
    gate = -F.softplus(torch.randn(B, T, H, K, generator=g))
    beta = torch.rand(B, T, H, generator=g)
    return q, k, v, gate, beta


def test_kda_takes_fla_chunk_op_on_cuda(on_gpu):
    q, k, v, g, beta = inputs()
    h0 = torch.randn(2, 2, 8, 8)
    c = Counter()
    o, S = kda_mod.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, counters=c)
    want_o, want_S = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    assert c == {"kda_path.fla": 1} and [n for n, _ in on_gpu] == ["chunk_kda"]
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(S, want_S)


def test_kda_on_cuda_without_fla_runs_the_torch_path(monkeypatch):
    """CUDA with fla missing (the image without the wheel): counted as the torch path, not a crash."""
    monkeypatch.setattr(kda_mod, "on_gpu", lambda t: True)
    monkeypatch.setattr(kda_mod, "fla_op", lambda name: None)
    q, k, v, g, beta = inputs()
    c = Counter()
    o, _ = kda_mod.kda(q, k, v, g, beta, counters=c, chunk_size=4)
    o2, _ = kda_mod.kda_recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], counters=c)
    assert c == {"kda_path.torch": 1, "kda_path.torch_recurrent": 1}
    torch.testing.assert_close(o, chunk_kda_torch(q, k, v, g, beta, chunk_size=4)[0])
    assert o2.shape == (2, 1, 2, 8)


def test_kda_recurrent_takes_fla_op_only_without_grad(on_gpu):
    q, k, v, g, beta = (t[:, :1] for t in inputs())
    c = Counter()
    o, S = kda_mod.kda_recurrent(q, k, v, g, beta, counters=c)
    want_o, want_S = recurrent_kda_torch(q, k, v, g, beta)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(S, want_S)
    q.requires_grad_(True)  # fused_recurrent_kda has no backward: the torch path
    kda_mod.kda_recurrent(q, k, v, g, beta, counters=c)
    assert c == {"kda_path.fla_recurrent": 1, "kda_path.torch_recurrent": 1}
    assert [n for n, _ in on_gpu] == ["fused_recurrent_kda"]


def test_mixer_prefill_and_decode_on_the_cuda_branches_match_the_cpu_path(on_gpu, monkeypatch):
    """A mixer's prefill (FLA's chunk kernel with the gates inside, our Triton conv) and a decode step (FLA's
    recurrent kernel with the gates inside, causal_conv1d continuing the caches) give what the CPU path gives."""
    cfg = ModelConfig.from_dict({"d_model": 32, "n_heads": 2, "head_dim": 8, "ffn_hidden": 64, "n_core": 1,
                                 "kda_chunk_size": 16})
    torch.manual_seed(0)
    mixer = KDAMixer(cfg).eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        c = Counter()
        y, state = mixer(x[:, :8], counters=c)
        y1, state1 = mixer(x[:, 8:], counters=c, state=state)
        monkeypatch.undo()
        want_y, want_state = mixer(x[:, :8])
        want_y1, want_state1 = mixer(x[:, 8:], state=want_state)
    assert c == Counter({"kda_gates.fla": 2, "kda_path.fla": 1, "kda_path.fla_recurrent": 1,  # gates in the kernels
                         "conv_path.triton": 3, "conv_path.triton_step": 3,  # the step's three convs: one launch
                         "norm_gate_path.fla": 2})  # no autograd: the output's gated norm in FLA's kernel
    assert [a["use_gate_in_kernel"] for n, a in on_gpu if n in ("chunk_kda", "fused_recurrent_kda")] == [True] * 2
    assert [n for n, _ in on_gpu] == ["conv_triton"] * 3 + ["chunk_kda", "rms_norm_gated", "conv_step3",
                                                            "fused_recurrent_kda", "rms_norm_gated"]
    torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y1, want_y1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state1.recurrent, want_state1.recurrent, rtol=1e-4, atol=1e-5)


def test_a_decode_step_wanting_gradients_keeps_our_gates_and_the_torch_recurrence(on_gpu):
    """FLA's recurrent kernel has no backward: a one-token call with autograd on (none in serving, rl or bench
    today) takes our gates and the torch recurrence on CUDA too, and its gradients reach A_log and dt_bias."""
    cfg = ModelConfig.from_dict({"d_model": 32, "n_heads": 2, "head_dim": 8, "ffn_hidden": 64, "n_core": 1})
    torch.manual_seed(0)
    mixer = KDAMixer(cfg)
    c = Counter()
    state = KDAState(conv=None, recurrent=torch.randn(2, 2, 8, 8))  # a state to decay: the gate's gradient
    y, _ = mixer(torch.randn(2, 1, 32), counters=c, state=state)
    y.square().sum().backward()
    assert c == Counter({"kda_gates.torch": 1, "kda_path.torch_recurrent": 1, "conv_path.triton": 3,
                         "norm_gate_path.torch": 1})  # and `finish`, with its backward
    assert [n for n, _ in on_gpu] == ["conv_triton"] * 3
    assert mixer.A_log.grad.abs().sum() > 0 and mixer.dt_bias.grad.abs().sum() > 0


@pytest.mark.parametrize("why", ["not importable", "caches of another dtype"])
def test_a_decode_step_without_the_step_kernel_takes_flas_conv_per_cache(on_gpu, monkeypatch, why):
    """Where `conv_step_triton` is not importable (or the caches are not unit-stride, or not x's dtype: the kernel
    moves them over unrounded), each conv continues its cache through FLA's causal_conv1d, counted per conv, with
    what the CPU path gives."""
    if why == "not importable":
        monkeypatch.setattr(kda_mod, "_conv_step_triton", lambda: None)
    cfg = ModelConfig.from_dict({"d_model": 32, "n_heads": 2, "head_dim": 8, "ffn_hidden": 64, "n_core": 1})
    torch.manual_seed(0)
    mixer = KDAMixer(cfg).eval()
    x = torch.randn(2, 1, 32)
    dtype = torch.float64 if why == "caches of another dtype" else torch.float32
    state = KDAState(conv=tuple(torch.randn(2, 3, 16, dtype=dtype) for _ in range(3)), recurrent=torch.randn(2, 2, 8, 8))
    c = Counter()
    with torch.no_grad():
        y, st = mixer(x, counters=c, state=state)
        monkeypatch.undo()
        want_y, want_st = mixer(x, state=state)
    assert c["conv_path.fla"] == 3 and "conv_path.triton_step" not in c
    assert [n for n, _ in on_gpu] == ["causal_conv1d"] * 3 + ["fused_recurrent_kda", "rms_norm_gated"]
    torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(st.conv, want_st.conv))
