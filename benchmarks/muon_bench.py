"""Optimizer step time: torch.optim.Muon against StackedMuon (batched Newton–Schulz) on a preset's
hidden matrices, in the same run. On the H200 this is the lever the pretrain step needs (Muon ranked
first in the CPU profile of our step); on CPU it shows the host-side share.

    .venv/bin/python -m benchmarks.muon_bench --preset small            # CPU
    python3 -m benchmarks.muon_bench --preset small --device cuda       # device tool

"StackedMuon, eager" runs its elementwise work (`_momentum`, `_apply`) eagerly, as before run 7; the other
StackedMuon rows take its inductor graphs on CUDA, which the first warm-up step compiles for the ok and the no-ok
form (run 7's call of this script ran out of its 120 s before printing: give it 300 s). "+ NS a folded" is StackedMuon
with optim.NS_FOLD_A (a*X inside the Gram polynomial's diagonal: no baddbmm copy of X), off in the stages until this
row shows it faster. It also times StackedMuon
under the pretrain stage's device firewall both ways: `step(ok=...)` (the decision taken inside the step, since
run 6) and `firewall.guarded_step`'s generic path (every weight and state cloned, then put back with torch.where:
what the stage ran before), and the Newton–Schulz iterations alone on the same stacks (bf16, wide, as StackedMuon
runs them) with their FLOPs and rate: the part of StackedMuon's step that is matmul, against the rest (momentum,
stacking, the update).
"""

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from dormouse.core.config import load_preset  # noqa: E402
from dormouse.model.config import ModelConfig  # noqa: E402
from dormouse.model.gpt import ByteLM  # noqa: E402
from dormouse.train import optim  # noqa: E402
from dormouse.train.firewall import guarded_step  # noqa: E402
from dormouse.train.optim import StackedMuon, _newton_schulz_iterations, _normalized_bf16, _tall_bank  # noqa: E402


@contextlib.contextmanager
def _patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


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
    alone, one call per stack as StackedMuon makes them (a bank counts its matrices; a tall bank in its own layout)."""
    group = opt.param_groups[0]
    by_shape: dict[tuple, int] = {}
    for p in hidden:  # a tall matrix joins its transpose's stack, a tall bank has its own: as in StackedMuon
        key = (min(p.shape[-2:]), max(p.shape[-2:]), _tall_bank(p))
        by_shape[key] = by_shape.get(key, 0) + (p.shape[0] if p.dim() == 3 else 1)
    gen = torch.Generator(device=device).manual_seed(1)
    stacks = [torch.randn((n, *((k, m) if tall else (m, k))), generator=gen, device=device)
              for (m, k, tall), n in by_shape.items()]

    def timed(gs, talls) -> float:
        times = []
        for i in range(warmup + steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            for g, tall in zip(gs, talls, strict=True):
                _newton_schulz_iterations(_normalized_bf16(g, group["eps"]), group["ns_coefficients"], group["ns_steps"], tall)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    talls = [tall for (_, _, tall) in by_shape]
    per = [((k, m) if tall else (m, k), n, timed([g], [tall]), ns_flops((m, k), n, group["ns_steps"]))
           for ((m, k, tall), n), g in zip(by_shape.items(), stacks, strict=True)]
    return timed(stacks, talls), sum(f for *_, f in per), per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", type=json.loads, default={}, help='overrides of the preset\'s model, JSON: \'{"moe": true}\'')
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cfg = ModelConfig.from_dict({**load_preset(args.preset)["model"], **args.model})
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    res = {}
    ok = torch.ones((), dtype=torch.bool, device=device)
    rows = [("torch.optim.Muon", torch.optim.Muon), ("StackedMuon, eager", StackedMuon), ("StackedMuon", StackedMuon),
            ("+ firewall, ok", StackedMuon), ("+ firewall, where", StackedMuon), ("+ NS a folded", StackedMuon)]
    if cfg.moe:  # torch's Muon refuses an MoE's 3-D expert banks; the old layout of tall banks is the baseline instead
        rows = [("tall banks transposed", StackedMuon)] + rows[1:]
    for name, cls in rows:
        torch.manual_seed(0)
        hidden, _ = ByteLM(cfg).to(device).param_groups()
        opt = cls(hidden, **kw)
        step = {"+ firewall, ok": lambda: guarded_step(opt, ok),  # noqa: B023 - called before the next iteration
                "+ firewall, where": lambda: guarded_step(_Generic(opt), ok)}.get(name)  # noqa: B023
        with contextlib.ExitStack() as stack:
            if name == "StackedMuon, eager":
                stack.enter_context(eager_elementwise())
            if name == "tall banks transposed":
                stack.enter_context(_patched(optim, "TALL_BANK_STACKS", False))
            if name == "+ NS a folded":  # optim.NS_FOLD_A
                stack.enter_context(_patched(optim, "NS_FOLD_A", True))
            res[name] = time_steps(opt, hidden, device, args.steps, args.warmup, step)
    ns_s, ns_fl, per = time_ns(hidden, device, opt, args.steps, args.warmup)
    with _patched(optim, "NS_FOLD_A", True):
        ns_folded_s, _, _ = time_ns(hidden, device, opt, args.steps, args.warmup)
    shapes = sorted({tuple(p.shape) for p in hidden})
    print(f"preset {args.preset}: {len(hidden)} hidden matrices in {len(shapes)} shapes {shapes}; device {device}; "
          f"torch {torch.__version__}; threads {torch.get_num_threads()}")
    base_name = next(iter(res))
    for name, t in res.items():
        print(f"{name:<22} {t * 1000:9.2f} ms/step   {res[base_name] / t:5.2f} x {base_name}")
    print(f"{'Newton-Schulz only':<22} {ns_s * 1000:9.2f} ms/step   {ns_fl / 1e12:.3f} TFLOP at {ns_fl / ns_s / 1e12:.1f} "
          f"TFLOP/s; {100 * ns_s / res['StackedMuon']:.0f}% of StackedMuon's step")
    print(f"{'  with a folded':<22} {ns_folded_s * 1000:9.2f} ms/step   {ns_s / ns_folded_s:5.2f} x Newton-Schulz only")
    for shape, n, t, fl in per:
        print(f"  stack {n:>3} x {shape[0]}x{shape[1]:<5}{' tall' if shape[0] > shape[1] else '     '} {t * 1000:8.3f} ms   {fl / 1e12:.3f} TFLOP at {fl / t / 1e12:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
