"""FLOPs per token for MFU (fwd + bwd, "model FLOPs": no recompute counted): the KDA core's chunked state
(pretrain_h200.py's docstring derives it), softmax attention, and the matmul weights a token multiplies."""

from __future__ import annotations

from torch import nn

FLA_CHUNK = 64  # FLA's chunk length (BT) in chunk_kda


def kda_state_macs_per_token(head_dim: int, chunk: int = FLA_CHUNK) -> float:
    """Forward multiply-adds per token and head of the chunked KDA core (K = V = head_dim)."""
    k = v = head_dim
    c = chunk
    return 3 * k * v + 3 * c * k + 2 * c * v + c * c / 3


def kda_flops_per_token(n_layers: int, n_heads: int, head_dim: int, chunk: int = FLA_CHUNK) -> float:
    """fwd+bwd FLOPs per token of the KDA cores of n_layers layers: 6 * layers * H * MACs."""
    return 6 * n_layers * n_heads * kda_state_macs_per_token(head_dim, chunk)


def attention_flops_per_token(n_layers: int, seq_len: int, d_attn: int) -> float:
    """fwd+bwd FLOPs per token of softmax attention, 12 * L * T * d (full T x T, the usual estimate)."""
    return 12 * n_layers * seq_len * d_attn


def linear_weight_params(model: nn.Module) -> int:
    """numel of every nn.Linear weight (what a token multiplies; embeddings are lookups)."""
    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            n += m.weight.numel()
    return n
