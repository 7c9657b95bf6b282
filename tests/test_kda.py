"""KDA token mixer (dormouse.model.kda): the chunked torch core against FLA's reference implementations,
gradients, causality, state continuation, the dispatcher's path counters, and (on a GPU) FLA's kernel.

Relative error throughout: rel(a, b) = max|a - b| / max|b|, with b the reference.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from interpret_util import run_interpreted
from dormouse.model.config import ModelConfig
from dormouse.model.kda import KDAMixer, chunk_kda_torch, kda, l2norm

REL_TOL = 1e-5  # fp32 parity with FLA's naive references


def _load_fla_naive():
    """FLA's torch reference implementations (fla/ops/kda/naive.py: naive_recurrent_kda, naive_chunk_kda).
    Loaded from its file: `import fla` imports every Triton op (~10 s); naive.py needs only torch and einops."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        # fla-core is pinned in requirements.txt: its absence is a broken environment, not a reason to skip.
        pytest.fail("fla-core is not installed (pinned in requirements.txt); the KDA parity tests need its naive reference", pytrace=False)
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    file_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


naive = _load_fla_naive()


pytestmark = pytest.mark.usefixtures("one_thread")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (b = reference)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def make_inputs(B, T, H, K, V, *, gate="fla", h0=False, seed=0, device="cpu", dtype=torch.float32):
    """Inputs as KDAMixer hands them to the core: q/k L2-normalised, g = -exp(A_log) * softplus(f + dt_bias),
    beta = sigmoid(.). gate="fla": A in [1, 16] as FLA's init (fast decay); "slow": decay ~0.99-0.999 per step
    (long memory, so the state carried across chunks dominates)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = l2norm(r(B, T, H, K)), l2norm(r(B, T, H, K)), r(B, T, H, V)
    if gate == "fla":
        A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
        f, dt_bias = r(B, T, H, K), torch.zeros(H, K)
    else:
        A_log = torch.full((H,), -4.0)
        f, dt_bias = 0.5 * r(B, T, H, K), torch.full((H, K), -3.0)
    g = -A_log.exp()[:, None] * F.softplus(f + dt_bias)
    beta = torch.sigmoid(r(B, T, H))
    h0 = r(B, H, K, V) if h0 else None
    out = [q, k, v, g, beta, h0]
    return [None if x is None else x.to(device=device, dtype=dtype if x is not g and x is not h0 else torch.float32)
            for x in out]


# shapes: (B, T, H, K, V, chunk, with initial state); T is no multiple of the chunk except where noted
PARITY_CASES = [
    (2, 100, 3, 16, 24, 64, True),
    (1, 64, 2, 32, 32, 64, False),  # exactly one chunk
    (2, 37, 2, 8, 8, 16, True),
    (1, 130, 4, 32, 16, 32, True),
    (3, 1, 2, 16, 16, 64, True),  # a single decode step
    (1, 75, 1, 64, 48, 64, False),
]


@pytest.mark.parametrize("gate", ["fla", "slow"])
@pytest.mark.parametrize("B,T,H,K,V,chunk,h0", PARITY_CASES)
def test_chunk_matches_naive_recurrent(B, T, H, K, V, chunk, h0, gate):
    q, k, v, g, beta, s0 = make_inputs(B, T, H, K, V, gate=gate, h0=h0, seed=T)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk)
    o_ref, s_ref = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert o.shape == o_ref.shape and o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel(o, o_ref) <= REL_TOL, rel(o, o_ref)
    assert rel(s, s_ref) <= REL_TOL, rel(s, s_ref)
    o2, none = chunk_kda_torch(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert none is None and torch.equal(o2, o)


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunk_matches_naive_chunk(chunk):
    q, k, v, g, beta, s0 = make_inputs(2, 128, 2, 16, 32, h0=True, seed=chunk)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk)
    o_ref, s_ref = naive.naive_chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk)
    # naive_chunk_kda differences long in-chunk cumulative sums, so it is itself only ~1e-6 accurate with FLA's gates
    assert rel(o, o_ref) <= REL_TOL and rel(s, s_ref) <= REL_TOL, (rel(o, o_ref), rel(s, s_ref))


def test_chunk_size_and_padding_do_not_change_results():
    """Padding (beta = 0, g = 0 tail) is an identity on the state: any chunk size gives the same o and state."""
    q, k, v, g, beta, s0 = make_inputs(2, 45, 2, 16, 16, h0=True, seed=1)
    ref = chunk_kda_torch(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=64)
    for chunk in (8, 16, 24, 32):
        o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk)
        assert rel(o, ref[0]) <= REL_TOL and rel(s, ref[1]) <= REL_TOL, chunk


@pytest.mark.parametrize("gate", ["fla", "slow"])
def test_gradients_flow_and_match_naive(gate):
    """Backward runs, every grad is finite and nonzero, and equals autograd through FLA's naive recurrence."""
    q, k, v, g, beta, s0 = make_inputs(2, 70, 2, 16, 24, gate=gate, h0=True, seed=3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
    o, s = chunk_kda_torch(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=32)
    w_o, w_s = torch.randn_like(o), torch.randn_like(s)
    ((o * w_o).sum() + (s * w_s).sum()).backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
    o_r, s_r = naive.naive_recurrent_kda(*ref[:5], initial_state=ref[5], output_final_state=True)
    ((o_r * w_o).sum() + (s_r * w_s).sum()).backward()
    for name, x, x_ref in zip(("q", "k", "v", "g", "beta", "h0"), leaves, ref):
        assert x.grad is not None and torch.isfinite(x.grad).all(), name
        assert x.grad.abs().max() > 0, name
        assert rel(x.grad, x_ref.grad) <= REL_TOL, (name, rel(x.grad, x_ref.grad))


def small_cfg(**kw) -> ModelConfig:
    return dataclasses.replace(ModelConfig(d_model=32, n_heads=2, head_dim=16, kda_chunk_size=16), **kw)


@pytest.mark.parametrize("conv", [4, 0])
def test_mixer_is_causal(conv):
    torch.manual_seed(0)
    mixer = KDAMixer(small_cfg(kda_conv_size=conv))
    x = torch.randn(2, 50, 32)
    t = 23  # inside a chunk (chunk 16)
    x2 = x.clone()
    x2[:, t:] = 10 * torch.randn(2, 50 - t, 32)
    with torch.no_grad():
        y, _ = mixer(x)
        y2, _ = mixer(x2)
    torch.testing.assert_close(y2[:, :t], y[:, :t], rtol=0, atol=1e-7)
    assert (y2[:, t:] - y[:, t:]).abs().amax(-1).min() > 1e-4  # every later position does see the change


@pytest.mark.parametrize("conv", [4, 0])
def test_mixer_state_continuation(conv):
    torch.manual_seed(1)
    mixer = KDAMixer(small_cfg(kda_conv_size=conv))
    x = torch.randn(2, 41, 32)
    with torch.no_grad():
        y_full, st_full = mixer(x)
        for cut in (1, 2, 17, 38):  # 1, 2: shorter than the conv's window
            y1, st = mixer(x[:, :cut])
            y2, st2 = mixer(x[:, cut:], state=st)
            torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(st2.recurrent, st_full.recurrent, rtol=1e-5, atol=1e-6)
        # token-by-token decoding of the tail
        ys, st = [], mixer(x[:, :36])[1]
        for t in range(36, 41):
            y_t, st = mixer(x[:, t : t + 1], state=st)
            ys.append(y_t)
        torch.testing.assert_close(torch.cat(ys, 1), y_full[:, 36:], rtol=1e-5, atol=1e-6)
    assert st_full.recurrent.shape == (2, 2, 16, 16) and st_full.recurrent.dtype == torch.float32
    if conv:
        assert [c.shape for c in st_full.conv] == [(2, 3, 32)] * 3


def test_mixer_trains_on_cpu_and_counts_torch_path():
    torch.manual_seed(2)
    mixer = KDAMixer(small_cfg())
    counters = collections.Counter()
    x = torch.randn(2, 30, 32, requires_grad=True)
    y, _ = mixer(x, counters=counters)
    assert y.shape == x.shape
    y.square().mean().backward()
    assert counters == {"kda_path.torch": 1, "conv_path.torch": 3, "kda_gates.torch": 1, "norm_gate_path.torch": 1}
    for name, p in mixer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
    q, k, v, g, beta, _ = make_inputs(1, 10, 2, 8, 8)
    kda(q, k, v, g, beta, counters=counters)
    kda(q, k, v, g, beta)  # counters optional
    assert counters == {"kda_path.torch": 2, "conv_path.torch": 3, "kda_gates.torch": 1, "norm_gate_path.torch": 1}


def test_mixer_core_inputs_follow_fla_layer_math():
    """What the layer hands the core, recomputed the way FLA's KimiDeltaAttention does it (conv off):
    q/k = l2norm(silu(proj(x))) (FLA's l2norm: x / sqrt(sum x^2 + 1e-6)), g = naive_kda_gate(f_proj(x), A_log,
    dt_bias) = -exp(A_log) * softplus(f + dt_bias), beta = sigmoid(b_proj(x))."""
    import dormouse.model.kda as kda_mod

    torch.manual_seed(3)
    mixer = KDAMixer(small_cfg(kda_conv_size=0))
    with torch.no_grad():
        mixer.dt_bias.normal_()
    B, T, H, K = 2, 20, 2, 16
    x = torch.randn(B, T, 32)
    captured, real = {}, kda_mod.kda

    def spy(q, k, v, g, beta, **kw):
        captured.update(q=q, k=k, v=v, g=g, beta=beta)
        return real(q, k, v, g, beta, **kw)

    kda_mod.kda = spy
    try:
        with torch.no_grad():
            mixer(x)
    finally:
        kda_mod.kda = real
    with torch.no_grad():
        f = mixer.f_proj(x).view(B, T, H, K) + mixer.dt_bias.view(H, K)
        g_ref = -mixer.A_log.exp().view(H, 1) * F.softplus(f)
        qk_ref = [F.silu(p(x)).view(B, T, H, K) for p in (mixer.q_proj, mixer.k_proj)]
        qk_ref = [t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in qk_ref]
        beta_ref = torch.sigmoid(mixer.b_proj(x))
    assert rel(captured["g"], g_ref) <= 1e-6 and (captured["g"] <= 0).all()
    assert rel(captured["q"], qk_ref[0]) <= 1e-6 and rel(captured["k"], qk_ref[1]) <= 1e-6
    assert rel(captured["v"], F.silu(mixer.v_proj(x)).view(B, T, H, K)) <= 1e-6
    assert rel(captured["beta"], beta_ref) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FLA's Triton kernels)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 1.5e-2)])
def test_fla_kernel_matches_torch_path_on_gpu(dtype, tol):
    from fla.ops.kda import chunk_kda

    B, T, H, K, V = 2, 300, 4, 64, 64  # T no multiple of 64
    q, k, v, g, beta, s0 = make_inputs(B, T, H, K, V, h0=True, seed=7, device="cuda", dtype=dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o_f, s_f = chunk_kda(*leaves, initial_state=s0, output_final_state=True)
    (o_f.float().square().sum() + s_f.square().sum()).backward()
    ref = [x.float().clone().requires_grad_() for x in (q, k, v, g, beta)]
    o_t, s_t = chunk_kda_torch(*ref, initial_state=s0, output_final_state=True)
    (o_t.square().sum() + s_t.square().sum()).backward()
    assert rel(o_f, o_t) <= tol, rel(o_f, o_t)
    assert rel(s_f, s_t) <= tol, rel(s_f, s_t)
    for name, x, x_ref in zip(("q", "k", "v", "g", "beta"), leaves, ref):
        assert rel(x.grad, x_ref.grad) <= 3 * tol, (name, rel(x.grad, x_ref.grad))
    # the dispatcher takes FLA on CUDA and says so; the layer on CUDA agrees with the same layer on CPU
    counters = collections.Counter()
    kda(q, k, v, g, beta, initial_state=s0, counters=counters)
    assert counters == {"kda_path.fla": 1}
    torch.manual_seed(0)
    mixer = KDAMixer(small_cfg(d_model=256, n_heads=4, head_dim=64))
    x = torch.randn(2, 100, 256)
    with torch.no_grad():
        y_cpu, st_cpu = mixer(x)
        y_gpu, st_gpu = mixer.cuda()(x.cuda(), counters=counters)
    assert counters["kda_path.fla"] == 2 and counters["conv_path.triton"] == 3  # from the start: our conv kernels
    assert rel(y_gpu.cpu(), y_cpu) <= 5e-3 and rel(st_gpu.recurrent.cpu(), st_cpu.recurrent) <= 5e-3
    assert all(rel(a.cpu(), b) <= 1e-5 for a, b in zip(st_gpu.conv, st_cpu.conv))  # fp32 projections, cuBLAS vs CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FLA's Triton kernels)")
def test_decode_steps_on_gpu_match_the_cpu_path():
    """A decode step on CUDA (q, k and v's convs in one launch, FLA's recurrent kernel with the gates inside)
    continues a prompt's state as the torch path does on the CPU: outputs, recurrent state, conv caches."""
    torch.manual_seed(0)
    mixer = KDAMixer(small_cfg(d_model=256, n_heads=4, head_dim=64)).eval()
    x = torch.randn(3, 70, 256)
    counters = collections.Counter()
    with torch.no_grad():
        _, st_cpu = mixer(x[:, :67])
        gpu = copy.deepcopy(mixer).cuda()
        _, st_gpu = gpu(x[:, :67].cuda())
        for t in range(67, 70):
            y_cpu, st_cpu = mixer(x[:, t:t + 1], state=st_cpu)
            y_gpu, st_gpu = gpu(x[:, t:t + 1].cuda(), state=st_gpu, counters=counters)
            assert rel(y_gpu.cpu(), y_cpu) <= 5e-3 and rel(st_gpu.recurrent.cpu(), st_cpu.recurrent) <= 5e-3, t
            assert all(rel(a.cpu(), b) <= 1e-5 for a, b in zip(st_gpu.conv, st_cpu.conv)), t
    assert counters == {"kda_gates.fla": 3, "kda_path.fla_recurrent": 3, "conv_path.triton_step": 9,
                        "norm_gate_path.fla": 3}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FLA's Triton kernels)")
def test_gates_inside_fla_kernel_match_our_gates_region_on_gpu():
    """On CUDA the mixer leaves the q/k L2 norms, the decay gate and beta's sigmoid to chunk_kda
    (kda_fused_gates); the same mixer with our `gates` region instead: outputs, states and every parameter's
    gradient (A_log's and dt_bias' through FLA's gate backward) agree, fp32, with a state carried in."""
    torch.manual_seed(0)
    fused = KDAMixer(small_cfg(d_model=256, n_heads=4, head_dim=64)).cuda()
    with torch.no_grad():
        fused.dt_bias.normal_()
    ours = copy.deepcopy(fused)
    ours.gates_in_kernel = lambda q: False
    x, dy = torch.randn(2, 200, 256, device="cuda"), torch.randn(2, 200, 256, device="cuda")
    with torch.no_grad():
        _, st = fused(x[:, :37])  # a state to continue: the recurrent part and the conv caches
    (c1, c2), outs = (collections.Counter(), collections.Counter()), []
    for m, c in ((fused, c1), (ours, c2)):
        y, s = m(x, counters=c, state=st)
        (y * dy).sum().backward()
        outs.append((y.detach(), s.recurrent))
    assert c1["kda_gates.fla"] == 1 and c2["kda_gates.torch"] == 1 and c1["kda_path.fla"] == c2["kda_path.fla"] == 1
    assert c1["norm_gate_path.torch"] == c2["norm_gate_path.torch"] == 1  # training: `finish`, with its backward
    assert rel(outs[0][0], outs[1][0]) <= 5e-3 and rel(outs[0][1], outs[1][1]) <= 5e-3
    for (name, a), (_, b) in zip(fused.named_parameters(), ours.named_parameters()):
        assert rel(a.grad, b.grad) <= 1.5e-2, (name, rel(a.grad, b.grad))


_INTERPRETED_CONV = r"""
import json, torch
from benchmarks import triton_interpret
triton_interpret.apply()  # no benchmarker; scalar loop bounds under numpy 2
from dormouse.model.kda import short_conv, short_conv_fla

torch.manual_seed(0)
out = {}
W, C = 4, 24
w = torch.randn(C, 1, W)
for name, B, T, cached, dtype in [("start", 2, 37, False, torch.float32), ("cached", 2, 21, True, torch.float32),
                                 ("short", 3, 2, True, torch.float32), ("step", 2, 1, True, torch.float32),
                                 ("bf16", 2, 19, True, torch.bfloat16), ("strided", 2, 70, True, torch.bfloat16)]:
    # "strided": x is the middle C columns of a [B, T, 3C] tensor, as KDAMixer.in_proj hands k to the conv
    wide = torch.randn(B, T, 3 * C if name == "strided" else C).to(dtype)
    cols = slice(C, 2 * C) if name == "strided" else slice(0, C)
    x = wide[..., cols]
    cache = torch.randn(B, W - 1, C).to(dtype) if cached else None
    caches = [cache if cache is None else cache.clone().requires_grad_() for _ in range(2)]
    wides = [wide.clone().requires_grad_() for _ in range(2)]
    xs = [t[..., cols] for t in wides]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    counters = {}
    y_ref, new_cache = short_conv(xs[0], ws[0], caches[0], counters)  # CPU tensors: the torch path
    y = short_conv_fla(xs[1], ws[1], caches[1])
    dy = torch.randn(y.shape).to(dtype)
    y_ref.backward(dy)
    y.backward(dy)
    same = None
    if name == "strided":  # FLA on the view against FLA on a contiguous copy: bit for bit
        assert not xs[1].is_contiguous()
        xc = x.contiguous().requires_grad_()
        cc = caches[1].detach().clone().requires_grad_()
        yc = short_conv_fla(xc, w.clone().requires_grad_(), cc)
        yc.backward(dy)
        same = torch.equal(yc, y) and torch.equal(xc.grad, wides[1].grad[..., cols]) and torch.equal(cc.grad, caches[1].grad)
    scale = y_ref.float().abs().max().item()
    out[name] = {"y": (y.float() - y_ref.float()).abs().max().item() / scale,
                 "dx": (wides[1].grad.float() - wides[0].grad.float()).abs().max().item() / wides[0].grad.float().abs().max().item(),
                 "dw": (ws[1].grad - ws[0].grad).abs().max().item() / ws[0].grad.abs().max().item(),
                 "dcache": 0.0 if not cached else (caches[1].grad.float() - caches[0].grad.float()).abs().max().item()
                           / caches[0].grad.float().abs().max().item(),
                 "dtype": str(y.dtype), "counters": counters, "same_as_contiguous": same,
                 "cache_is_last_inputs": torch.equal(new_cache.detach(), torch.cat([cache if cached else x.new_zeros(B, W - 1, C), x], 1)[:, -(W - 1):])}
print(json.dumps(out))
"""


def test_fla_short_conv_matches_the_torch_path_under_triton_interpreter():
    """FLA's causal_conv1d kernels (the CUDA path of `short_conv`) run on CPU under TRITON_INTERPRET=1: same
    taps, SiLU, cache hand-over (our last W-1 inputs -> FLA's [B, C, W] state) and gradients as the torch path."""
    res = run_interpreted(_INTERPRETED_CONV)
    for name, r in res.items():
        tol = 2e-2 if name in ("bf16", "strided") else 1e-5
        assert r["y"] <= tol and r["dx"] <= tol and r["dw"] <= 10 * tol and r["dcache"] <= tol, (name, r)
        assert r["counters"] == {"conv_path.torch": 1} and r["cache_is_last_inputs"], (name, r)
    assert res["bf16"]["dtype"] == res["strided"]["dtype"] == "torch.bfloat16" and len(res) == 6
    assert res["strided"]["same_as_contiguous"] is True


_INTERPRETED_DECODE = r"""
import json, torch
from benchmarks import triton_interpret
triton_interpret.apply()  # no benchmarker; scalar loop bounds under numpy 2
from dormouse.model import kda as kda_module
from dormouse.model.config import ModelConfig
from dormouse.model.kda import KDAMixer

cfg = ModelConfig.from_dict({"d_model": 48, "n_heads": 3, "head_dim": 16, "ffn_hidden": 64, "n_core": 1})
torch.manual_seed(0)
mixer = KDAMixer(cfg).eval()
with torch.no_grad():  # weights away from init: gates and decays of every size
    for p in mixer.parameters():
        p.add_(torch.randn(p.shape) * 0.3)
x = torch.randn(3, 12, 48)
out = {}
with torch.no_grad():
    _, state = mixer(x[:, :10])  # the prompt on the torch path
    ref = []
    st = state
    for t in (10, 11):  # two decode steps on the torch path: our gates, the torch recurrence
        y, st = mixer(x[:, t:t + 1], state=st)
        ref.append((y, st))
    kda_module.on_gpu = lambda t: True  # the CUDA branches, FLA's kernels interpreted on the CPU
    c = {}
    st = state
    for i, t in enumerate((10, 11)):
        y, st = mixer(x[:, t:t + 1], state=st, counters=c)
        ry, rst = ref[i]
        out[f"step{i}"] = {"y": (y - ry).abs().max().item() / ry.abs().max().item(),
                           "S": (st.recurrent - rst.recurrent).abs().max().item() / rst.recurrent.abs().max().item(),
                           "conv": max((a - b).abs().max().item() for a, b in zip(st.conv, rst.conv))}
out["counters"] = c
print(json.dumps(out))
"""


def test_fla_decode_step_with_the_gates_in_the_kernel_matches_the_torch_path_under_triton_interpreter():
    """A decode step on the CUDA branches runs q, k and v's convs in one launch (`conv_step_triton`), FLA's
    `fused_recurrent_kda` with the L2 norms, the decay gate and beta's sigmoid inside the kernel (no gates of ours)
    and FLA's `rms_norm_gated` for the output's gated norm:
    under TRITON_INTERPRET=1 on the CPU its output, recurrent state and conv caches (bit for bit) are the torch
    path's, over two steps from a prompt's state."""
    res = run_interpreted(_INTERPRETED_DECODE)
    assert res["counters"] == {"kda_gates.fla": 2, "kda_path.fla_recurrent": 2, "conv_path.triton_step": 6,
                               "norm_gate_path.fla": 2}, res
    for name in ("step0", "step1"):
        assert res[name]["y"] <= 1e-5 and res[name]["S"] <= 1e-5 and res[name]["conv"] == 0.0, (name, res[name])


_INTERPRETED_CONV_STEP = r"""
import json, torch
from benchmarks import triton_interpret
triton_interpret.apply()
from dormouse.model.conv_step_triton import silu_conv_step3
from dormouse.model.kda import short_conv

torch.manual_seed(0)
out = {}
for name, B, C, W, dtype in [("fp32", 3, 40, 4, torch.float32), ("bf16", 2, 300, 4, torch.bfloat16),
                             ("w2", 2, 16, 2, torch.float32), ("w3_bf16", 2, 24, 3, torch.bfloat16)]:
    prod = torch.randn(B, 1, 3 * C + 5).to(dtype)  # q, k, v as column views of one product, as in_proj gives them
    xs = tuple(prod[..., i * C:(i + 1) * C] for i in range(3))
    ws = tuple(torch.randn(C, 1, W) for _ in range(3))
    caches = tuple(torch.randn(B, W - 1 + 2, C).to(dtype)[:, 2:] for _ in range(3))  # strided over time too
    ys, ns = silu_conv_step3(xs, ws, caches)
    ref = [short_conv(x, w, c) for x, w, c in zip(xs, ws, caches)]  # CPU tensors: the torch path
    out[name] = {"y": max((y.float() - r[0].float()).abs().max().item() / r[0].float().abs().max().item()
                          for y, r in zip(ys, ref)),
                 "cache_equal": all(torch.equal(n, r[1].to(dtype)) for n, r in zip(ns, ref)),
                 "dtypes": sorted({str(t.dtype) for t in (*ys, *ns)}), "shapes": [list(ys[0].shape), list(ns[0].shape)]}
print(json.dumps(out))
"""


def test_the_decode_steps_one_launch_conv_matches_the_torch_path_under_triton_interpreter():
    """`conv_step_triton.silu_conv_step3` (q, k and v's convs for one token, one launch) against `short_conv`'s
    torch path: column views of one product, caches strided over time, W 2-4, fp32 and bf16; the new caches are the
    last W - 1 inputs bit for bit."""
    res = run_interpreted(_INTERPRETED_CONV_STEP)
    for name, r in res.items():
        tol = 1e-2 if r["dtypes"] == ["torch.bfloat16"] else 1e-6
        assert r["y"] <= tol and r["cache_equal"], (name, r)
    assert res["bf16"]["dtypes"] == res["w3_bf16"]["dtypes"] == ["torch.bfloat16"] and len(res) == 4
    assert res["w2"]["shapes"] == [[2, 1, 16], [2, 1, 16]]


def test_optional_imports_hide_a_missing_dependency_not_a_broken_module_of_ours(tmp_path, monkeypatch):
    """`_optional` is how the dispatcher finds FLA and our Triton conv: a missing module means "the next path",
    but an error inside one of our own modules must surface, not quietly switch the run to FLA's conv."""
    from dormouse.model import kda as kda_module

    assert kda_module._optional("surely_no_such_module_dormouse_test") is None
    pkg = tmp_path / "dormouse_optional_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "needs_missing.py").write_text("import surely_no_such_dependency_dormouse_test\n")
    (pkg / "broken.py").write_text("raise RuntimeError('a bug in our module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = importlib.import_module  # our modules are looked up in the probe package instead
    monkeypatch.setattr(kda_module.importlib, "import_module",
                        lambda name: real(name.replace("dormouse.", "dormouse_optional_probe.", 1)))
    assert kda_module._optional("dormouse.needs_missing") is None  # triton absent: the next path
    with pytest.raises(RuntimeError, match="a bug in our module"):
        kda_module._optional("dormouse.broken")
    with pytest.raises(ModuleNotFoundError):
        kda_module._optional("dormouse.no_such_module_of_ours")
