"""Optimizers and the learning-rate schedule of pretraining.

Muon (torch.optim.Muon) for the 2-D weight matrices inside blocks; AdamW for everything else
(embeddings, head, norms, gains, Engram tables, gates). Warmup-stable-decay: linear warmup, flat,
then linear decay to `min_lr_frac` of the peak over the last `decay_frac` of the steps.
"""

from __future__ import annotations

import torch


def wsd_multiplier(step: int, total: int, warmup: int, decay_frac: float, min_lr_frac: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    decay_start = int(total * (1 - decay_frac))
    if step < decay_start or total <= decay_start:
        return 1.0
    progress = (step - decay_start) / max(total - decay_start, 1)
    return 1.0 - (1.0 - min_lr_frac) * min(progress, 1.0)


def build_optimizers(model, train: dict) -> list[torch.optim.Optimizer]:
    hidden, other = model.param_groups()
    ids = [id(p) for p in hidden + other]
    assert len(ids) == len(set(ids)) == len(list(model.parameters())), "every parameter in exactly one optimizer"
    opts = []
    # Fused AdamW on CUDA: one kernel, and it skips a non-finite step from the device (dormouse/firewall.py).
    fused = torch.cuda.is_available() and next(model.parameters()).is_cuda
    if train["optimizer"] == "muon" and not hasattr(torch.optim, "Muon"):
        raise SystemExit(f"optimizer: muon requested but torch {torch.__version__} has no torch.optim.Muon (no silent AdamW fallback)")
    if hidden:
        if train["optimizer"] == "muon":
            opts.append(torch.optim.Muon(hidden, lr=train["muon_lr"], momentum=0.95, nesterov=True,
                                         weight_decay=train["weight_decay"], adjust_lr_fn="match_rms_adamw"))
        else:  # optimizer: adamw for every parameter; hidden matrices keep the configured decay
            opts.append(torch.optim.AdamW(hidden, lr=train["lr"], betas=(0.9, 0.95), weight_decay=train["weight_decay"],
                                          fused=fused))
    opts.append(torch.optim.AdamW(other, lr=train["lr"], betas=(0.9, 0.95), weight_decay=0.0, fused=fused))
    for opt in opts:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return opts


def set_lr(opts: list[torch.optim.Optimizer], multiplier: float) -> None:
    for opt in opts:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
