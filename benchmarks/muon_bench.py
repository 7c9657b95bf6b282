"""Optimizer step time: torch.optim.Muon against StackedMuon (batched Newton–Schulz) on a preset's
hidden matrices, in the same run. On the H200 this is the lever the pretrain step needs (Muon ranked
first in the CPU profile of our step); on CPU it shows the host-side share.

    .venv/bin/python benchmarks/muon_bench.py --preset small            # CPU
    python3 benchmarks/muon_bench.py --preset small --device cuda       # device tool

"StackedMuon, eager" runs its elementwise work (`_momentum`, `_apply`) eagerly, as before run 7; the other
StackedMuon rows take its inductor graphs on CUDA, which the first warm-up step compiles for the ok and the no-ok
form (run 7's call of this script ran out of its 120 s before printing: give it 300 s). It also times StackedMuon
under the pretrain stage's device firewall both ways: `step(ok=...)` (the decision taken inside the step, since
run 6) and `firewall.guarded_step`'s generic path (every weight and state cloned, then put back with torch.where:
what the stage ran before), and the Newton–Schulz iterations alone on the same stacks (bf16, wide, as StackedMuon
runs them) with their FLOPs and rate: the part of StackedMuon's step that is matmul, against the rest (momentum,
stacking, the update).
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dormouse.engine.config import load_preset  # noqa: E402
from dormouse.model.config import ModelConfig  # noqa: E402
from dormouse.model.gpt import ByteLM  # noqa: E402
from dormouse.train import optim  # noqa: E402
from dormouse.train.firewall import guarded_step  # noqa: E402
from dormouse.train.optim import StackedMuon, _newton_schulz_iterations, _normalized_bf16  # noqa: E402


@contextlib.contextmanager
def eager_elementwise():
    """StackedMuon's `_momentum` and `_apply` run eagerly inside (as before run 7), compiled or not."""
    backend = optim.ELEMENTWISE_BACKEND
    optim.ELEMENTWISE_BACKEND = None
    try:
        yield
    finally:
        optim.ELEMENTWISE_BACKEND = backend


class _Generic:
    """An optimizer seen as any optimizer: guarded_step takes its clone-and-where path (the stage's before run 6)."""

    def __init__(self, opt):
        self.opt, self.param_groups, self.state, self.defaults = opt, opt.param_groups, opt.state, opt.defaults

    def step(self):
        return self.opt.step()


def time_steps(opt, params, device, steps: int, warmup: int, step=None) -> float:
    """Median seconds of `step()` (default opt.step) on fixed random gradients."""
    step = step or opt.step
    gen = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=device)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def ns_flops(shape: tuple, n: int, steps: int) -> float:
    """FLOPs of `steps` Newton–Schulz iterations on n stacked [A, B] matrices (run on the wide side: m <= k):
    X X^T (2 m^2 k), (b G + c G G) (2 m^3), (...) X (2 m^2 k)."""
    m, k = sorted(shape)
    return n * steps * (4 * m * m * k + 2 * m ** 3)


def time_ns(hidden, device, opt, steps: int, warmup: int) -> tuple[float, float, list]:
    """(median seconds, FLOPs, per-stack [(shape, n, median seconds, FLOPs)]) of the Newton–Schulz stacks
    alone, one call per shape as StackedMuon makes them."""
    group = opt.param_groups[0]
    by_shape: dict[tuple, list] = {}
    for p in hidden:  # a tall matrix joins its transpose's stack, as in StackedMuon
        by_shape.setdefault((min(p.shape), max(p.shape)), []).append(p)
    gen = torch.Generator(device=device).manual_seed(1)
    stacks = [torch.randn((len(ps), *shape), generator=gen, device=device) for shape, ps in by_shape.items()]

    def timed(gs) -> float:
        times = []
        for i in range(warmup + steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            for g in gs:
                _newton_schulz_iterations(_normalized_bf16(g, group["eps"]), group["ns_coefficients"], group["ns_steps"])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    per = [(shape, len(ps), timed([g]), ns_flops(shape, len(ps), group["ns_steps"]))
           for (shape, ps), g in zip(by_shape.items(), stacks)]
    return timed(stacks), sum(f for *_, f in per), per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cfg = ModelConfig.from_dict(load_preset(args.preset)["model"])
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    res = {}
    ok = torch.ones((), dtype=torch.bool, device=device)
    for name, cls in (("torch.optim.Muon", torch.optim.Muon), ("StackedMuon, eager", StackedMuon),
                      ("StackedMuon", StackedMuon), ("+ firewall, ok", StackedMuon), ("+ firewall, where", StackedMuon)):
        torch.manual_seed(0)
        hidden, _ = ByteLM(cfg).to(device).param_groups()
        opt = cls(hidden, **kw)
        step = {"+ firewall, ok": lambda: guarded_step(opt, ok),  # noqa: B023 - called before the next iteration
                "+ firewall, where": lambda: guarded_step(_Generic(opt), ok)}.get(name)  # noqa: B023
        with eager_elementwise() if name == "StackedMuon, eager" else contextlib.nullcontext():
            res[name] = time_steps(opt, hidden, device, args.steps, args.warmup, step)
    ns_s, ns_fl, per = time_ns(hidden, device, opt, args.steps, args.warmup)
    shapes = sorted({tuple(p.shape) for p in hidden})
    print(f"preset {args.preset}: {len(hidden)} hidden matrices in {len(shapes)} shapes {shapes}; device {device}; "
          f"torch {torch.__version__}; threads {torch.get_num_threads()}")
    base = res["torch.optim.Muon"]
    for name, t in res.items():
        print(f"{name:<18} {t * 1000:9.2f} ms/step   {base / t:5.2f} x torch.optim.Muon")
    print(f"{'Newton-Schulz only':<18} {ns_s * 1000:9.2f} ms/step   {ns_fl / 1e12:.3f} TFLOP at {ns_fl / ns_s / 1e12:.1f} "
          f"TFLOP/s; {100 * ns_s / res['StackedMuon']:.0f}% of StackedMuon's step")
    for shape, n, t, fl in per:
        print(f"  stack {n:>3} x {shape[0]}x{shape[1]:<5} {t * 1000:8.3f} ms   {fl / 1e12:.3f} TFLOP at {fl / t / 1e12:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
