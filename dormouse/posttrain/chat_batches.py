"""SFT's training batches: chat examples (dormouse/data/chat.py's template) as right-padded input and target
tensors, scored on the assistant's bytes only."""

from __future__ import annotations

import torch

from dormouse.data import chat
from dormouse.train.runtime import pad_width


def sft_batch(items, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(inputs, targets, assistant bytes): right-padded rows; a target is -1 except where it is an
    assistant byte (padding comes after every scored position of a causal model, so it changes nothing)."""
    rows = [chat.sft_example(it.prompt, it.answer) for it in items]
    width = pad_width(max(len(b) for b, _ in rows) - 1, device)
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, (b, mask) in enumerate(rows):
        t = torch.tensor(list(b), dtype=torch.long)
        x[i, : len(b) - 1] = t[:-1]
        keep = torch.tensor(mask[1:], dtype=torch.bool)
        y[i, : len(b) - 1] = torch.where(keep, t[1:], -1)
    return x.to(device), y.to(device), int((y >= 0).sum())
