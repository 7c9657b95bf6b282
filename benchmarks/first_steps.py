"""Where a preset's first training steps spend their time (issue #31 item 1): the pretrain stage's own
pieces, phase by phase, at the preset's shape.

    # on the H200 (after `source benchmarks/gpu_env.sh`; TRITON_CACHE_DIR empty = a cold Triton cache):
    TORCH_LOGS=recompiles python3 -m benchmarks.first_steps --preset b1 --steps 8 --budget-s 420
    # here, on CPU (what tests/test_first_steps_bench.py runs):
    .venv/bin/python -m benchmarks.first_steps --preset tiny --steps 3 --device cpu

Phases, each closed by a device synchronize so its time is its own: model build, optimizers, region
compile set-up, then per step the forward (autocast, loss, the MoE balancing term: what the stage runs;
under train.cuda_graphs on CUDA the stage's graphed loss, whose capture is part of step 0's forward)
and the rest of the step (backward, clip, both optimizer steps, zero_grad, through the stage's
Firewall). The first step holds the compiles and Triton's autotune; `torch._dynamo.utils.compile_times`
splits dynamo's share by function. Host syncs: one steady step runs under
`torch.cuda.set_sync_debug_mode("warn")` and its warnings are counted (a sync the MoE's routing or a
`.item()` forces). With DORMOUSE_COMPILE_CACHE set it loads and saves the compile cache as the stage does
(dormouse/train/compile_cache.py): run it once to fill the cache, then with an empty TORCHINDUCTOR_CACHE_DIR to time
a fresh node's start from it. A thread prints every thread's Python stack each --stack-every seconds, so a step that
never ends still says where it is (ptxas, an autotune, a compile). Writes one JSON line per phase to --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from benchmarks.timing import sync
from dormouse.core.config import load_preset  # noqa: E402
from dormouse.model.config import ModelConfig  # noqa: E402
from dormouse.model.gpt import ByteLM, count_params  # noqa: E402
from dormouse.train import compile_cache  # noqa: E402
from dormouse.train.optim import build_optimizers, set_lr, wsd_multiplier  # noqa: E402
from dormouse.train.runtime import compile_for  # noqa: E402
from dormouse.train.trainer import PretrainStep  # noqa: E402
from dormouse.train.settings import OptimSettings, TrainSettings


class Phases:
    """Timed phases, each written as a JSON line when it ends."""

    def __init__(self, out: Path | None, device: torch.device):
        self.out, self.device, self.t0 = out, device, time.perf_counter()
        self.rows: list[dict] = []
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("")

    def run(self, name: str, fn, **extra):
        sync(self.device)
        s = time.perf_counter()
        result = fn()
        sync(self.device)
        row = {"phase": name, "s": round(time.perf_counter() - s, 3), "since_start_s": round(time.perf_counter() - self.t0, 3),
               **extra}
        self.rows.append(row)
        print(f"[first_steps] {json.dumps(row)}", flush=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return result


def count_syncs(fn) -> int:
    """Host syncs during fn, as CUDA's sync debug mode warns them (0 off CUDA)."""
    if not torch.cuda.is_available():
        fn()
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.set_sync_debug_mode(0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="b1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--model", default="{}", help="JSON of model fields over the preset's (e.g. a dense control)")
    ap.add_argument("--device", default=None, help="default: cuda when available")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting steps past this many seconds")
    ap.add_argument("--stack-every", type=float, default=30.0, help="seconds between stack dumps (0: none)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    preset = load_preset(args.preset)
    model_cfg = {**preset["model"], **json.loads(args.model)}
    cfg = ModelConfig.from_dict(model_cfg)
    train = dict(preset["train"])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch, seq = args.batch_size or train["batch_size"], args.seq_len or train["seq_len"]
    if args.stack_every > 0:
        faulthandler.dump_traceback_later(args.stack_every, repeat=True, file=sys.stderr)
    ph = Phases(args.out, device)
    cp = count_params(cfg)
    print(f"[first_steps] preset {args.preset} model {json.dumps(json.loads(args.model))} B{batch} x T{seq} on {device}; "
          f"params total {cp['total']:,} active {cp['active']:,}", flush=True)

    torch.manual_seed(0)
    model = ph.run("build_model", lambda: ByteLM(cfg).to(device).train())
    model.defer_routing = True  # as the stage: an MoE's routing counts stay on the device until read
    opts = ph.run("build_optimizers", lambda: build_optimizers(model, OptimSettings.of(train)))
    regions = ph.run("compile_regions_setup", lambda: compile_for(model, device, train["compile"]))
    cache_counts: Counter = Counter()  # DORMOUSE_COMPILE_CACHE, as the stage: load before the first compile
    if regions:
        ph.run("compile_cache_load", lambda: compile_cache.load(device, cache_counts))
    ps = PretrainStep(model, opts, cfg, TrainSettings.of(train), device)  # the stage's step; decides train.cuda_graphs as the stage does
    print(f"[first_steps] cuda_graphs: {ps.graphs}", flush=True)
    g = torch.Generator().manual_seed(1)
    counters: Counter = Counter()
    data = torch.randint(0, 256, (4, batch, seq + 1), generator=g)  # random bytes: never time on zeros

    for step in range(args.steps):
        if time.perf_counter() - ph.t0 > args.budget_s:
            print(f"[first_steps] budget {args.budget_s} s reached before step {step}", flush=True)
            break
        set_lr(opts, wsd_multiplier(step, train["steps"], train["warmup_steps"], train["decay_frac"], train["min_lr_frac"]))
        xy = data[step % 4].to(device)
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        box = {}

        def forward(x=x, y=y, box=box):  # graphed: the forward and backward replayed (captured on step 0)
            box["loss"], box["total"] = ps.forward(x, y, counters)

        def rest(box=box, step=step):
            ps.firewall.step(box["loss"], box["total"], f"step {step}")

        if step == args.steps - 1 and step >= 2:  # a steady step: count its host syncs
            syncs = {"n": 0}

            def both():
                forward()
                rest()
            syncs["n"] = count_syncs(both)
            sync(device)
            ph.run(f"step{step}_syncs", lambda: None, host_syncs=syncs["n"])
            continue
        ph.run(f"step{step}_forward", forward)
        ph.run(f"step{step}_backward_opt", rest)
    loss = ps.firewall.read("the end")
    model.take_routing(counters)
    faulthandler.cancel_dump_traceback_later()
    try:
        from torch._dynamo.utils import compile_times
        print("[first_steps] dynamo compile times (s):\n" + str(compile_times(repr="str", aggregate=True)), flush=True)
    except Exception as e:  # a report only; its absence changes no figure
        print(f"[first_steps] compile_times unavailable: {e}", flush=True)
    if regions:
        ph.run("compile_cache_save", lambda: compile_cache.save(device, cache_counts))
    extra = {"regions": len(regions), "loss": round(loss, 4), "counters": {k: v for k, v in counters.items() if not k.startswith("moe.tokens")},
             "compile_cache": dict(cache_counts)}
    if device.type == "cuda":
        extra["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    ph.run("end", lambda: None, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
