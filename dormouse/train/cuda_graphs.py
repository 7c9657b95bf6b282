"""The training forward and backward as CUDA graphs (torch.cuda.make_graphed_callables), FLA's Triton
kernels included. A small model's eager step is host-bound: on the H200 the small preset's step took 88 ms
of wall time for ~26 ms of GPU work, ~1 000 launches; one replay each way took 28 ms (1.17M against 372k
tokens/s, benchmarks/records/2026-12-04-throughput-h200-run4). Optimizers, clip and the NaN firewall stay eager after it.

Refused (the caller counts the reason) where a graph cannot hold the step: several ranks run DDP's gradient
hooks inside backward. Not asked off CUDA. An MoE is graphed: its routing has fixed shapes and no host sync.

A replay runs no Python, so the model's counters (which arms ran, on how many tokens) are taken at
capture: the capture's counts divided by its forward calls are added on every replay. The MoE's routing
differs step to step: each replay adds it to the model's device tally (`ByteLM.defer_routing`, set here),
which the training loop reads with `take_routing` at its log steps; the capture's own routing is dropped.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from dormouse.model.config import ModelConfig
from dormouse.train.runtime import autocast

WARMUP_CALLS = 3  # make_graphed_callables' warm-up iterations (on a side stream) before its one capture


def refusal(world_size: int) -> str | None:
    """Why this run's step cannot be graphed (a counter key), or None."""
    if world_size > 1:
        return "ddp"
    return None


def decide(mode: str, device_type: str, cfg: ModelConfig, world_size: int) -> str:
    """One of "graphed", "eager" (not asked: train.cuda_graphs `mode` never, or no GPU) and "refused_<why>" (asked,
    not possible here)."""
    if mode != "cuda" or device_type != "cuda":
        return "eager"
    why = refusal(world_size)
    return f"refused_{why}" if why else "graphed"


def per_call(capture: Counter, calls: int) -> Counter:
    """The counts of one forward call from a capture's `calls` calls; uneven counts are an error, since a
    replay's counts would then be unknown."""
    uneven = {k: v for k, v in capture.items() if v % calls}
    if uneven:
        raise RuntimeError(f"cuda_graphs: counters {uneven} are not the same on each of the capture's {calls} "
                           "forward calls, so a replay's counts are unknown")
    return Counter({k: v // calls for k, v in capture.items()})


class _Loss(nn.Module):
    """The training loss as one module (make_graphed_callables graphs a module's forward and backward): its output
    is [loss, total], total being what the step backpropagates (the loss plus an MoE's balancing term)."""

    def __init__(self, model: nn.Module, dtype: str, counters: Counter, total_of):
        super().__init__()
        self.model, self.dtype, self.counters, self.total_of = model, dtype, counters, total_of

    def forward(self, x, y):
        # a graph must not keep autocast's cached weight casts: they would go stale after an optimizer step
        with autocast(x.device, self.dtype, cache=False):
            loss = self.model(x, y, counters=self.counters)[1]
            return torch.stack([loss, self.total_of(loss)])


class GraphedLoss:
    """loss, total = graphed(x, y, counters): a replay of the captured forward; total.backward() replays the
    backward. `total_of(loss)` is captured with the forward (dormouse.train.trainer passes the MoE balancing term;
    default: the loss itself)."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: str, total_of=None):
        model.defer_routing = True  # a replay cannot read the routing on the host: it stays in the device tally
        capture = Counter()
        # its own input buffers: a later batch is copied into them, never into the caller's tensors
        self.fn = torch.cuda.make_graphed_callables(_Loss(model, dtype, capture, total_of or (lambda loss: loss)),
                                                    (x.clone(), y.clone()),
                                                    num_warmup_iters=WARMUP_CALLS)
        self.per_call = per_call(capture, WARMUP_CALLS + 1)
        model.take_routing(None)  # the warm-up and capture forwards are no training steps
        self.shape = tuple(x.shape)
        self.replays = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor, counters: Counter) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(x.shape) != self.shape or tuple(y.shape) != self.shape:
            # copy_ into the graph's input buffers would broadcast a smaller batch without a word
            raise ValueError(f"cuda_graphs: batch {tuple(x.shape)}/{tuple(y.shape)} is not the captured {self.shape}")
        out = self.fn(x, y).clone()  # the graph's output buffer is overwritten by the next replay
        counters.update(self.per_call)
        self.replays += 1
        return out[0], out[1]
