"""GPU device slots: two jobs on one box never share a GPU.

Snakemake's `gpu` resource only counts; it sets no CUDA_VISIBLE_DEVICES. A GPU rule therefore runs
its command through `dormouse gpu-run --gpus N -- <command>`, which takes N free device slots under
exclusive file locks, sets CUDA_VISIBLE_DEVICES to them for the command, and frees them when it
exits (the kernel drops flock locks of a killed process, so a crash never leaks a slot).

The pool is, in order: $DORMOUSE_GPUS (e.g. "0,1,2,3"), $CUDA_VISIBLE_DEVICES (SLURM sets it per
job), or the devices `nvidia-smi -L` lists.

    dormouse gpu-run --gpus 1 -- dormouse pretrain --job ...
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


def device_pool() -> list[str]:
    for var in ("DORMOUSE_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = os.environ.get(var)
        if value is not None and value.strip():
            return [d.strip() for d in value.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def lock_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"dormouse-gpu-slots-{os.getuid()}"
    if os.environ.get("SLURM_JOB_ID"):  # SLURM already isolated this job's devices; its "0" is not another job's "0"
        default = default / f"slurm-{os.environ['SLURM_JOB_ID']}"
    path = Path(os.environ.get("DORMOUSE_GPU_LOCK_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def gpu_slots(n: int, poll_s: float = 0.5, timeout_s: float | None = None):
    """Hold n device slots; yields their ids. Waits while fewer than n are free."""
    pool = device_pool()
    if n > len(pool):
        raise RuntimeError(f"{n} GPU(s) requested but the pool has {len(pool)} ({pool}); set DORMOUSE_GPUS or CUDA_VISIBLE_DEVICES")
    held: list[tuple[str, object]] = []
    start = time.monotonic()
    try:
        while True:
            for dev in pool:
                if len(held) == n:
                    break
                if any(dev == d for d, _ in held):
                    continue
                f = open(lock_dir() / f"gpu-{dev}.lock", "a+")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.close()
                    continue
                held.append((dev, f))
            if len(held) == n:
                break
            # Not enough free: release what we hold (no hoarding: avoids deadlock between waiters).
            for _, f in held:
                f.close()
            held.clear()
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"no {n} free GPU slot(s) among {pool} after {timeout_s} s")
            time.sleep(poll_s)
        yield [d for d, _ in held]
    finally:
        for _, f in held:
            f.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse gpu-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- command [args]")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given")
    from dormouse.core.lifeline import die_with_parent  # the command ends when gpu-run does

    if args.gpus == 0:  # a CPU run of a GPU-capable stage: hide every device
        return subprocess.call(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, preexec_fn=die_with_parent)
    with gpu_slots(args.gpus) as devices:
        print(f"[gpu-run] CUDA_VISIBLE_DEVICES={','.join(devices)}", file=sys.stderr, flush=True)
        return subprocess.call(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices)},
                               preexec_fn=die_with_parent)
