"""The pretrain stage's step as the benchmarks time it: a preset's model and shape (tiny shapes for a CPU dry run),
random byte batches, the stage's own step (dormouse.train.trainer.PretrainStep) and the same step for a peer model."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from dormouse.core.config import load_preset
from dormouse.model.config import ModelConfig
from dormouse.train import distributed
from dormouse.train.optim import StackedMuon, set_lr, wsd_multiplier
from dormouse.train.runtime import autocast
from dormouse.train.trainer import PretrainStep
from dormouse.train.settings import TrainSettings

ROOT = Path(__file__).resolve().parent.parent
ONE_PROCESS = distributed.World()  # one process on one GPU (the loop's world size 1)
DRY_MODEL = {"d_model": 64, "n_heads": 2, "head_dim": 32, "ffn_hidden": 128, "n_prelude": 0, "n_core": 2,
             "n_loop": 1, "n_coda": 0, "kda_chunk_size": 32}


def preset_setup(name: str, dry: bool, batch_size: int | None = None, seq_len: int | None = None,
                 micro_batch_size: int | None = None):
    """(cfg, train, batch, seq_len) of a preset; `name:{json}` overrides model fields (a control:
    'b1:{"moe": false}'). dry: DRY_MODEL's tiny shapes on the CPU, B 2, T 64. batch_size / seq_len override the
    preset's; micro_batch_size sets train.micro_batch_size (the stage's gradient accumulation)."""
    base, _, override = name.partition(":")
    p = load_preset(base, root=ROOT)
    cfg = ModelConfig.from_dict({**p["model"], **json.loads(override or "{}")})
    train = dict(p["train"])
    batch, seq = train["batch_size"], train["seq_len"]
    if dry:
        cfg = replace(cfg, **DRY_MODEL, engram_rows=min(cfg.engram_rows, 1024), engram_dim=min(cfg.engram_dim, 16),
                      engram_layers=(0,))
        batch, seq = 2, 64
        train["device"] = "cpu"
    if micro_batch_size:
        train["micro_batch_size"] = micro_batch_size
    return cfg, train, batch_size or batch, seq_len or seq


def random_batches(batch: int, seq_len: int, device: torch.device, seed: int, n: int = 4):
    """n batches of random bytes (x, y = next byte), made on the CPU with a fixed seed, kept on the device."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, 256, (batch, seq_len + 1), generator=g, dtype=torch.long)
        out.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
    return out


def muon_of(name: str):
    """--muon's class: the stages' StackedMuon or torch.optim.Muon (the same math, one matrix at a time)."""
    return StackedMuon if name == "stacked" else torch.optim.Muon


def ours_step(model, opts, cfg: ModelConfig, train: dict, device, batches, counters: Counter,
              firewall: bool = True, firewall_on_device: bool | None = None, graphed: bool = False,
              net: nn.Module | None = None, world: distributed.World = ONE_PROCESS):
    """One step of the pretrain stage's loop: dormouse.train.trainer.PretrainStep, the stage's own (its firewall,
    deciding on the device on CUDA as the stage does; graphed: the forward and backward replayed from CUDA graphs,
    captured here off the clock, as the stage runs them under train.cuda_graphs: cuda; net: DDP's wrapper under
    torchrun, with its world). firewall=False is the benchmarks' control: the same forward, then a plain
    backward, clip and optimizer steps. Returns the step's loss."""
    ps = PretrainStep(model, opts, cfg, TrainSettings.of(train), device, world, net, graphs="graphed" if graphed else "eager",
                      firewall_on_device=firewall_on_device)
    if graphed:
        ps.capture(*batches[0])
    params = list(model.parameters())
    state = {"i": 0}

    def step():
        i = state["i"]
        state["i"] += 1
        torch.compiler.cudagraph_mark_step_begin()  # --compile-mode reduce-overhead: a new step's graphs
        set_lr(opts, wsd_multiplier(i, train["steps"], train["warmup_steps"], train["decay_frac"], train["min_lr_frac"]))
        x, y = batches[i % len(batches)]
        if firewall:
            return ps(x, y, counters, f"step {i}")
        loss, total = ps.forward(x, y, counters)
        return backward_and_step(loss, total, params, opts, train["grad_clip"])

    return step


def backward_and_step(loss, total, params, opts, grad_clip: float):
    """The plain step without the firewall: backward of `total`, clip, every optimizer's step, zero_grad; `loss` back."""
    total.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    for opt in opts:
        opt.step()
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    return loss


def peer_step(loss_fn, model, opts, train: dict, device, batches):
    """The same step for a peer model: set_lr, autocast forward, backward, clip, optimizer steps, zero_grad."""
    params = list(model.parameters())
    state = {"i": 0}

    def step():
        i = state["i"]
        state["i"] += 1
        set_lr(opts, wsd_multiplier(i, train["steps"], train["warmup_steps"], train["decay_frac"], train["min_lr_frac"]))
        x, y = batches[i % len(batches)]
        with autocast(device, train["dtype"]):
            loss = loss_fn(x, y)
        return backward_and_step(loss, loss, params, opts, train["grad_clip"])

    return step
