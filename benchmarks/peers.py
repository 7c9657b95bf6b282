"""The models ours is raced against, at ours' shape: (c) a plain byte Transformer with causal SDPA attention and
RoPE whose non-embedding parameters match ours (`sdpa_layout`), and (b) FLA's own KDAForCausalLM; both given
ByteLM's optimizer split (`attach_param_groups`: Muon for the blocks' 2-D Linear weights, AdamW for the rest)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.model.config import ModelConfig
from dormouse.model.ffn import SwiGLU
from dormouse.model.gpt import count_params


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x [B, T, H, hd] (half-split form), cos/sin [T, hd/2]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


class SDPABlock(nn.Module):
    def __init__(self, d: int, n_heads: int, head_dim: int, ffn_hidden: int, eps: float):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.attn_norm = nn.RMSNorm(d, eps=eps)
        self.qkv = nn.Linear(d, 3 * n_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d, bias=False)
        self.ffn_norm = nn.RMSNorm(d, eps=eps)
        self.ffn = SwiGLU(d, ffn_hidden)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        return x + self.ffn(self.ffn_norm(x))


class SDPATransformer(nn.Module):
    """byte embedding -> n_layers x (RMSNorm, causal SDPA + RoPE, RMSNorm, SwiGLU) -> RMSNorm -> fp32 head."""

    def __init__(self, vocab: int, d: int, n_layers: int, n_heads: int, head_dim: int, ffn_hidden: int,
                 eps: float = 1e-6, init_std: float = 0.02, rope_base: float = 10000.0):
        super().__init__()
        self.head_dim, self.rope_base = head_dim, rope_base
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(SDPABlock(d, n_heads, head_dim, ffn_hidden, eps) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d, eps=eps)
        self.head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.device.type != "meta":
                    nn.init.normal_(m.weight, std=init_std)
            for b in self.blocks:
                if b.o_proj.weight.device.type != "meta":
                    nn.init.zeros_(b.o_proj.weight)
                    nn.init.zeros_(b.ffn.w_down.weight)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        inv = 1.0 / self.rope_base ** (torch.arange(0, self.head_dim, 2, device=idx.device, dtype=torch.float32)
                                       / self.head_dim)
        ang = torch.arange(T, device=idx.device, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = ang.cos(), ang.sin()
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x, cos, sin)
        x = self.norm(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.head.weight.float())
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
        return logits, loss


def sdpa_layout(cfg: ModelConfig) -> dict:
    """(c)'s shape: ours' width, applied depth and head layout; the SwiGLU width (a multiple of 64) that brings
    its non-embedding parameters closest to count_params(cfg)['non_embedding']."""
    d, L, hk = cfg.d_model, cfg.depth, cfg.n_heads * cfg.head_dim
    target = count_params(cfg)["non_embedding"]
    fixed = 4 * d * hk + 2 * d  # qkv + o, two norms
    ideal = ((target - d) / L - fixed) / (3 * d)
    ffn = max(64, int(round(ideal / 64)) * 64)
    return {"d": d, "n_layers": L, "n_heads": cfg.n_heads, "head_dim": cfg.head_dim, "ffn_hidden": ffn,
            "non_embedding": L * (fixed + 3 * d * ffn) + d, "target": target}


def build_sdpa(cfg: ModelConfig) -> SDPATransformer:
    lay = sdpa_layout(cfg)
    return SDPATransformer(cfg.vocab_size, lay["d"], lay["n_layers"], lay["n_heads"], lay["head_dim"],
                           lay["ffn_hidden"], eps=cfg.norm_eps, init_std=cfg.init_std)


def attach_param_groups(model: nn.Module, block_lists: list[nn.ModuleList]) -> None:
    """model.param_groups() -> (hidden, other) as ByteLM's: hidden = the 2-D weights of the nn.Linear
    layers inside the blocks (Muon); other = everything else (embeddings, head, norms, biases, convs, A_log,
    dt_bias: AdamW)."""
    hidden_ids = set()
    for blocks in block_lists:
        for m in blocks.modules():
            if isinstance(m, nn.Linear) and m.weight.dim() == 2:
                hidden_ids.add(id(m.weight))
    params = list(model.parameters())
    hidden = [p for p in params if id(p) in hidden_ids]
    other = [p for p in params if id(p) not in hidden_ids]
    object.__setattr__(model, "param_groups", lambda: (hidden, other))


def fla_config(cfg: ModelConfig):
    from fla.models import KDAConfig

    return KDAConfig(hidden_size=cfg.d_model, num_hidden_layers=cfg.depth, num_heads=cfg.n_heads,
                     head_dim=cfg.head_dim, expand_v=1.0, intermediate_size=cfg.ffn_hidden,
                     vocab_size=cfg.vocab_size, conv_size=cfg.kda_conv_size or 4,
                     use_short_conv=cfg.kda_conv_size > 0, norm_eps=cfg.norm_eps,
                     initializer_range=cfg.init_std, tie_word_embeddings=False, use_cache=False)


def build_fla(cfg: ModelConfig):
    from fla.models import KDAForCausalLM

    model = KDAForCausalLM(fla_config(cfg))
    attach_param_groups(model, [model.model.layers])
    return model
