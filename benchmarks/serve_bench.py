"""Load test of `dormouse serve` on loopback (issue #27 item 5): a fixed number of streaming requests, N at a time,
against the server with the batched decode (every live stream in one step) and, in the same run, with one stream
at a time (max_batch 1: unbatched decoding, the baseline); `--arms batched,graphed,unbatched` adds the graphed decode
(`dormouse serve --decode graphed`: the static-shape step, CUDA graphs per batch bucket, built before its clock starts).
Reports p50/p99 time to the first streamed text, bytes/s per stream and in total, and the ratio of total throughput.

    .venv/bin/python benchmarks/serve_bench.py --concurrency 32 --requests 64 --max-tokens 128            # tiny, CPU
    python3 benchmarks/serve_bench.py --model results/store/rl/<digest> --device cuda --concurrency 32 \
        --requests 128 --max-tokens 256 --out $OUT/serve_bench.tsv                                         # small, H200

Without --model the model is --preset's architecture (default tiny) at its initialisation (seed 0): the decode cost is the
architecture's, the text is noise. Requests sample at temperature 1 with a seed each and ignore the END byte
(`--keep-end` to honour it), so every request decodes exactly --max-tokens bytes and both arms do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402

from bench_env import git_rev  # noqa: E402
from dormouse.engine.config import load_preset  # noqa: E402
from dormouse.engine.store import open_artifact  # noqa: E402
from dormouse.model.config import ModelConfig  # noqa: E402
from dormouse.model.gpt import ByteLM  # noqa: E402
from dormouse.serve import batcher as batcher_mod  # noqa: E402
from dormouse.serve.app import create_app  # noqa: E402
from dormouse.train.runtime import load_model  # noqa: E402


def versions() -> str:
    import platform

    import fastapi

    return (f"py {platform.python_version()} torch {torch.__version__} fastapi {fastapi.__version__} "
            f"uvicorn {uvicorn.__version__} httpx {httpx.__version__} dormouse {git_rev() or '?'}")


ARMS = {"batched": batcher_mod.Batcher, "graphed": batcher_mod.GraphedBatcher, "unbatched": batcher_mod.Batcher}


def start_server(model, device, max_batch: int, keep_end: bool, arm: str = "batched"):
    b = ARMS[arm](model, device, bf16=True, max_batch=max_batch)
    if not keep_end:  # every request decodes --max-tokens bytes: equal work in every arm
        b.submit = (lambda submit: lambda s: (setattr(s, "stop_bytes", frozenset()), submit(s))[1])(b.submit)
    b.start()
    server = uvicorn.Server(uvicorn.Config(create_app(b, "bench"), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return b, server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    first, n_bytes = None, 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n_bytes = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttfb_s": (first or end) - t0, "bytes": n_bytes, "seconds": end - t0}


async def load(url: str, concurrency: int, requests: int, max_tokens: int, prompt_bytes: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    prompts = [(f"request {i}: " + "the quick brown fox " * 64)[:prompt_bytes] for i in range(requests)]

    async def guarded(client, i):
        async with sem:
            return await one(client, url, prompts[i], max_tokens, seed=i)

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(guarded(client, i) for i in range(requests)))
        return rows, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a model artifact (pretrain, sft, rl); default --preset at init")
    ap.add_argument("--preset", default="tiny", help="without --model: this preset's architecture at its initialisation")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-bytes", type=int, default=64)
    ap.add_argument("--keep-end", action="store_true")
    ap.add_argument("--arms", default="batched,unbatched",
                    help=f"comma-separated, in order, of {', '.join(ARMS)} (the ratio needs batched and unbatched)")
    ap.add_argument("--out", type=Path, default=None, help="TSV rows, appended")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms {args.arms}: each one of {', '.join(ARMS)}")
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.model:
        model, _ = load_model(open_artifact(args.model), device)
        name = f"{args.model.parent.name}/{args.model.name[:8]}"
    else:
        torch.manual_seed(0)
        model = ByteLM(ModelConfig.from_dict(load_preset(args.preset, ROOT)["model"])).to(device)
        name = f"{args.preset}@init"
    model.eval()
    print(f"[serve_bench] {versions()}; {name} on {device}; {args.requests} requests, {args.concurrency} at a time, "
          f"{args.max_tokens} bytes each", flush=True)
    results = {}
    for arm in arms:
        max_batch = 1 if arm == "unbatched" else args.concurrency
        b, server, thread, url = start_server(model, device, max_batch, args.keep_end, arm)
        try:
            asyncio.run(load(url, 2, 2, 8, args.prompt_bytes))  # warm-up
            rows, wall = asyncio.run(load(url, args.concurrency, args.requests, args.max_tokens, args.prompt_bytes))
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            b.stop()
        total = sum(r["bytes"] for r in rows)
        results[arm] = {
            "arm": arm, "max_batch": max_batch, "requests": args.requests, "concurrency": args.concurrency,
            "bytes": total, "wall_s": round(wall, 3), "total_bytes_per_s": round(total / wall, 1),
            "stream_bytes_per_s_p50": round(statistics.median(r["bytes"] / r["seconds"] for r in rows), 1),
            "ttfb_p50_ms": round(1e3 * pct([r["ttfb_s"] for r in rows], 0.5), 1),
            "ttfb_p99_ms": round(1e3 * pct([r["ttfb_s"] for r in rows], 0.99), 1),
            "max_batch_seen": b.counters["serve.max_batch_seen"], "steps": b.counters["serve.steps"],
            "state_bytes_per_stream": b.state_bytes_per_stream,
        }
        print(f"[serve_bench] {json.dumps(results[arm])}", flush=True)
    ratio = (results["batched"]["total_bytes_per_s"] / results["unbatched"]["total_bytes_per_s"]
             if {"batched", "unbatched"} <= set(results) else float("nan"))
    print(f"\n{'arm':<10} {'total B/s':>10} {'stream B/s p50':>15} {'TTFB p50 ms':>12} {'TTFB p99 ms':>12} {'steps':>7}")
    for r in results.values():
        print(f"{r['arm']:<10} {r['total_bytes_per_s']:>10} {r['stream_bytes_per_s_p50']:>15} {r['ttfb_p50_ms']:>12} "
              f"{r['ttfb_p99_ms']:>12} {r['steps']:>7}")
    print(f"batched / unbatched total throughput: {ratio:.2f}x", flush=True)
    if args.out:
        keys = ["date", "device", "versions", "model", *results[arms[0]].keys(), "ratio_total"]
        new = not args.out.exists()
        with args.out.open("a", newline="") as f:
            w = csv.DictWriter(f, keys, delimiter="\t")
            if new:
                w.writeheader()
            for r in results.values():
                w.writerow({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": str(device), "versions": versions(),
                            "model": name, **r, "ratio_total": round(ratio, 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
