"""One pretrain step and one resume: what the pretrain stage runs and what every benchmark times, defined once so
that a benchmark cannot drift from the stage.

The learning rate stays the caller's (the stage's schedule runs on steps, quality_h200's on a clock); the data
too. With train.micro_batch_size the step's rows run as micro-batches whose gradients add up before one optimizer
step (gradient accumulation: the same recipe on a card that cannot hold the whole batch, or more tokens per step).
The step is the forward (replayed from CUDA graphs where `train.cuda_graphs` decides so, else under autocast
through `net`, DDP's wrapper under torchrun), the MoE balancing loss, and the NaN firewall's backward, clip and
guarded optimizer steps (dormouse/train/firewall.py).

A quantization-aware finish sets `qat` (a dormouse.train.qat.FakeQuant): the forward then runs inside its
`applied()` context, seeing the rung's weights. A captured graph replays the plain weights' forward, so such a step
runs eagerly instead, counted in `eager_steps_qat` (the caller files it in the manifest).
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from dormouse.model.config import ModelConfig
from dormouse.train import checkpoint, cuda_graphs, distributed, qat
from dormouse.train.firewall import Firewall
from dormouse.train.runtime import autocast, with_moe_aux
from dormouse.train.settings import TrainSettings


ONE_PROCESS = distributed.World()  # the default world: rank 0 of 1 (frozen, so one shared instance)


class PretrainStep:
    def __init__(self, model: torch.nn.Module, opts: list, cfg: ModelConfig, train: TrainSettings, device: torch.device,
                 world: distributed.World = ONE_PROCESS, net: torch.nn.Module | None = None,
                 graphs: str | None = None, firewall_on_device: bool | None = None):
        self.model, self.cfg, self.train, self.device = model, cfg, train, device
        self.net = model if net is None else net  # what the forward calls (and the graphs capture)
        self.graphs = cuda_graphs.decide(train.cuda_graphs, device.type, cfg, world.size) if graphs is None else graphs
        on_device = device.type == "cuda" if firewall_on_device is None else firewall_on_device
        self.firewall = Firewall(opts, model.parameters(), train.grad_clip, train.max_bad_steps, world,
                                 on_device=on_device)
        self.graphed: cuda_graphs.GraphedLoss | None = None
        self.qat: qat.FakeQuant | None = None  # set for the steps of a quantization-aware finish
        self.eager_steps_qat = 0  # graphed steps run eagerly because the finish was on

    def capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Capture the graphs now (a benchmark does it off its clock; a capture changes no weight); otherwise the
        first graphed step does. The balancing term is captured with the forward: a replay trains as eager does. A whole
        batch is captured at its micro-batch's shape (train.micro_batch_size)."""
        n = x.shape[0] // self.parts(x.shape[0])
        self.graphed = cuda_graphs.GraphedLoss(self.net, x[:n], y[:n], self.train.dtype, total_of=self.total_of)

    def total_of(self, loss: torch.Tensor) -> torch.Tensor:
        return with_moe_aux(loss, self.model, self.cfg, self.train.moe_aux_coef)

    def forward(self, x: torch.Tensor, y: torch.Tensor, counters: Counter) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, total): the language-model loss to log and what backward takes (plus an MoE's balancing term)."""
        if self.graphs == "graphed" and self.qat is None:
            if self.graphed is None:
                self.capture(x, y)
            return self.graphed(x, y, counters)
        with qat.through(self.qat), autocast(self.device, self.train.dtype):
            _, loss = self.net(x, y, counters=counters)
            return loss, self.total_of(loss)

    def parts(self, rows: int) -> int:
        """How many micro-batches this rank's `rows` run as (train.micro_batch_size; 1 when null or not smaller)."""
        micro = self.train.micro_batch_size
        if not micro or micro >= rows:
            return 1
        if rows % micro:
            raise ValueError(f"train.micro_batch_size {micro} does not divide this rank's {rows} rows of the batch")
        return rows // micro

    def __call__(self, x: torch.Tensor, y: torch.Tensor, counters: Counter, where: str) -> torch.Tensor:
        """One optimizer step on this rank's rows; with train.micro_batch_size, as micro-batches whose gradients add
        up first (DDP all-reduces once, on the last). Returns the step's loss (the micro-batches' mean)."""
        parts = self.parts(x.shape[0])
        if self.graphs == "graphed" and self.qat is not None:
            self.eager_steps_qat += 1
        if parts == 1:
            loss, total = self.forward(x, y, counters)
            self.firewall.step(loss, total, where)
            return loss
        keep = self.graphs == "graphed" and self.qat is None
        if keep:  # gradients summed into buffers of their own, never into a graph's (Firewall.finish)
            for p in self.model.parameters():
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
        mean = 0.0
        for i, (xi, yi) in enumerate(zip(x.split(x.shape[0] // parts), y.split(y.shape[0] // parts))):
            last = i == parts - 1
            with nullcontext() if last or not isinstance(self.net, DistributedDataParallel) else self.net.no_sync():
                loss, total = self.forward(xi, yi, counters)
                self.firewall.backward(loss, total, parts)
            mean = mean + loss.detach() / parts
        counters["micro_batches"] += parts
        self.firewall.finish(where, keep_grads=keep)
        return mean

    @property
    def replays(self) -> int:
        return self.graphed.replays if self.graphed is not None else 0


def resume(root: Path | None, model: torch.nn.Module, opts: list, counters: Counter | None = None
           ) -> tuple[Path, dict] | tuple[None, None]:
    """Load the latest readable checkpoint under `root` into the model and optimizers: (its path, its snapshot, which
    holds the caller's own state: data position, metrics, counters), or (None, None) when there is none. One that
    cannot be read (files a crash left short) is passed over for the one before, named and counted
    (`checkpoints_unreadable`); when none can be read, the error says so, never a silent fresh start."""
    errors = []
    for path in checkpoint.complete(root):
        try:
            snap = checkpoint.load_snapshot(path)
            checkpoint.load_weights(model, path / checkpoint.WEIGHTS)
            checkpoint.load_optimizers(opts, path / checkpoint.OPTIM)
        except checkpoint.CheckpointError:
            raise  # a checkpoint of another model: not damage, and an older one would not fit either
        except Exception as e:  # noqa: BLE001 - safetensors, torch.load and json each raise their own
            errors.append(f"{path.name}: {type(e).__name__}: {e}")
            print(f"[resume] WARNING: cannot read {path} ({type(e).__name__}: {e}); trying the one before", flush=True)
            if counters is not None:
                counters["checkpoints_unreadable"] += 1
            continue
        return path, snap
    if errors:
        raise checkpoint.CheckpointError(f"{root}: no checkpoint could be read ({'; '.join(errors)}); "
                                         "remove them to start over")
    return None, None
