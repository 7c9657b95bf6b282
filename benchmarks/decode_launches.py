"""Issue #42: how many kernels serve's decode step launches on the CUDA path, counted on the CPU.

A graphed decode step is launch-bound: ~900 kernels of ~1.5 us each for small (benchmarks/records/
2026-12-06-serve-h100), so the count of kernels is the figure a change to the step must move, and it can be
measured without a GPU. Here the step's CUDA branches (FLA's and our Triton kernels, chosen by `kda.on_gpu`) run on
the CPU under Triton's interpreter, and the step is counted as a GPU would run it: one launch per Triton kernel, one
per aten op that writes memory (views, metadata and allocations launch nothing), under bf16 autocast with the
weights cast once as `dormouse serve` does. The H100 profile of the same step is the check on this proxy: the record
above counted 888 kernels a step for small at 1 row (weights cast once).

    .venv/bin/python -m benchmarks.decode_launches --presets small --rows 1,64
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when FLA decorates its kernels: before anything imports it

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.bench_env import append_jsonl, git_rev, package_versions, rerun_command  # noqa: E402
from benchmarks import decode_step as decode_step_module  # noqa: E402
from benchmarks import triton_interpret  # noqa: E402
from benchmarks.decode_step import at_init, ready_step  # noqa: E402
from dormouse.model import kda as kda_module  # noqa: E402
from dormouse.posttrain import decode as decode_module  # noqa: E402
from dormouse.posttrain import rowrng  # noqa: E402
from dormouse.serve import weights as serve_weights  # noqa: E402
from dormouse.serve.weights import cast_for_autocast  # noqa: E402

_aten = torch.ops.aten
# ops that launch no kernel on a GPU: allocations (the caching allocator), metadata, and host-side scalars
_NO_KERNEL = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
              _aten.new_empty_strided.default, _aten.empty_like.default, _aten.sym_size.int, _aten.sym_stride.int,
              _aten.sym_numel.default, _aten.is_contiguous.default, _aten.lift_fresh.default}


class Launches(TorchDispatchMode):
    """Counts, by name, the aten ops that would launch a kernel on a GPU and the Triton kernels launched."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside_triton or func.is_view or func in _NO_KERNEL:
            return out
        if func in (_aten.copy_.default, _aten._to_copy.default) and _same_memory(args):
            return out  # a copy onto itself launches nothing
        self.ops[f"aten.{func.overloadpacket.__name__}"] += 1
        return out


def _same_memory(args) -> bool:
    ts = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    return len(ts) == 2 and ts[0].data_ptr() == ts[1].data_ptr() and ts[0].shape == ts[1].shape


@contextmanager
def triton_counted(counter: Launches):
    """Each interpreted Triton launch counted once, by kernel name; the interpreter's own host copies not at all."""
    from triton.runtime.interpreter import InterpretedFunction

    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        counter.ops[f"triton.{self.fn.__name__}"] += 1
        counter.inside_triton += 1
        try:
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counter.inside_triton -= 1

    with mock.patch.object(InterpretedFunction, "run", run):
        yield


def _cpu_autocast(device, dtype, cache=True):
    """`runtime.autocast` as on CUDA: bf16 autocast (cache off inside a step, as a graph capture needs)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache) if dtype == "bfloat16" else \
        torch.autocast("cpu", enabled=False)


def count_step(preset: str, rows: int, steps: int) -> dict:
    """Launches a decode step of `rows` rows makes on the CUDA path (mean over `steps` steps after one warm step)."""
    device = torch.device("cpu")
    model = at_init(preset, device, cast=False, stack=False)
    cast = cast_for_autocast(model, device)  # on the CPU too: what serve does on CUDA
    if hasattr(serve_weights, "stack_projections"):  # as serve does, where the tree has it (older trees: not)
        serve_weights.stack_projections(model)
    with mock.patch.object(decode_module, "autocast", _cpu_autocast), \
            mock.patch.object(decode_step_module, "autocast", _cpu_autocast):
        step = ready_step(model, rows, graphed=False, bf16=True)  # the prompts' prefill on the torch path
        with mock.patch.object(kda_module, "on_gpu", lambda t: True), \
                mock.patch.object(rowrng, "on_gpu", lambda t: True, create=True):  # create: older trees
            step(rows)  # warm: Triton's autotuner runs its configs on a first call
            counter = Launches()
            t0 = time.perf_counter()
            with triton_counted(counter), counter:
                for _ in range(steps):
                    step(rows)
            wall = time.perf_counter() - t0
    per_step = {k: v / steps for k, v in counter.ops.items()}
    total = sum(per_step.values())
    triton = sum(v for k, v in per_step.items() if k.startswith("triton."))
    return {"preset": preset, "rows": rows, "launches_per_step": round(total, 1), "triton_per_step": round(triton, 1),
            "weights_cast_once": cast["serve.weights_cast_once"], "interpreted_s_per_step": round(wall / steps, 2),
            "by_op": dict(sorted(((k, round(v, 2)) for k, v in per_step.items()), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None, help="append each row as a JSON line")
    args = ap.parse_args(argv)
    triton_interpret.apply()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"[decode_launches] cpu, Triton interpreted; {package_versions(['torch', 'triton', 'fla-core'])}; "
          f"dormouse {git_rev()}; {rerun_command('benchmarks.decode_launches', argv)}", flush=True)
    rows_out = []
    for preset in args.presets.split(","):
        for n in [int(x) for x in args.rows.split(",")]:
            row = {"date": time.strftime("%Y-%m-%d"), **count_step(preset, n, args.steps)}
            rows_out.append(row)
            print(f"[decode_launches] {json.dumps(row)}", flush=True)
    append_jsonl(args.out, rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
