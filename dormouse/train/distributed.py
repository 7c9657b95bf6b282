"""Data parallelism for pretraining under torchrun: who this process is, the process group, and the
few collectives the stage needs. One process (WORLD_SIZE unset or 1) takes none of these paths.

    torchrun --standalone --nproc-per-node 2 -m dormouse.cli pretrain --job "$(dormouse plan --preset tiny --stage pretrain)"

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK. On cuda each process drives cuda:LOCAL_RANK (nccl);
on cpu the processes talk over gloo (what the tests use).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the GPU index on this node (cuda:LOCAL_RANK)

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes checkpoints and the artifact."""
        return self.rank == 0

    def rows(self, n: int) -> range:
        """This rank's contiguous share of n rows (shares differ by at most one row)."""
        return range(self.rank * n // self.size, (self.rank + 1) * n // self.size)


def world_from_env() -> World:
    return World(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def init(world: World, device: torch.device) -> torch.device:
    """Join the process group (world size > 1); returns the device this rank trains on."""
    if world.size == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    assert dist.get_world_size() == world.size and dist.get_rank() == world.rank, "torchrun env and process group disagree"
    return device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: torch.Tensor, world: World) -> list[float]:
    """Element-wise sum of a small 1-D tensor over ranks, as floats on the host (one sync)."""
    if world.size > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values.tolist()


def sum_counters(local: Counter, world: World) -> Counter:
    """The counters of every rank added up (keys with a zero count are kept); identity for one process."""
    if world.size == 1:
        return Counter(local)
    gathered: list[dict] = [{} for _ in range(world.size)]
    dist.all_gather_object(gathered, dict(local))
    total = Counter()
    for part in gathered:
        total.update(part)
    return total


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


class ReplicaMismatchError(RuntimeError):
    pass


@torch.no_grad()
def check_replicas(model: torch.nn.Module, world: World) -> bool:
    """DDP keeps the ranks' weights equal by stepping identical optimizers on identical (all-reduced)
    gradients; it never compares them. This does: a float64 sum per parameter, its min and max over
    ranks, which must be equal. False for one process (nothing to check); a mismatch raises."""
    if world.size == 1:
        return False
    names, sums = zip(*[(n, p.double().sum()) for n, p in model.named_parameters()])
    lo, hi = torch.stack(sums), torch.stack(sums)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    differ = [names[i] for i in (lo != hi).nonzero().flatten().tolist()]
    if differ:
        raise ReplicaMismatchError(f"the ranks hold different weights for {differ[:10]} ({len(differ)} parameters)")
    return True
