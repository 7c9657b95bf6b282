"""Data-parallel pretrain throughput: the stage's step at 1 and N GPUs (issue #8 item 4).

    # on a lent nvidia-h200-x2 (after `source benchmarks/gpu_env.sh`):
    python3 -m benchmarks.ddp_h200 --presets small medium --gpus 1 2 --out $OUT/ddp_h200.tsv
    # here, on CPU (gloo, tiny shapes; what tests/test_ddp_bench.py runs):
    .venv/bin/python -m benchmarks.ddp_h200 --dry-run-cpu --gpus 1 2

The driver launches, for each preset and each GPU count W, `torchrun --standalone --nproc-per-node W` on
this module in worker mode; each worker runs the pretrain stage's step (benchmarks/pretrain_step.py's
`ours_step`: set_lr, bf16 autocast, the stage's Firewall deciding on the device, both optimizer steps) on
the model as the stage builds it (ByteLM, build_optimizers, compile_for's regions, then
DistributedDataParallel when W > 1), on random bytes. As in the stage, the global batch stays the
preset's train.batch_size rows (--global-batch overrides it) and each rank takes its contiguous slice
(World.rows), so W GPUs split the same work: strong scaling.

Systems per W:
  compiled  the step with the regions compiled and no CUDA graphs: at W = 1 the baseline of the scaling
            efficiency, at W > 1 under DDP (the stage refuses CUDA graphs under DDP: cuda_graphs.refusal)
  graphed   W = 1 only: forward and backward replayed from CUDA graphs, the stage's default on one GPU

efficiency = tokens/s at W / (W x tokens/s of `compiled` at 1): 1.0 is perfect scaling. vs_graphed =
tokens/s at W / tokens/s of `graphed` at 1: what a second GPU buys over the stage's one-GPU default.
tokens/s counts the global batch (every rank's rows) over rank 0's wall time: DDP's all-reduce keeps the
ranks in step. Timing as benchmarks/timing.py's `measure` (warm-up, then timed steps between synchronises);
peak memory is rank 0's. NVLink multicast stays off (the device tool's rule): NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 in every worker's environment.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from benchmarks.bench_env import rerun_command
from benchmarks.flops import kda_flops_per_token
from benchmarks.pretrain_step import ours_step, preset_setup, random_batches
from benchmarks.report import TsvWriter, device_name, versions
from benchmarks.timing import matmul_rate, measure
from dormouse.model.gpt import ByteLM, count_params  # noqa: E402
from dormouse.train import distributed  # noqa: E402
from dormouse.train.optim import build_optimizers  # noqa: E402
from dormouse.train.runtime import compile_for, deterministic_cpu  # noqa: E402
from dormouse.train.settings import OptimSettings

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "ddp_h200.tsv"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLUMNS = ["date", "device", "versions", "command", "preset", "gpus", "system", "status", "global_batch",
           "rows_per_rank", "seq_len", "steps", "warmup", "warmup_s", "ms_step", "ms_step_median", "tokens_per_s",
           "peak_gib", "mfu_pct", "matmul_tflops", "efficiency", "vs_graphed", "note"]


def log(msg: str) -> None:
    print(f"[ddp_h200] {msg}", flush=True)


# -------------------------------------------------------------------------------------------------
# Worker: one preset at one world size, under torchrun
# -------------------------------------------------------------------------------------------------
def worker(args) -> int:
    world = distributed.world_from_env()
    dry = args.dry_run_cpu
    cfg, train, batch, seq_len = preset_setup(args.presets[0], dry)
    global_batch = args.global_batch or batch
    if global_batch % world.size:
        raise SystemExit(f"ddp_h200: global batch {global_batch} is not a multiple of the world size {world.size}")
    device = distributed.init(world, torch.device("cpu" if dry else "cuda"))
    deterministic_cpu(device)
    rows = world.rows(global_batch)
    # every rank draws the same global batches and keeps its rows: the data does not depend on W
    batches = [(x[rows.start:rows.stop], y[rows.start:rows.stop])
               for x, y in random_batches(global_batch, seq_len, device, args.seed)]
    rate, _ = matmul_rate(device) if world.is_main else (0.0, "")
    cp = count_params(cfg)
    flops_per_token = 6 * cp["flop_params"] + kda_flops_per_token(cfg.depth, cfg.n_heads, cfg.head_dim)
    systems = ["compiled"] + (["graphed"] if world.size == 1 and device.type == "cuda" else [])
    results = []
    t_start = time.perf_counter()
    for system in systems:
        torch.manual_seed(args.seed)
        model = ByteLM(cfg).to(device).train()
        opts = build_optimizers(model, OptimSettings.of(train))
        regions = compile_for(model, device, train["compile"])
        net = model if world.size == 1 else DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        counters = Counter()
        step = ours_step(model, opts, cfg, train, device, batches, counters, graphed=system == "graphed", net=net,
                            world=world)
        r = measure(step, args.steps, args.warmup, device)
        tps = global_batch * seq_len / (r["ms_step"] / 1e3)
        results.append({
            "system": system, "status": "ok", "global_batch": global_batch, "rows_per_rank": len(rows),
            "seq_len": seq_len, "steps": args.steps, "warmup": args.warmup, "warmup_s": round(r["warmup_s"], 2),
            "ms_step": round(r["ms_step"], 3), "ms_step_median": round(r["ms_step_median"], 3),
            "tokens_per_s": round(tps),
            "peak_gib": None if r["peak_gib"] is None or system == "graphed" else round(r["peak_gib"], 3),
            "mfu_pct": round(100 * tps * flops_per_token / (world.size * rate), 2) if rate else None,
            "matmul_tflops": round(rate / 1e12, 1) if rate else None,
            "note": f"{len(regions)} regions compiled; {'DDP, ' if world.size > 1 else ''}"
                    f"{'fwd+bwd as CUDA graphs, ' if system == 'graphed' else ''}loss at end {r['last_loss']}; "
                    f"{flops_per_token:.4g} FLOP/token",
        })
        del model, opts, net, step
        distributed.barrier(world)
        if world.is_main:  # each system's row as soon as it is measured: a killed launch keeps what it finished
            Path(args.result).write_text(json.dumps(results))
            log(f"result {json.dumps(results[-1])} ({time.perf_counter() - t_start:.0f} s since the model was built)")
    distributed.shutdown()
    return 0


# -------------------------------------------------------------------------------------------------
# Driver
# -------------------------------------------------------------------------------------------------
def launch(args, preset: str, gpus: int, result: Path) -> int:
    """One torchrun of the worker; its output goes straight to ours."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "--module", "benchmarks.ddp_h200", "--worker", "--result", str(result), "--presets", preset, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seed", str(args.seed)]
    cmd += ["--global-batch", str(args.global_batch)] if args.global_batch else []
    cmd += ["--dry-run-cpu"] if args.dry_run_cpu else []
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.dry_run_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    log(f"{preset} at {gpus} GPU{'s' if gpus > 1 else ''}: {shlex.join(cmd)}")
    return subprocess.run(cmd, env=env, timeout=args.launch_timeout_s).returncode


def add_scaling(rows: list[dict]) -> None:
    """efficiency and vs_graphed of every row, against the same preset's one-GPU rows."""
    for r in rows:
        base = {b["system"]: b["tokens_per_s"] for b in rows
                if b["preset"] == r["preset"] and b["gpus"] == 1 and b["status"] == "ok"}
        if r["status"] != "ok":
            continue
        if "compiled" in base and r["system"] == "compiled":
            r["efficiency"] = round(r["tokens_per_s"] / (r["gpus"] * base["compiled"]), 3)
        if "graphed" in base:
            r["vs_graphed"] = round(r["tokens_per_s"] / base["graphed"], 3)


def table(rows: list[dict]) -> str:
    cols = [("preset", "preset"), ("GPUs", "gpus"), ("system", "system"), ("status", "status"),
            ("rows/rank", "rows_per_rank"), ("tok/s", "tokens_per_s"), ("ms/step", "ms_step"), ("MFU %", "mfu_pct"),
            ("efficiency", "efficiency"), ("vs graphed", "vs_graphed")]

    def cell(r, k):
        v = r.get(k)
        if v is None or v == "":
            return "n/a"
        if k == "tokens_per_s":
            return f"{v:,}"
        return str(v)[:40]

    body = [[h for h, _ in cols]] + [[cell(r, k) for _, k in cols] for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def driver(args) -> int:
    command = rerun_command("benchmarks.ddp_h200")
    device = torch.device("cpu") if args.dry_run_cpu else torch.device("cuda")
    if device.type == "cuda":
        have = torch.cuda.device_count()
        if max(args.gpus) > have:
            raise SystemExit(f"ddp_h200: --gpus {max(args.gpus)} asked, {have} visible")
    base = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device_name(device),
            "versions": versions(), "command": command}
    writer = TsvWriter(args.out, COLUMNS)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for gpus in sorted(args.gpus):  # one GPU first: the later rows' scaling columns need its rows
                result = Path(tmp) / f"{preset}_{gpus}.json"
                t0 = time.perf_counter()
                rc = launch(args, preset, gpus, result)
                got = json.loads(result.read_text()) if result.exists() else []  # a failed launch keeps what it finished
                if rc != 0:
                    got.append({"system": "(launch)", "status": f"failed: torchrun exit {rc}"})
                new = [{**base, "preset": preset, "gpus": gpus, **r} for r in got]
                rows += new
                add_scaling(rows)
                for r in new:  # as each launch ends: a budget cut keeps the finished rows
                    writer.write(r)
                log(f"{preset} at {gpus}: {len(new)} rows appended to {writer.path} ({time.perf_counter() - t0:.0f} s)")
    print(table(rows), flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="See the module docstring.")
    ap.add_argument("--presets", nargs="+", default=["small", "medium"])
    ap.add_argument("--gpus", nargs="+", type=int, default=[1, 2], help="world sizes (processes; CPU: gloo)")
    ap.add_argument("--global-batch", type=int, default=None, help="rows a step over all ranks (default: the preset's)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 30; dry run 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; dry run 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help=f"TSV to append to (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument("--launch-timeout-s", type=float, default=600.0, help="limit on one torchrun")
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on CPU over gloo (a test of the script)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dry = args.dry_run_cpu
    args.steps = args.steps or (2 if dry else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 10)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "ddp_h200.dry.tsv" if dry else DEFAULT_OUT
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
