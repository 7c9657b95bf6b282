"""The host path's ceiling of `dormouse serve` (issue #42): the server over the smallest ByteLM there is (one layer,
width 16: a decode step of 64 rows costs ~0.6 ms on the dev VM's CPU, so what is measured is everything else — the
batcher's per-row work, the hand-over to the event loop, SSE, HTTP), N concurrent streams, the same requests twice in
one run: the clients in a process of their own (as serve_bench's timed load), then in the server's process (how
serve_bench measured before: the clients' Python shares the server's GIL). Prints both rows and their ratio.

    .venv/bin/python -m benchmarks.serve_host_path --concurrency 64 --requests 256 --max-tokens 256
    .venv/bin/python -m benchmarks.serve_host_path --decode-steps   # the graphed step (eager on the CPU), clients in
        # their own process, a host read a step (graphed_k1) against --decode-steps' default (graphed): issue #57

On a GPU box the graphed step (one CUDA graph replay a byte) leaves the host path as the ceiling the same way; a
target of 50 000 bytes/s at 64 streams is ~1.3 ms a step for all of it.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time

import torch

from benchmarks.bench_env import git_rev
from benchmarks.serve_load import Deadline, load, load_elsewhere, prompts_for, start_clients, start_server
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM

FLOOR = ModelConfig(d_model=16, n_heads=1, head_dim=16, ffn_hidden=32, n_core=1)


def step_ms(model, rows: int, n: int = 200) -> float:
    """The model's own decode step, alone: what the host path is compared with."""
    with torch.inference_mode():
        x = torch.zeros(rows, dtype=torch.long)
        _, st = model.step(x, None)
        t = time.perf_counter()
        for _ in range(n):
            _, st = model.step(x, st)
    return (time.perf_counter() - t) / n * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--arm-timeout-s", type=float, default=120)
    ap.add_argument("--decode-steps", action="store_true",
                    help="rows: the graphed batcher at --decode-steps 1 and at its default, clients in their own process")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the decode thread's ops on one core; the event loop and the clients take the rest
    model = ByteLM(FLOOR).eval()
    prompts = prompts_for(args.requests, 64)
    print(f"[serve_host_path] {platform.processor() or platform.machine()}, torch {torch.__version__}, dormouse "
          f"{git_rev() or '?'}; model step alone at {args.concurrency} rows: {step_ms(model, args.concurrency):.3f} ms")
    rates = {}
    start_clients()
    runs = ([("process", "graphed_k1"), ("process", "graphed")] if args.decode_steps
            else [("process", "batched"), ("in-process", "batched")])
    for where, arm in runs:
        b, server, thread, url = start_server(model, torch.device("cpu"), args.concurrency, keep_end=False, arm=arm)
        try:
            steps0 = b.counters["serve.steps"]
            deadline = Deadline(args.arm_timeout_s)
            if where == "process":
                recs, wall, cut = load_elsewhere(url, args.concurrency, prompts, args.max_tokens, deadline, lambda: None)
            else:
                recs, wall, cut = asyncio.run(load(url, args.concurrency, prompts, args.max_tokens, deadline))
            steps = b.counters["serve.steps"] - steps0
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            b.stop()
        n = sum(r["bytes"] for r in recs)
        rates[where, arm] = n / wall
        reads = b.counters["serve.host_reads"] or steps  # the eager batcher reads once a step
        print(f"{arm} clients {where:10s}: {n} bytes in {wall:.2f} s = {n / wall:,.0f} bytes/s in total, {steps} steps "
              f"({1e3 * wall / max(steps, 1):.2f} ms a step), {reads} host reads{', cut' if cut else ''}")
    if args.decode_steps:
        print(f"graphed / graphed_k1: {rates['process', 'graphed'] / rates['process', 'graphed_k1']:.2f} x")
    else:
        print(f"clients in a process of their own / in the server's: "
              f"{rates['process', 'batched'] / rates['in-process', 'batched']:.2f} x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
