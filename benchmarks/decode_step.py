"""Issue #42: serve's decode step alone, no server: ms a step of `DecodeStep` at n live rows, graphed (one CUDA
graph replay) against eager in the same run, the step by itself and with the one host read the serve loop does
after it, and (--profile) the kernels a step launches and where its device time goes. What serve_bench measures
through HTTP minus this is the host path (delivery, the event loop, SSE). --compile adds a mode "compiled": the same
step (graphed on CUDA) over a second model instance whose regions are torch.compiled (dormouse/model/regions.py, what
pretrain and rl run), so inductor fuses the elementwise chains between the KDA kernels; its set-up includes the compile.

    python3 -m benchmarks.decode_step --device cuda --presets small,medium --rows 1,8,64 --profile --compile
    .venv/bin/python -m benchmarks.decode_step --presets tiny --rows 1,4 --steps 20        # CPU: eager only

Models at init (seed 0): a step's cost does not depend on the weights' values. Rows: 64-byte random prompts
prefilled, then temperature-1 sampling with no stop bytes, so every row runs every step."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
import torch._dynamo

from benchmarks.bench_env import append_jsonl, ROOT, git_rev, package_versions, rerun_command
from benchmarks.timing import measure
from dormouse.core.config import load_preset
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM
from dormouse.model.regions import compile_regions
from dormouse.posttrain.decode import DecodeStep, prefill_prompts
from dormouse.serve.weights import cast_for_autocast, stack_projections
from dormouse.train.runtime import autocast


def at_init(preset: str, device: torch.device, cast: bool, stack: bool = True) -> ByteLM:
    """The preset's model at init (seed 0); on CUDA with `cast`, its weights cast once as `dormouse serve` does; with
    `stack`, its projections stacked once as `dormouse serve` does."""
    torch.manual_seed(0)
    model = ByteLM(ModelConfig.from_dict(load_preset(preset, ROOT)["model"])).to(device).eval()
    if cast and device.type == "cuda":
        cast_for_autocast(model, device)
    if stack:
        stack_projections(model)
    return model


def ready_step(model: ByteLM, rows: int, graphed: bool, bf16: bool, prompt_bytes: int = 64) -> DecodeStep:
    """A DecodeStep of `rows` slots, every slot a prefilled row sampling at temperature 1 (seed = its slot)."""
    step = DecodeStep(model, rows, buckets=[rows], graphed=graphed, bf16=bf16)  # the one bucket it times
    g = torch.Generator().manual_seed(1)
    prompts = [bytes(torch.randint(32, 127, (prompt_bytes,), generator=g).tolist()) for _ in range(rows)]
    device = next(model.parameters()).device
    with torch.inference_mode(), autocast(device, "bfloat16" if bf16 else "float32"):
        logits, state = prefill_prompts(model, prompts)
        step.put(range(rows), step.begin(logits, state, list(range(rows)), [1.0] * rows, [None] * rows,
                                         [()] * rows))
    return step


def kernels_per_step(fn, steps: int, device: torch.device) -> dict:
    """fn() `steps` times under torch.profiler: device kernels a call, device ms a call, the five costliest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = Counter()
    for e in kernels:
        by_name[e.name] += e.device_time
    total_us = sum(by_name.values())
    return {"kernels_per_step": round(len(kernels) / steps, 1), "device_ms_per_step": round(total_us / steps / 1e3, 4),
            "top": [(name[:60], round(us / steps / 1e3, 4)) for name, us in by_name.most_common(5)]}


def time_step(model: ByteLM, n: int, graphed: bool, bf16: bool, steps: int, warmup: int, profile: bool) -> dict:
    """One DecodeStep of n rows timed: the step alone and with its host read (the serve loop's turn)."""
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    step = ready_step(model, n, graphed, bf16)
    setup_s = time.perf_counter() - t0

    def step_and_read():  # what the serve loop does a turn, besides delivering the bytes
        step(n)
        step.read(n)

    alone = measure(lambda: step(n), steps, warmup, device)
    read = measure(step_and_read, steps, warmup, device)
    out = {"setup_s": round(setup_s, 2), "ms_step": round(alone["ms_step"], 4),
           "ms_step_with_read": round(read["ms_step"], 4), "bytes_per_s": round(n / read["ms_step"] * 1e3, 1),
           "peak_gib": alone["peak_gib"] and round(alone["peak_gib"], 3)}
    if profile and device.type == "cuda":
        out.update(kernels_per_step(step_and_read, 20, device))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small")
    ap.add_argument("--rows", default="1,8,64", help="live rows a step (each its own DecodeStep of that size)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true", help="kernels a step and the costliest ones (CUDA)")
    ap.add_argument("--fp32-weights", action="store_true",
                    help="keep every weight fp32 (autocast casts them in each step), not cast once as serve does; "
                         "session 26's record ran so")
    ap.add_argument("--compile", action="store_true", help="add the mode with the model's regions compiled")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of --compile (tests: aot_eager)")
    ap.add_argument("--out", default=None, help="append each row as a JSON line")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    modes = ["eager", "graphed"] if cuda else ["eager"]
    vers = package_versions(["torch", "triton", "fla-core"])
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"[decode_step] {name}; {vers}; dormouse {git_rev()}; {rerun_command('benchmarks.decode_step', argv)}",
          flush=True)
    rows_out = []
    for preset in args.presets.split(","):
        models = {m: at_init(preset, device, not args.fp32_weights) for m in modes}
        if args.compile:  # its own instance: compile_regions binds compiled methods to the modules it is given
            torch._dynamo.reset()  # compiled regions are per class: another preset's graphs would count to its limit
            models["compiled"] = at_init(preset, device, not args.fp32_weights)
            regions = compile_regions(models["compiled"], backend=args.compile_backend)
            print(f"[decode_step] {preset}: {len(regions)} regions compiled ({args.compile_backend})", flush=True)
        for n in [int(x) for x in args.rows.split(",")]:
            by_mode = {}
            for mode, model in models.items():
                graphed = mode == "graphed" or (mode == "compiled" and cuda)
                row = {"date": time.strftime("%Y-%m-%d"), "device": name, "preset": preset, "mode": mode, "rows": n,
                       **time_step(model, n, graphed, cuda, args.steps, args.warmup, args.profile)}
                by_mode[mode] = row
                rows_out.append(row)
                print(f"[decode_step] {json.dumps(row)}", flush=True)
            e = by_mode["eager"]
            for mode in ("graphed", "compiled"):
                if mode in by_mode:
                    g = by_mode[mode]
                    print(f"[decode_step] {preset} {n} rows: {mode} {g['ms_step_with_read']} ms a step with its read "
                          f"against eager {e['ms_step_with_read']} ms: "
                          f"{e['ms_step_with_read'] / g['ms_step_with_read']:.2f}x; {g['bytes_per_s']:.0f} bytes/s",
                          flush=True)
        del models
        if cuda:
            torch.cuda.empty_cache()
    append_jsonl(args.out, rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
