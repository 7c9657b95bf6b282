"""The MoE FFN's expert paths side by side at a preset's shape (issue #31 item 2): fwd+bwd of one MoE layer.

    # on the H200 (after `source benchmarks/gpu_env.sh`):
    python3 -m benchmarks.moe_h200 --preset b1 --out $OUT/moe_h200.tsv
    # here, on CPU (tests/test_moe_bench.py): tiny shapes
    .venv/bin/python -m benchmarks.moe_h200 --dry-run-cpu

Rows: `dormouse.model.ffn.MoE` with `path` = loop (the implementation before the banks: split sizes read on
the host, a Python loop over experts), grouped_mm (F.grouped_mm over the tokens sorted by expert) and
blocked_bmm (each expert's rows padded to whole blocks, one bmm per bank with each block's expert gathered),
each eager and with `apply_experts` compiled as the stage compiles it (the regions, inductor); plus the dense
SwiGLU of the same width (what one token's FLOPs cost without routing). Random router and inputs (never
zeros), bf16 autocast, B x T tokens of the preset. ms = median of --reps CUDA-event timings after --warmup
calls; ratio = the loop's ms over the row's. Exactness: each path's output and gradients (input, router,
banks) against the loop's, as max |a - b| / max |b| (bf16 arithmetic: ~1e-2 is rounding). Host syncs per
call counted with CUDA's sync debug mode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks.bench_env import git_rev
from dormouse.core.config import load_preset  # noqa: E402
from dormouse.model.ffn import PATHS, MoE, SwiGLU  # noqa: E402

ORDER = ["loop"] + [p for p in PATHS if p != "loop"]  # the reference first: every row's ratio is against it
from dormouse.model.regions import compile_regions  # noqa: E402

COLUMNS = ["date", "device", "versions", "git", "preset", "tokens", "row", "ms", "ratio_vs_loop", "tflops",
           "host_syncs", "max_rel_err", "note"]


def timed(fn, reps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        per = []
        for _ in range(reps):
            s = time.perf_counter()
            fn()
            per.append((time.perf_counter() - s) * 1e3)
        return statistics.median(per)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def host_syncs(fn) -> int | None:
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="b1")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on CPU, no compile (a test of the script)")
    args = ap.parse_args(argv)

    dry = args.dry_run_cpu
    device = torch.device("cpu" if dry else "cuda")
    p = load_preset(args.preset)
    m, t = p["model"], p["train"]
    d, hidden, e, k = m["d_model"], m["ffn_hidden"], m.get("n_experts", 8), m.get("moe_top_k", 2)
    tokens = t["batch_size"] * t["seq_len"]
    if dry:
        d, hidden, e, tokens = 32, 48, 4, 256
    dtype = torch.bfloat16
    torch.manual_seed(0)
    moe = MoE(d, hidden, e, k).to(device)
    torch.nn.init.normal_(moe.w_down, std=hidden ** -0.5)  # live experts (a model zeroes w_down at init)
    x = torch.randn(tokens, d, device=device)
    gy = torch.randn(tokens, d, device=device)
    params = [moe.router.weight, moe.w_gate, moe.w_up, moe.w_down]
    flops = 6 * tokens * k * 3 * d * hidden  # fwd + bwd of the experts' matmuls

    def run(module, path=None, fn=None):
        if path is not None:
            module.path = path
        xi = x.detach().requires_grad_(True)
        with torch.autocast(device.type, dtype=dtype):
            y = (fn or module)(xi)
        y.backward(gy)
        return y, xi

    def grads_of(path):
        for q in params:
            q.grad = None
        y, xi = run(moe, path)
        return [y.detach(), xi.grad.detach()] + [q.grad.detach().clone() for q in params]

    ref = grads_of("loop")
    rows = []
    versions = f"torch {torch.__version__}" + (f" cuda {torch.version.cuda}" if device.type == "cuda" else "")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    base = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": name, "versions": versions,
            "git": git_rev(), "preset": args.preset, "tokens": tokens}
    loop_ms = None
    for compiled in (False, True):
        if compiled and dry:
            continue
        if compiled:
            torch._dynamo.reset()
            compile_regions(moe)  # apply_experts under inductor, as the stage compiles it
        for path in ORDER:
            if compiled and path == "loop":
                continue  # its host read breaks a fullgraph region
            label = f"{path}{' compiled' if compiled else ''}"
            row = {**base, "row": label}
            try:
                got = grads_of(path)
                row["max_rel_err"] = f"{max(rel(a, b) for a, b in zip(got, ref, strict=True)):.3g}"
                ms = timed(lambda path=path: run(moe, path), args.reps, args.warmup, device)
                row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), host_syncs=host_syncs(lambda path=path: run(moe, path)))
                loop_ms = ms if label == "loop" else loop_ms
                row["ratio_vs_loop"] = round(loop_ms / ms, 2) if loop_ms else None
            except Exception as ex:  # noqa: BLE001 - one path's failure is that row's result
                row["note"] = f"{type(ex).__name__}: {str(ex)[:200]}"
            rows.append(row)
            print(row, flush=True)
        if compiled:
            del moe.__dict__["apply_experts"]  # back to the eager method
    dense = SwiGLU(d, hidden * k).to(device)
    ms = timed(lambda: run(dense, fn=dense), args.reps, args.warmup, device)
    rows.append({**base, "row": f"dense SwiGLU width {hidden * k} (top-{k}'s FLOPs, no routing)", "ms": round(ms, 3),
                 "ratio_vs_loop": round(loop_ms / ms, 2) if loop_ms else None, "tflops": round(flops / ms / 1e9, 1)})
    print(rows[-1], flush=True)
    if args.out is not None:
        new = not args.out.exists()
        with args.out.open("a") as f:
            if new:
                f.write("\t".join(COLUMNS) + "\n")
            for r in rows:
                f.write("\t".join("" if r.get(c) is None else str(r.get(c)) for c in COLUMNS) + "\n")
    print(f"\n{'row':<46} {'ms':>8} {'vs loop':>8} {'TFLOP/s':>8} {'syncs':>6} {'max rel err':>12}")
    for r in rows:
        print(f"{r['row'][:46]:<46} {r.get('ms', '-')!s:>8} {r.get('ratio_vs_loop', '-')!s:>8} {r.get('tflops', '-')!s:>8} "
              f"{r.get('host_syncs', '-')!s:>6} {r.get('max_rel_err', '-')!s:>12} {r.get('note', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
