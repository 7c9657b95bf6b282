"""The KDA core and layer as the benchmarks call them: the kernel's inputs as our mixer hands them over, one
fwd+bwd of FLA's chunk_kda (or on CPU the torch core standing in for it), FLA's own layer at our layer's shape,
and our layer with its gates in our compiled region instead of inside the kernel (the stage's layer until run 6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.model.config import ModelConfig
from dormouse.model.kda import KDAMixer, chunk_kda_torch, l2norm


def kda_inputs(cfg: ModelConfig, batch: int, seq_len: int, device: torch.device, seed: int, dtype):
    """Normalised q/k, v, log-space g <= 0 and beta in (0, 1) as our mixer hands them to the kernel, and the
    output's gradient, at (batch, seq_len, cfg.n_heads, cfg.head_dim)."""
    B, T, H, K = batch, seq_len, cfg.n_heads, cfg.head_dim
    g0 = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g0).to(device)

    q = l2norm(rnd(B, T, H, K)).to(dtype).requires_grad_()
    k = l2norm(rnd(B, T, H, K)).to(dtype).requires_grad_()
    v = rnd(B, T, H, K).to(dtype).requires_grad_()
    a = torch.empty(H).uniform_(1, 16, generator=g0).to(device)  # exp(A_log), as FLA's init
    g = (-a[:, None] * F.softplus(rnd(B, T, H, K) * 0.5)).float().requires_grad_()
    beta = torch.sigmoid(rnd(B, T, H)).to(dtype).requires_grad_()
    do = rnd(B, T, H, K).to(dtype)
    return q, k, v, g, beta, do


def kernel_fn(cfg: ModelConfig, batch: int, seq_len: int, device: torch.device, seed: int, torch_standin: bool):
    """(one KDA core fwd+bwd on fresh inputs at this shape, its name): FLA's chunk_kda, or on CPU the torch core
    standing in for it."""
    if torch_standin:
        op, dtype, name = chunk_kda_torch, torch.float32, "dormouse chunk_kda_torch (stand-in: no FLA on CPU)"
    else:
        from fla.ops.kda import chunk_kda as op  # noqa: N813

        dtype, name = torch.bfloat16, ("fla.ops.kda.chunk_kda(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, "
                                       "disable_recompute=True)")  # the raw kernel, saving for backward as training does
    q, k, v, g, beta, do = kda_inputs(cfg, batch, seq_len, device, seed, dtype)
    leaves = (q, k, v, g, beta)

    def fn():
        for t in leaves:
            t.grad = None
        if torch_standin:
            o, _ = op(q, k, v, g, beta, output_final_state=True, chunk_size=cfg.kda_chunk_size)
        else:
            o, _ = op(q, k, v, g, beta, initial_state=None, output_final_state=True,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, disable_recompute=True)
        o.backward(do)

    return fn, name


class TorchGatesMixer(KDAMixer):
    """Our layer with the activations before the core in our compiled `gates` region on CUDA too (the stage's
    layer until run 6), not inside FLA's chunk_kda."""

    def gates_in_kernel(self, q):
        return False


def fla_layer(cfg: ModelConfig, device: torch.device) -> nn.Module:
    """FLA's own KDA layer at our layer's shape."""
    from fla.layers.kda import KimiDeltaAttention

    return KimiDeltaAttention(hidden_size=cfg.d_model, head_dim=cfg.head_dim, num_heads=cfg.n_heads, mode="chunk",
                              use_short_conv=cfg.kda_conv_size > 0, conv_size=cfg.kda_conv_size or 4,
                              norm_eps=cfg.norm_eps, layer_idx=0).to(device)
