"""KDA (Kimi Delta Attention) token mixer: a chunked pure-torch core, a dispatcher to FLA's kernel, the layer.

Recurrence per head (S: [K, V] state, g_t <= 0 log-space per-key-channel decay, beta_t in (0, 1)):

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T          (delta rule on the decayed state)
    o_t = scale * S_t^T q_t

`chunk_kda_torch` evaluates it chunk by chunk (as FLA's `chunk_kda` / `naive_chunk_kda`): inside a chunk
the delta-rule updates are folded into a WY/UT form by one unit-lower-triangular solve, across chunks the
state is carried by a python loop over chunks. `kda` picks FLA's Triton kernel on CUDA and this torch code
elsewhere, and counts which one ran. `KDAMixer` mirrors `fla.layers.kda.KimiDeltaAttention` (projections,
short conv + SiLU, L2-normalised q/k, low-rank decay gate, sigmoid beta, gated output RMSNorm, o_proj) with
plain torch modules so the CPU path needs no Triton.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.model.config import ModelConfig

L2NORM_EPS = 1e-6  # as FLA's l2norm: x / sqrt(sum(x^2) + eps)
SUB_CHUNK = 16  # intra-chunk block size for the numerically safe decay products (FLA uses 16 too)


# --------------------------------------------------------------------------------------------------
# Chunked KDA in pure torch
# --------------------------------------------------------------------------------------------------
def _to_chunks(x: torch.Tensor, pad: int, n_chunks: int, chunk: int) -> torch.Tensor:
    """[B, T, H, ...] -> fp32 [B, H, NT, C, ...], zero-padded at the end of the time axis."""
    x = x.float()
    if pad:
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    return x.unflatten(1, (n_chunks, chunk)).movedim(3, 1)


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed scores inside each chunk, never forming exp(+large).

    q, k, G: [..., C, K] (G = in-chunk cumulative log decay, non-increasing along C).
    Returns A_qk [..., C, C] = sum_d q_i k_j exp(G_i - G_j) for j <= i (else 0)
        and A_kk [..., C, C] = the same with k_i in place of q_i, for j < i (else 0).
    Pairs in different sub-blocks (block J < block I) factor through the reference row r_J (last row of
    block J): exp(G_i - G_r) * exp(G_r - G_j), both factors <= 1, so the block is a plain matmul; pairs in
    the same sub-block use the exact pairwise exponent (a [c, c, K] tensor per block).
    """
    C, K = G.shape[-2:]
    n = C // c
    dev = G.device
    blk = torch.arange(C, device=dev) // c  # block id of each row      [C]
    ref = torch.arange(n, device=dev) * c + c - 1  # reference row of each block J   [n]
    G_ref = G[..., ref, :]  # [..., n, K]

    # off-diagonal blocks: column block J gets rows i in blocks > J
    below = (blk[None, :] > torch.arange(n, device=dev)[:, None])[..., None]  # [n, C, 1]
    e_left = torch.exp(torch.where(below, G.unsqueeze(-3) - G_ref.unsqueeze(-2), -math.inf))  # [..., n, C, K]
    Gb = G.unflatten(-2, (n, c))  # [..., n, c, K]
    kb = k.unflatten(-2, (n, c))  # [..., n, c, K]
    k_right = (kb * torch.exp(G_ref.unsqueeze(-2) - Gb)).transpose(-1, -2)  # [..., n, K, c]
    qk_off = (q.unsqueeze(-3) * e_left) @ k_right  # [..., n(J), C(i), c(j)]
    kk_off = (k.unsqueeze(-3) * e_left) @ k_right
    # [..., J, i, j] -> [..., i, (J j)] = [..., C, C]
    qk_off, kk_off = (a.movedim(-3, -2).flatten(-2) for a in (qk_off, kk_off))

    # diagonal blocks: exact pairwise decay, j <= i inside the block
    tril = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
    e_diag = torch.exp(torch.where(tril[..., None], Gb.unsqueeze(-2) - Gb.unsqueeze(-3), -math.inf))  # [..., n, c, c, K]
    qb = q.unflatten(-2, (n, c))
    qk_diag = (qb.unsqueeze(-2) * e_diag * kb.unsqueeze(-3)).sum(-1)  # [..., n, c, c]
    kk_diag = (kb.unsqueeze(-2) * e_diag * kb.unsqueeze(-3)).sum(-1).masked_fill(torch.eye(c, dtype=torch.bool, device=dev), 0.0)
    # place the n diagonal blocks: [..., I, i, j] -> [..., I, i, J, j] * delta(I, J) -> [..., C, C]
    eye = torch.eye(n, device=dev, dtype=G.dtype)[:, None, :, None]  # [n, 1, n, 1]
    qk = qk_off + (qk_diag.unsqueeze(-2) * eye).flatten(-4, -3).flatten(-2)
    kk = kk_off + (kk_diag.unsqueeze(-2) * eye).flatten(-4, -3).flatten(-2)
    return qk, kk


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
    # chunk length: chunk_size, or T rounded up to the sub-block size for short inputs (decode steps)
    C = min(chunk_size, -(-T // SUB_CHUNK) * SUB_CHUNK) if T > 0 else chunk_size
    c = math.gcd(C, SUB_CHUNK)
    pad = (-T) % C
    NT = (T + pad) // C

    q, k, v, g = (_to_chunks(x, pad, NT, C) for x in (q, k, v, g))  # [B, H, NT, C, K|V]
    beta = _to_chunks(beta, pad, NT, C)  # [B, H, NT, C]
    q = q * scale
    G = g.cumsum(-2)  # in-chunk cumulative log decay             [B, H, NT, C, K]

    A_qk, A_kk = _intra_chunk_scores(q, k, G, c)  # [B, H, NT, C, C]
    # WY/UT transform: (I + diag(beta) A_kk) [w | u] = diag(beta) [exp(G) k | v]
    L = beta[..., None] * A_kk  # strictly lower                         [B, H, NT, C, C]
    rhs = beta[..., None] * torch.cat([torch.exp(G) * k, v], -1)  # [B, H, NT, C, K+V]
    wu = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    w, u = wu[..., :K], wu[..., K:]  # [B, H, NT, C, K], [B, H, NT, C, V]

    G_last = G[..., -1:, :]  # decay over the whole chunk        [B, H, NT, 1, K]
    q_dec = q * torch.exp(G)  # q against the chunk-entry state     [B, H, NT, C, K]
    k_dec = (k * torch.exp(G_last - G)).transpose(-1, -2)  # k decayed to chunk end   [B, H, NT, K, C]
    d_last = torch.exp(G_last).transpose(-1, -2)  # [B, H, NT, K, 1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()  # [B, H, K, V]
    outs = []
    for n in range(NT):
        v_new = u[:, :, n] - w[:, :, n] @ S  # corrected values      [B, H, C, V]
        outs.append(q_dec[:, :, n] @ S + A_qk[:, :, n] @ v_new)  # [B, H, C, V]
        S = d_last[:, :, n] * S + k_dec[:, :, n] @ v_new
    o = torch.stack(outs, 2).flatten(2, 3)[:, :, :T].transpose(1, 2)  # [B, T, H, V]
    return o.to(out_dtype), (S if output_final_state else None)


# --------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _fla_chunk_kda():
    """FLA's Triton op, or None when fla is not importable (imported lazily: CPU runs never pay for it)."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # noqa: BLE001 - any import failure means "use the torch path"
        return None
    return chunk_kda


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
    fla_op = _fla_chunk_kda() if q.is_cuda else None
    path = "kda_path.fla" if fla_op is not None else "kda_path.torch"
    if counters is not None:
        counters[path] = counters.get(path, 0) + 1
    if fla_op is not None:
        return fla_op(
            q, k, v, g.float(), beta,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False,
        )
    return chunk_kda_torch(q, k, v, g, beta, initial_state=initial_state,
                           output_final_state=output_final_state, chunk_size=chunk_size)


# --------------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------------
class KDAState(NamedTuple):
    """What a later call needs to continue a sequence."""

    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # q/k/v pre-conv inputs, last W-1 steps, [B, W-1, H*K] each
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

    def _short_conv(self, x: torch.Tensor, conv: nn.Conv1d, cache: torch.Tensor | None):
        """Causal depthwise conv + SiLU. x [B, T, C], cache [B, W-1, C] (previous inputs; zeros at sequence start)."""
        B, T, Ch = x.shape
        W = self.conv_size
        if cache is None:
            cache = x.new_zeros(B, W - 1, Ch)
        xc = torch.cat([cache.to(x.dtype), x], 1)  # [B, W-1+T, C]
        y = conv(xc.transpose(1, 2)).transpose(1, 2)  # valid conv -> [B, T, C]
        return F.silu(y), xc[:, xc.shape[1] - (W - 1):]

    def forward(self, x: torch.Tensor, counters=None, state: KDAState | None = None) -> tuple[torch.Tensor, KDAState]:
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H*K]
        conv_state = None
        if self.conv_size > 0:
            cq, ck, cv = state.conv if state is not None and state.conv is not None else (None, None, None)
            q, cq = self._short_conv(q, self.q_conv1d, cq)
            k, ck = self._short_conv(k, self.k_conv1d, ck)
            v, cv = self._short_conv(v, self.v_conv1d, cv)
            conv_state = (cq, ck, cv)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q, k = l2norm(q.view(B, T, H, K)), l2norm(k.view(B, T, H, K))  # [B, T, H, K]
        v = v.view(B, T, H, K)  # [B, T, H, V]
        f = self.f_proj(x).view(B, T, H, K).float()
        g = -self.A_log.float().exp()[:, None] * F.softplus(f + self.dt_bias.float().view(H, K))  # log decay [B, T, H, K]
        beta = self.b_proj(x).sigmoid()  # [B, T, H]

        o, S = kda(q, k, v, g, beta, initial_state=None if state is None else state.recurrent,
                   output_final_state=True, chunk_size=self.chunk_size, counters=counters)  # [B, T, H, V]
        # gated RMSNorm over head_dim (FLA's FusedRMSNormGated, activation="sigmoid"), in fp32
        gate = self.g_proj(x).view(B, T, H, K).float()
        of = o.float()
        of = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight.float()
        o = (of * torch.sigmoid(gate)).to(x.dtype)
        y = self.o_proj(o.reshape(B, T, H * K))  # [B, T, D]
        return y, KDAState(conv=conv_state, recurrent=S)
