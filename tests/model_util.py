"""Test helpers for model tests: a model whose branches are live, and random byte batches."""

from __future__ import annotations

import torch

from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM


def live_model(cfg: ModelConfig, seed: int = 0, scale: float = 0.05) -> ByteLM:
    """A model whose every branch is live: init_weights zeroes the residual output projections (blocks
    start as the identity), so add noise to every parameter before probing what the blocks do."""
    torch.manual_seed(seed)
    m = ByteLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale)
    return m.eval()


def rand_bytes(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))
