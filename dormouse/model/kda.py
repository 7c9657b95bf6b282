"""KDA (Kimi Delta Attention) token mixer: a chunked pure-torch core, a dispatcher to FLA's kernel, the layer.

Recurrence per head (S: [K, V] state, g_t <= 0 log-space per-key-channel decay, beta_t in (0, 1)):

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T          (delta rule on the decayed state)
    o_t = scale * S_t^T q_t

`chunk_kda_torch` evaluates it chunk by chunk (as FLA's `chunk_kda` / `naive_chunk_kda`): inside a chunk
the delta-rule updates are folded into a WY/UT form by one unit-lower-triangular solve, across chunks the
state is carried by a python loop over chunks. `kda` picks FLA's Triton kernel on CUDA and this torch code
elsewhere, and counts which one ran; `kda_recurrent` does the same for decode steps (FLA's
`fused_recurrent_kda`, or `recurrent_kda_torch`: the recurrence above one step at a time), and the mixer
takes it whenever T == 1; `short_conv` picks our Triton conv (`conv_triton`) on CUDA from the sequence
start for convs up to 4 wide, FLA's Triton `causal_conv1d` on CUDA otherwise (a cache, a wider conv), and
`regions.silu_conv` elsewhere. `KDAMixer` mirrors `fla.layers.kda.KimiDeltaAttention`
(projections, short conv + SiLU, L2-normalised q/k, low-rank decay gate, sigmoid beta, gated output
RMSNorm, o_proj) with plain torch modules so the CPU path needs no Triton.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.model.config import ModelConfig
from dormouse.model.regions import silu_conv

L2NORM_EPS = 1e-6  # as FLA's l2norm: x / sqrt(sum(x^2) + eps)
SUB_CHUNK = 8  # intra-chunk sub-block size for the numerically safe decay products (8 measured fastest on CPU)
# Log-decays are clamped here before exp: exp(-40) ~ 4e-18 is far below fp32 resolution of the O(1) terms it
# multiplies, and keeping exp() and the products after it out of the subnormal range (< 1.2e-38) matters:
# x86 computes on subnormals 5-50x slower, and strong gates (g ~ -10 per step) reach them within a chunk.
LOG_DECAY_FLOOR = -40.0


class _DecayExp(torch.autograd.Function):
    """exp of a log-decay, clamped to [LOG_DECAY_FLOOR, 0]: a decay is <= 1 (g <= 0); the floor is explained
    above; the upper clamp also keeps masked (j > i) pairwise entries finite before they are zeroed.
    Backward is d exp = exp (straight through the clamp: at the floor the true gradient is ~0 either way),
    which saves autograd the clamp's masks."""

    @staticmethod
    def forward(ctx, x):
        y = torch.exp(x.clamp(LOG_DECAY_FLOOR, 0.0))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


_exp = _DecayExp.apply


# --------------------------------------------------------------------------------------------------
# Chunked KDA in pure torch
# --------------------------------------------------------------------------------------------------
def _to_chunks(x: torch.Tensor, pad: int, n_chunks: int, chunk: int) -> torch.Tensor:
    """[B, T, H, ...] -> fp32 [B, H, NT, C, ...], zero-padded at the end of the time axis."""
    x = x.float()
    if pad:
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    return x.unflatten(1, (n_chunks, chunk)).movedim(3, 1)


def _intra_chunk_terms(qk: torch.Tensor, g: torch.Tensor, c: int):
    """Everything inside a chunk that involves the decay, never forming exp(+large) and never subtracting two
    long cumulative sums (in fp32 that cancels: |G| over a chunk reaches hundreds, so a small difference of two
    such sums would keep only ~1e-4 relative precision); each log-decay is summed directly over its own range.

    qk: [..., 2, C, K] (q and k stacked), g: [..., C, K] per-step log decay (<= 0), c: sub-block size (c | C).
    Returns
      A     [..., 2, C, C]: A[0][i, j] = sum_d q_i k_j exp(G_i - G_j), A[1] the same with k_i, for j <= i, else 0
      G     [..., C, K]: sum_{s <= i} g_s, log decay from the chunk's entry state to row i
      G_end [..., C, K]: sum_{s > i} g_s, log decay from row i to the chunk's end
      G_tot [..., K]:    sum_s g_s
    Pairs in different sub-blocks (block J < block I) factor through the row r just before block I:
    exp(G_i - G_r) * exp(G_r - G_j), both factors <= 1, so a whole row block is one matmul; pairs in the same
    sub-block use the pairwise exponent directly (a [c, c, K] tensor per block; cancellation only at the
    sub-block scale).
    """
    C, K = g.shape[-2:]
    n, dev, dt = C // c, g.device, g.dtype
    gb = g.unflatten(-2, (n, c))  # [..., n, c, K]
    incl = gb.cumsum(-2)  # sum over s <= i inside the block       [..., n, c, K]
    after_in = F.pad(gb.flip(-2).cumsum(-2).flip(-2)[..., 1:, :], (0, 0, 0, 1))  # sum over s > i in the block
    tot = incl[..., -1, :]  # block totals                            [..., n, K]
    m = torch.arange(n, device=dev)
    lt = (m[:, None] < m[None, :]).to(dt)  # lt[a, b] = a < b                [n, n]
    before = lt.T @ tot  # sum of the blocks before block I          [..., n, K]
    after = lt @ tot  # sum of the blocks after block I               [..., n, K]
    between = torch.einsum("jm,mi,...mk->...ijk", lt, lt, tot)  # blocks strictly between J and I  [..., n(I), n(J), K]

    # off-diagonal blocks: q_i|k_i exp(G_i - G_r) (r = row before block I) times k_j exp(G_r - G_j), j in J < I.
    # Blocks J >= I are computed too (finite: every exponent is clamped to <= 0) and masked out at the end,
    # on the [C, C] result rather than on the K-times larger factors.
    qkb = qk.unflatten(-2, (n, c))  # [..., 2, n, c, K]
    kb = qkb[..., 1, :, :, :]  # [..., n, c, K]
    left = (qkb * _exp(incl).unsqueeze(-4)).movedim(-4, -3).flatten(-3, -2)  # q|k rows of block I  [..., n(I), 2c, K]
    right = kb.unsqueeze(-4) * _exp(between.unsqueeze(-2) + after_in.unsqueeze(-4))  # [..., n(I), n(J), c(j), K]
    off = left @ right.flatten(-3, -2).transpose(-1, -2)  # [..., n(I), 2c(i), C(j)]
    off = off.unflatten(-2, (2, c)).movedim(-3, -4).flatten(-3, -2)  # [..., 2, C(i), C(j)]

    # diagonal blocks: exp(G_i - G_j) inside the block (j > i: finite, masked out below)
    y = _exp(incl.unsqueeze(-2) - incl.unsqueeze(-3)) * kb.unsqueeze(-3)  # k_j exp(G_i - G_j)  [..., n, c(i), c(j), K]
    diag = (y @ qkb.movedim(-4, -1)).movedim(-1, -4)  # [..., 2, n(I), c(i), c(j)]

    # assemble: off-diagonal where block J < block I, diagonal blocks where j <= i
    blk = torch.arange(C, device=dev) // c
    off_mask = (blk[:, None] > blk[None, :]).to(dt)  # [C, C]
    diag_mask = (torch.eye(n, device=dev, dtype=dt)[:, None, :, None]
                 * torch.ones(c, c, device=dev, dtype=dt).tril()[None, :, None, :])  # [n(I), c(i), n(J), c(j)]
    A = off * off_mask + (diag.unsqueeze(-2) * diag_mask).flatten(-4, -3).flatten(-2)  # [..., 2, C, C]

    G = (before.unsqueeze(-2) + incl).flatten(-3, -2)  # [..., C, K]
    G_end = (after.unsqueeze(-2) + after_in).flatten(-3, -2)  # [..., C, K]
    return A, G, G_end, tot.sum(-2)


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA in pure torch, same semantics as `fla.ops.kda.chunk_kda` with
    use_qk_l2norm_in_kernel=False and use_gate_in_kernel=False (the caller normalises q/k and applies the gate).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-space decay (<= 0); beta: [B, T, H];
    initial_state: [B, H, K, V] (any float dtype; used in fp32). Computes in fp32, returns
    (o [B, T, H, V] in v.dtype, final state fp32 [B, H, K, V] or None). Any T: the tail is padded with
    k = v = q = 0, g = 0 (no decay) and beta = 0 (no write), i.e. identity steps on the state, then trimmed.
    Differentiable (plain autograd).
    """
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    assert k.shape == q.shape and g.shape == q.shape, (q.shape, k.shape, g.shape)
    assert v.shape[:3] == (B, T, H) and beta.shape == (B, T, H), (v.shape, beta.shape)
    scale = K**-0.5 if scale is None else scale
    if T == 0:
        S = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
        return v.new_zeros(B, 0, H, V), (S if output_final_state else None)
    # chunk length: chunk_size, or T rounded up to the sub-block size for short inputs (decode steps)
    C = min(chunk_size, -(-T // SUB_CHUNK) * SUB_CHUNK)
    c = math.gcd(C, SUB_CHUNK)  # sub-block size
    pad = (-T) % C
    NT = (T + pad) // C

    q, k, v, g = (_to_chunks(x, pad, NT, C) for x in (q, k, v, g))  # [B, H, NT, C, K|V]
    beta = _to_chunks(beta, pad, NT, C)  # [B, H, NT, C]
    q = q * scale

    A, G, G_end, G_tot = _intra_chunk_terms(torch.stack([q, k], -3), g, c)  # [B, H, NT, 2, C, C], ...
    A_qk = A[..., 0, :, :]  # j <= i
    A_kk = A[..., 1, :, :].tril(-1)  # j < i
    # WY/UT transform: (I + diag(beta) A_kk) [w | u] = diag(beta) [exp(G) k | v]
    L = beta[..., None] * A_kk  # strictly lower                               [B, H, NT, C, C]
    rhs = beta[..., None] * torch.cat([_exp(G) * k, v], -1)  # [B, H, NT, C, K+V]
    wu = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    w, u = wu[..., :K], wu[..., K:]  # [B, H, NT, C, K], [B, H, NT, C, V]

    q_dec = q * _exp(G)  # q against the chunk-entry state           [B, H, NT, C, K]
    k_dec = (k * _exp(G_end)).transpose(-1, -2)  # k decayed to the chunk end   [B, H, NT, K, C]
    d_tot = _exp(G_tot).unsqueeze(-1)  # whole-chunk decay               [B, H, NT, K, 1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()  # [B, H, K, V]
    outs = []
    # unbind once (indexing per chunk would make autograd scatter into a full-size zero tensor per chunk)
    for u_n, w_n, qd_n, a_n, kd_n, d_n in zip(*(x.unbind(2) for x in (u, w, q_dec, A_qk, k_dec, d_tot))):
        v_new = u_n - w_n @ S  # corrected values                          [B, H, C, V]
        outs.append(qd_n @ S + a_n @ v_new)  # [B, H, C, V]
        S = d_n * S + kd_n @ v_new
    o = torch.stack(outs, 2).flatten(2, 3)[:, :, :T].transpose(1, 2)  # [B, T, H, V]
    return o.to(out_dtype), (S if output_final_state else None)


# --------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _optional(module: str, attr: str | None = None):
    """`module` (or its `attr`), or None when it is not importable: FLA needs triton and CUDA-capable builds, and
    is imported lazily, so CPU runs never pay for it. For FLA any import failure means "use the next path"; our
    own modules give None only for a missing dependency (triton), and any other error surfaces."""
    try:
        m = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if module.startswith("dormouse.") and (e.name or "").startswith("dormouse"):
            raise
        return None
    except Exception:  # noqa: BLE001
        if module.startswith("dormouse."):
            raise
        return None
    return getattr(m, attr) if attr else m


def fla_op(name: str):
    """FLA's Triton op `fla.ops.kda.<name>`, or None."""
    return _optional("fla.ops.kda", name)


def on_gpu(t: torch.Tensor) -> bool:
    """Whether `t` takes the CUDA kernels' branches: one seam, so the CPU tests drive those branches with stand-in
    ops (tests/test_kda_dispatch.py) instead of leaving them to the first GPU run."""
    return t.is_cuda


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    counters=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA core on already-normalised q/k and already-activated g/beta (shapes as `chunk_kda_torch`).

    CUDA + fla importable -> `fla.ops.kda.chunk_kda` (FLA picks its own chunking); otherwise the torch path.
    Counts `kda_path.fla` / `kda_path.torch` in `counters` (a Counter or dict) once per call.
    """
    op = fla_op("chunk_kda") if on_gpu(q) else None
    path = "kda_path.fla" if op is not None else "kda_path.torch"
    if counters is not None:
        counters[path] = counters.get(path, 0) + 1
    if op is not None:
        return op(
            q, k, v, g.float(), beta,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False,
            # training keeps the forward's intermediates (w, u, qg, kg, v_new, h: ~0.45 GB a medium layer)
            # instead of recomputing them in backward; FLA's option for small models
            disable_recompute=torch.is_grad_enabled(),
        )
    return chunk_kda_torch(q, k, v, g, beta, initial_state=initial_state,
                           output_final_state=output_final_state, chunk_size=chunk_size)


def fused_gates_available(q: torch.Tensor) -> bool:
    """Whether FLA's kernel will apply the layer's activations itself (`kda_fused_gates`): CUDA, fla importable,
    and either a chunk of tokens (`chunk_kda`) or a decode step (T == 1) wanting no gradient (`fused_recurrent_kda`,
    which has no backward). In a decode step the activations are ~20 small kernels a layer otherwise, and a graphed
    step is launch-bound (benchmarks/records/2026-12-06-serve-h100)."""
    if not on_gpu(q):
        return False
    if q.shape[1] > 1:
        return fla_op("chunk_kda") is not None
    return not (torch.is_grad_enabled() and q.requires_grad) and fla_op("fused_recurrent_kda") is not None


def kda_fused_gates(q, k, v, f, b, A_log, dt_bias, *, initial_state=None, counters=None):
    """The KDA core on the raw activations, as FLA's own `KimiDeltaAttention` calls it: `chunk_kda` (a decode
    step, T == 1: `fused_recurrent_kda`, counted `kda_path.fla_recurrent`) applies
    the q/k L2 norms, the decay gate -exp(A_log) * softplus(f + dt_bias) (fused into its chunk cumsum) and
    beta's sigmoid itself, in fp32, with the gradients of A_log and dt_bias. What `KDAMixer.gates` computes,
    with fewer passes over [B, T, H, K] (7.13 against 7.45 ms a medium layer, benchmarks/records/2026-12-04-throughput-h200-run6). CUDA + fla only (callers check
    `fused_gates_available`); the CPU tests check `gates` and the GPU test checks the two against each other.
    Counts its path once per call. Returns (o [B, T, H, V], final state fp32)."""
    if q.shape[1] == 1:  # a decode step: FLA's recurrent kernel, the same activations inside
        if counters is not None:
            counters["kda_path.fla_recurrent"] = counters.get("kda_path.fla_recurrent", 0) + 1
        if initial_state is None:
            initial_state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float32)
        return fla_op("fused_recurrent_kda")(
            q, k, v, f, b, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state.float(),
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True)
    if counters is not None:
        counters["kda_path.fla"] = counters.get("kda_path.fla", 0) + 1
    return fla_op("chunk_kda")(
        q, k, v, f, b, A_log=A_log, dt_bias=dt_bias,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        disable_recompute=torch.is_grad_enabled(),  # as in `kda`
    )


def _fla_causal_conv1d():
    """FLA's Triton `causal_conv1d`, or None."""
    return _optional("fla.modules.causal_conv1d.ops", "causal_conv1d")


def _conv_triton():
    """`dormouse.model.conv_triton` (our Triton conv from the sequence start), or None."""
    return _optional("dormouse.model.conv_triton")


def _fla_norm_gate():
    """FLA's Triton `rms_norm_gated` (x * rsqrt(mean(x^2) + eps) * weight * act(gate), fp32 inside), or None."""
    return _optional("fla.modules.norm.fused_norm_gate", "rms_norm_gated")


def _conv_step_triton():
    """`dormouse.model.conv_step_triton` (q, k and v's convs for one decode step in one launch), or None."""
    return _optional("dormouse.model.conv_step_triton")


def short_conv_fla(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None, op=None) -> torch.Tensor:
    """`short_conv`'s output through FLA's `causal_conv1d` (SiLU fused): FLA keeps the last W inputs as a
    [B, C, W] state whose oldest slot a width-W kernel never reads, so our [B, W-1, C] cache goes in
    transposed behind a zero slot. Checked against the torch path under Triton's interpreter on CPU."""
    op = op or _fla_causal_conv1d()
    state = None if cache is None else F.pad(cache.to(x.dtype).transpose(1, 2), (1, 0)).contiguous()
    return op(x, weight=weight[:, 0], activation="silu", initial_state=state, backend="triton")[0]  # x may be strided


def short_conv(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None = None,
               counters=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU (FLA's ShortConvolution) over x [B, T, C], continuing `cache` (the
    previous W-1 inputs [B, W-1, C]; None: sequence start). weight [C, 1, W]. Returns (y [B, T, C] in x's
    dtype, the new cache).

    On CUDA from the sequence start with W <= 4 (training, a prompt's first chunk): our Triton kernels
    (`dormouse.model.conv_triton`; FLA's backward costs ~5 x its memory traffic). On CUDA with a cache: FLA's
    Triton `causal_conv1d` (0.84 ms less than the torch code under inductor for the three convs of a medium
    layer, benchmarks/records/2026-12-04-throughput-h200-run5). Otherwise `regions.silu_conv`. Counts `conv_path.triton` /
    `conv_path.fla` / `conv_path.torch` once per call."""
    B, T, C = x.shape
    W = weight.shape[-1]
    ours = _conv_triton() if on_gpu(x) and cache is None else None
    ours = ours if ours is not None and W <= ours.MAX_W else None  # wider: FLA's or the torch path
    op = _fla_causal_conv1d() if on_gpu(x) and ours is None else None
    path = "conv_path.triton" if ours is not None else "conv_path.fla" if op is not None else "conv_path.torch"
    if counters is not None:
        counters[path] = counters.get(path, 0) + 1

    def head():  # the W-1 inputs before x (zeros at the sequence start), built only on the paths that read them
        return x.new_zeros(B, W - 1, C) if cache is None else cache.to(x.dtype)

    new_cache = x[:, T - (W - 1):] if T >= W - 1 else torch.cat([head(), x], 1)[:, T:]  # the last W-1 inputs
    if ours is not None:
        return ours.silu_conv_triton(x, weight), new_cache
    if op is not None:  # the kernel reads the cache itself: no [B, W-1+T, C] copy
        return short_conv_fla(x, weight, cache, op), new_cache
    return silu_conv(torch.cat([head(), x], 1), weight), new_cache


# --------------------------------------------------------------------------------------------------
# Step-by-step recurrence (decoding)
# --------------------------------------------------------------------------------------------------
def recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of the module docstring one step at a time, in fp32 (shapes as `chunk_kda_torch`).
    Returns (o [B, T, H, V] in v.dtype, final state fp32 [B, H, K, V]). Cost per step is O(H K V) whatever
    came before: this is the decode path. Log-decays are clamped at LOG_DECAY_FLOOR as in the chunked path."""
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    q, k, v, beta = q.float() * scale, k.float(), v.float(), beta.float()
    decay = torch.exp(g.float().clamp(LOG_DECAY_FLOOR, 0.0))  # [B, T, H, K]
    outs = []
    for t in range(T):
        S = decay[:, t, :, :, None] * S  # [B, H, K, V]
        k_t = k[:, t]  # [B, H, K]
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t)  # v - S^T k     [B, H, V]
        S = S + (beta[:, t, :, None] * k_t)[..., None] * err[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))  # scale * S^T q  [B, H, V]
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, V)  # [B, T, H, V]
    return o.to(out_dtype), S


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    counters=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda` for decode steps (a few tokens continuing a state): returns (o [B, T, H, V], final state fp32).

    CUDA + fla importable + no gradient wanted -> `fla.ops.kda.fused_recurrent_kda` (it has no backward);
    otherwise `recurrent_kda_torch`. Counts `kda_path.fla_recurrent` / `kda_path.torch_recurrent` once per call.
    """
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    op = fla_op("fused_recurrent_kda") if on_gpu(q) and not wants_grad else None
    path = "kda_path.fla_recurrent" if op is not None else "kda_path.torch_recurrent"
    if counters is not None:
        counters[path] = counters.get(path, 0) + 1
    if op is not None:
        if initial_state is None:
            initial_state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float32)
        return op(
            q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.contiguous(),
            initial_state=initial_state.float().contiguous(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False,
        )
    return recurrent_kda_torch(q, k, v, g, beta, initial_state=initial_state)


# --------------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------------
class KDAState(NamedTuple):
    """What a later call needs to continue a sequence."""

    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # q/k/v pre-conv inputs, last W-1 steps, [B, W-1, HK]
    recurrent: torch.Tensor  # fp32 [B, H, K, V]


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (FLA's formula; F.normalize clamps instead)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


class KDAMixer(nn.Module):
    """Kimi Delta Attention token mixer, [B, T, D] -> [B, T, D] (FLA's KimiDeltaAttention, expand_v = 1, no GVA)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, H, K = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.chunk_size, self.conv_size = H, K, cfg.kda_chunk_size, cfg.kda_conv_size
        self.norm_eps, self.init_std = cfg.norm_eps, cfg.init_std
        HK = H * K
        self.q_proj = nn.Linear(D, HK, bias=False)
        self.k_proj = nn.Linear(D, HK, bias=False)
        self.v_proj = nn.Linear(D, HK, bias=False)
        if self.conv_size > 0:  # depthwise causal convs (FLA's ShortConvolution), fed with explicit left context
            self.q_conv1d, self.k_conv1d, self.v_conv1d = (
                nn.Conv1d(HK, HK, self.conv_size, groups=HK, bias=False) for _ in range(3))
        self.f_proj = nn.Sequential(nn.Linear(D, K, bias=False), nn.Linear(K, HK, bias=False))  # low-rank decay
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))  # per-head decay rate, log space       [H]
        self.dt_bias = nn.Parameter(torch.empty(HK))  # per-channel gate bias            [H*K]
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(D, K, bias=False), nn.Linear(K, HK, bias=True))  # output gate
        self.o_norm_weight = nn.Parameter(torch.empty(K))  # gated RMSNorm over head_dim
        self.o_proj = nn.Linear(HK, D, bias=False)
        # `in_proj_weight` once, for a model whose weights no longer change (serve.weights.stack_projections)
        self.register_buffer("frozen_in_proj", None, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.init_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv1d):
                m.reset_parameters()  # torch's default, as FLA's ShortConvolution (an nn.Conv1d)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())  # as FLA
            self.dt_bias.zero_()
            self.o_norm_weight.fill_(1.0)

    def in_proj(self, x: torch.Tensor, norm: nn.Module | None = None):
        """The six projections of x as ONE matmul against their weights stacked (a torch.compile region): x
        is read and cast once, and backward makes one dx instead of six summed in fp32 (medium's graphed step:
        115.1 against 128.8 ms with six eager nn.Linear calls, benchmarks/records/2026-12-04-throughput-h200-run6). `norm` (the
        block's pre-mixer RMSNorm) is applied first, inside the region. x [B, T, D] -> (q, k, v [B, T, H*K]
        before the convs, column views of the one product (both Triton convs take strided input; the torch conv
        copies anyway), decay-gate logits f [B, T, H*K], beta logits [B, T, H], output-gate logits [B, T, H*K])."""
        if norm is not None:
            x = norm(x)
        H, K, HK = self.n_heads, self.head_dim, self.n_heads * self.head_dim
        w = self.frozen_in_proj if self.frozen_in_proj is not None else self.in_proj_weight()
        q, k, v, f, g, b, _ = F.linear(x, w).split([HK, HK, HK, K, K, H, w.shape[0] - 3 * HK - 2 * K - H], -1)
        return q, k, v, self.f_proj[1](f), b, self.g_proj[1](g)  # strided views: the Triton convs read them as they are

    def in_proj_weight(self) -> torch.Tensor:
        """The six projections' weights stacked (q, k, v, decay and output gate down-projections, beta), rows
        zero-padded to a multiple of 16: Triton vectorises the convs' loads of the product's columns."""
        H, K, HK = self.n_heads, self.head_dim, self.n_heads * self.head_dim
        ws = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.f_proj[0].weight,
              self.g_proj[0].weight, self.b_proj.weight]
        pad = -(3 * HK + 2 * K + H) % 16
        return torch.cat(ws + [ws[0].new_zeros(pad, ws[0].shape[1])] if pad else ws)

    def project(self, x: torch.Tensor, conv: tuple | None = None, counters=None, norm: nn.Module | None = None):
        """`in_proj`, then the short convs (eager: the Triton conv kernels are opaque to the compiler): x [B, T, D],
        conv the short convs' caches (None: sequence start) -> (q, k, v [B, T, H, K] after conv + SiLU,
        decay-gate logits f [B, T, H, K], beta logits [B, T, H], output-gate logits [B, T, H*K], the convs'
        new caches)."""
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        q, k, v, f, b, gate = self.in_proj(x, norm)  # q, k, v [B, T, H*K]
        conv_state = None
        if self.conv_size > 0:
            cq, ck, cv = conv if conv is not None else (None, None, None)
            weights = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
            step = _conv_step_triton() if T == 1 and cq is not None and on_gpu(q) else None
            if step is not None and 2 <= self.conv_size <= step.MAX_W and all(
                    t.stride(-1) == 1 and t.dtype == q.dtype for t in (k, v, cq, ck, cv)):  # the three in one launch
                (q, k, v), conv_state = step.silu_conv_step3((q, k, v), weights, (cq, ck, cv))
                if counters is not None:
                    counters["conv_path.triton_step"] = counters.get("conv_path.triton_step", 0) + 3
            else:
                q, cq = short_conv(q, weights[0], cq, counters)
                k, ck = short_conv(k, weights[1], ck, counters)
                v, cv = short_conv(v, weights[2], cv, counters)
                conv_state = (cq, ck, cv)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        return q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), f.view(B, T, H, K), b, gate, conv_state

    def gates(self, q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, b: torch.Tensor):
        """The activations before the core (a torch.compile region, see dormouse.model.regions): q, k [B, T,
        H, K] -> L2-normed; f -> fp32 log-decay g; b -> beta. On CUDA FLA's kernel applies them itself
        (`kda_fused_gates`); this runs on CPU and for decode steps."""
        H, K = self.n_heads, self.head_dim
        g = -self.A_log.float().exp()[:, None] * F.softplus(f.float() + self.dt_bias.float().view(H, K))  # [B, T, H, K]
        return l2norm(q), l2norm(k), g, b.sigmoid()

    def gates_in_kernel(self, q: torch.Tensor) -> bool:
        """Whether `prepare` leaves the activations to FLA's kernel (`kda_fused_gates`) for these inputs."""
        return fused_gates_available(q)

    def prepare(self, x: torch.Tensor, conv: tuple | None = None, counters=None, norm: nn.Module | None = None):
        """Everything before the KDA core: `project`, then `gates` -> (q, k [B, T, H, K] L2-normed, v
        [B, T, H, V], g fp32 log-decay, beta [B, T, H], output-gate logits [B, T, H*K], the convs' new caches).
        Where `gates_in_kernel` (CUDA + FLA: a chunk, or a decode step without gradient) q, k, g and beta stay
        raw (un-normed q/k, decay-gate logits f, beta logits) and `core` hands them to FLA's kernel, which applies
        the activations itself.
        Counts `kda_gates.fla` / `kda_gates.torch` once per call."""
        q, k, v, f, b, gate, conv_state = self.project(x, conv, counters, norm)
        fused = self.gates_in_kernel(q)
        if counters is not None:
            key = "kda_gates.fla" if fused else "kda_gates.torch"
            counters[key] = counters.get(key, 0) + 1
        if not fused:
            q, k, f, b = self.gates(q, k, f, b)
        return q, k, v, f, b, gate, conv_state

    def core(self, q, k, v, g, beta, h0: torch.Tensor | None = None, counters=None):
        """The KDA recurrence (FLA's kernels on CUDA; not compiled): a decode step (T == 1) runs the plain
        recurrence, longer inputs the chunked form (on CUDA with the activations inside FLA's kernel, either form:
        g and beta are then the raw logits `prepare` left). Returns (o [B, T, H, V], final state fp32)."""
        if self.gates_in_kernel(q):
            return kda_fused_gates(q, k, v, g, beta, self.A_log, self.dt_bias, initial_state=h0, counters=counters)
        if q.shape[1] == 1:
            return kda_recurrent(q, k, v, g, beta, initial_state=h0, counters=counters)
        return kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=self.chunk_size,
                   counters=counters)

    def finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """After the core (a torch.compile region): gated RMSNorm over head_dim (FLA's FusedRMSNormGated,
        activation "sigmoid") in fp32, then o_proj. o [B, T, H, V], gate logits [B, T, H*K] -> [B, T, D]."""
        B, T, H, K = o.shape
        of = o.float()
        of = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight.float()
        o = (of * torch.sigmoid(gate.view(B, T, H, K).float())).to(gate.dtype)
        return self.o_proj(o.reshape(B, T, H * K))  # [B, T, D]

    def regions(self) -> tuple[str, ...]:
        return ("in_proj", "gates", "finish")

    def forward(self, x: torch.Tensor, counters=None, state: KDAState | None = None,
                norm: nn.Module | None = None) -> tuple[torch.Tensor, KDAState]:
        """x [B, T, D] (norm: applied to x first, inside `in_proj`) -> (y [B, T, D], the state after x)."""
        q, k, v, g, beta, gate, conv_state = self.prepare(x, None if state is None else state.conv, counters, norm)
        o, S = self.core(q, k, v, g, beta, None if state is None else state.recurrent, counters)
        return self.output(o, gate, counters), KDAState(conv=conv_state, recurrent=S)

    def output(self, o: torch.Tensor, gate: torch.Tensor, counters=None) -> torch.Tensor:
        """`finish`, or on CUDA without autograd (decode, prefill, eval) its gated RMSNorm as FLA's one Triton kernel
        (`rms_norm_gated`, what FLA's FusedRMSNormGated runs; ~11 elementwise launches a layer otherwise, and a
        decode step is launch-bound) then o_proj. Training keeps `finish` (a compiled region, with its backward).
        Counts `norm_gate_path.fla` / `norm_gate_path.torch` once per call."""
        wants_grad = torch.is_grad_enabled() and (o.requires_grad or gate.requires_grad)
        op = _fla_norm_gate() if on_gpu(o) and not wants_grad else None
        if counters is not None:
            key = "norm_gate_path.fla" if op is not None else "norm_gate_path.torch"
            counters[key] = counters.get(key, 0) + 1
        if op is None:
            return self.finish(o, gate)
        B, T, H, K = o.shape
        y = op(o, gate.view(B, T, H, K), self.o_norm_weight, None, activation="sigmoid", eps=self.norm_eps)
        return self.o_proj(y.reshape(B, T, H * K))
