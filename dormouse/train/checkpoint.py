"""Checkpoints: safetensors weights + JSON snapshot (config, data position, counters, metrics) +
optimizer state (torch.save, loaded with weights_only=True). Nothing else is ever unpickled.

A checkpoint is a directory `step-NNNNNNNN/`, written as `.tmp`, its files and folders fsynced, and renamed, so a
kill mid-save leaves the previous checkpoint as the latest, and a machine that loses power after the rename does not
keep a name whose files never reached the disk. The last `keep` (2) are kept: a resume that cannot read the newest
falls back to the one before (dormouse.train.trainer.resume, counted).

Data-parallel pretraining: rank 0 saves (every rank holds the same weights and optimizer state) and
every rank loads the latest at start. Nothing in a checkpoint depends on the world size (the data
position and the counters are global), so any world size resumes it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS, SNAPSHOT, OPTIM = "model.safetensors", "snapshot.json", "optim.pt"


class CheckpointError(RuntimeError):
    pass


def save(root: Path, step: int, model, opts, snapshot: dict, keep: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp / WEIGHTS))
    torch.save([opt.state_dict() for opt in opts], tmp / OPTIM)
    (tmp / SNAPSHOT).write_text(json.dumps({**snapshot, "step": step}, indent=1))
    for name in (WEIGHTS, OPTIM, SNAPSHOT, "."):
        _fsync(tmp / name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(root)  # the rename itself
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete(root: Path | None) -> list[Path]:
    """The checkpoints under root with their snapshot written, newest first."""
    if root is None or not root.exists():
        return []
    return sorted((p for p in root.glob("step-*") if (p / SNAPSHOT).exists()), reverse=True)


def latest(root: Path) -> Path | None:
    done = complete(root)
    return done[0] if done else None


def load_weights(model, path: Path, source: str | None = None) -> None:
    """Strict: unknown or missing keys (or shape mismatches) fail with the keys listed."""
    state = load_file(str(path))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unknown = sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    if missing or unknown or shapes:
        raise CheckpointError(
            f"{source or path}: weights do not fit the model: missing {missing}, unknown {unknown}, "
            f"shape mismatch {[(k, tuple(state[k].shape), tuple(own[k].shape)) for k in shapes]}"
        )
    model.load_state_dict(state, strict=True)


def load_optimizers(opts, path: Path) -> None:
    states = torch.load(path, weights_only=True)
    if len(states) != len(opts):
        raise CheckpointError(f"{path}: {len(states)} optimizer states for {len(opts)} optimizers")
    for opt, st in zip(opts, states):
        opt.load_state_dict(st)


def load_snapshot(path: Path) -> dict:
    return json.loads((path / SNAPSHOT).read_text())
