"""The byte LM's configuration: every architectural switch a preset can turn (one comment per field)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # bytes
    d_model: int = 128  # residual width
    n_heads: int = 4  # KDA heads
    head_dim: int = 32  # per-head key/value width (FLA: K <= 256)
    kda_chunk_size: int = 64  # chunk length of the chunked KDA (torch path; FLA picks its own)
    kda_conv_size: int = 4  # short causal depthwise conv on q/k/v (as FLA's KDA layer); 0 = off
    ffn_hidden: int = 384  # SwiGLU hidden width (per expert when moe)
    # Layer stack: prelude -> core (weight-shared, iterated n_loop times) -> coda.
    # A plain stack is n_prelude = n_coda = 0, n_loop = 1.
    n_prelude: int = 0
    n_core: int = 4
    n_loop: int = 1
    n_coda: int = 0
    # Dropless top-k mixture of experts in place of the dense FFN (every block).
    moe: bool = False
    n_experts: int = 8
    moe_top_k: int = 2
    # Engram: byte n-gram memory read by the input bytes, gated into the residual.
    engram: bool = False
    engram_orders: tuple[int, ...] = (2, 3, 4)  # bigrams are exact (65 536 rows); higher orders hashed
    engram_rows: int = 65_536  # rows per hashed table
    engram_heads: int = 2  # hash heads per hashed order (distinct odd multipliers / prime moduli)
    engram_dim: int = 64  # width of one table row
    engram_layers: tuple[int, ...] = (0,)  # which stack positions (0-based, prelude..coda) add it
    norm_eps: float = 1e-6
    tie_embeddings: bool = False  # head shares the embedding matrix
    init_std: float = 0.02

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        tuples = {k: tuple(v) for k, v in d.items() if isinstance(v, list)}
        return cls(**{**d, **tuples})

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @property
    def n_blocks(self) -> int:
        """Distinct blocks (parameters); the core counts once however often it loops."""
        return self.n_prelude + self.n_core + self.n_coda

    @property
    def depth(self) -> int:
        """Blocks applied per forward pass."""
        return self.n_prelude + self.n_core * self.n_loop + self.n_coda
