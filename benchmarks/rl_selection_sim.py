"""rl's checkpoint selection by simulation: how often the old rule and the new one ship a checkpoint, with no real
gain (the false-ship rate) and with one (the power). CPU, about a minute at the defaults.

    .venv/bin/python -m benchmarks.rl_selection_sim                  # 2000 arms per row, 384 and 800 dev items
    .venv/bin/python -m benchmarks.rl_selection_sim --arms 500 --items 298

An arm: N distinct dev items, step 0 (the SFT model) right on each with probability --base (0.18), and 10
checkpoints. Each checkpoint differs from step 0 on an item independently, with a discordance of --discord (0.13,
the share of items changed seen between checkpoints and step 0), the items it gains and loses set so that its
expected accuracy is its target: gained (d + delta) / 2, lost (d - delta) / 2 of the items. Scenarios:
  null        every checkpoint's target is step 0's (no real change): a ship is a false one
  +5 flat     every checkpoint +5 points
  +2..+8      rising from +2 to +8 points over the checkpoints, like the small arms' curves (0.195..0.271)
  null c.8, +5 flat c.8   as null and +5 flat, but each checkpoint answers as the one before it on 80 % of the items
              (drawn afresh per checkpoint): neighbouring checkpoints alike, as real ones 20 steps apart likely are
  arm A..D    step 0 at 0.180 and the four small arms' curves (H200, 2026-12), each a straight line from its first
              to its last value over the 10 checkpoints: PARAMETRIC RECONSTRUCTIONS from the reported range of each
              curve (the per-item outcomes were not recorded), run at the sizes given, not the arms' own items.

Rules, each deciding from the same per-item correctness lists:
  old     (rl format 10) each checkpoint against step 0 on all the items by the paired sign test; the most accurate
          with z >= 2.0 ships (the earliest on a tie), else step 0
  bonferroni  (the stage's default rule) selection.decide(rule="bonferroni"): each checkpoint on all the items at
          the exact one-sided sign test's p <= 0.05 / 10 planned checkpoints; the most accurate that passes ships
  new     selection.decide(rule="select_then_confirm"): the best on the select half, shipped if z >= min_z against
          step 0 on the confirm half; at the schema's default min_z and at 2.0
  final   selection.decide(rule="final"): the last checkpoint alone on all the items at p <= 0.05 (small's rule)

Each cell: the share of arms that shipped a checkpoint (step > 0) with its 95 % Wilson interval, and the mean
true gain shipped (the target of the shipped checkpoint minus step 0's, in points; 0 when step 0 ships).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from dormouse.posttrain import selection  # noqa: E402
from dormouse.posttrain.task_eval import paired_sign  # noqa: E402

CHECKPOINTS = 10
OLD_MIN_Z = 2.0
CORR = 0.8  # the c.8 rows: a checkpoint repeats the one before it on 80 % of items
ALPHA = 0.05  # bonferroni's, over the 10 planned checkpoints (the schema's default)
BASE = 0.18
DISCORD = 0.13
OBSERVED_STEP0 = 0.180
OBSERVED_ARMS = {"arm A": (0.195, 0.268), "arm B": (0.214, 0.271), "arm C": (0.206, 0.253), "arm D": (0.203, 0.245)}


def default_min_z() -> float:
    import yaml

    schema = yaml.safe_load((Path(__file__).resolve().parent.parent / "dormouse/schemas/preset.schema.yaml").read_text())
    return schema["properties"]["rl"]["properties"]["select"]["properties"]["min_z"]["default"]


def scenarios(base: float) -> dict[str, tuple[float, list[float], float]]:
    """Name -> step 0's expected accuracy (`base` for the null and gain rows, the observed 0.180 for the arms), the
    10 checkpoints' and the share of items on which a checkpoint repeats the one before it (0: independent)."""
    line = [k / (CHECKPOINTS - 1) for k in range(CHECKPOINTS)]
    out = {"null": (base, [base] * CHECKPOINTS, 0.0), "+5 flat": (base, [base + 0.05] * CHECKPOINTS, 0.0),
           "+2..+8": (base, [base + 0.02 + 0.06 * t for t in line], 0.0)}
    for name, (lo, hi) in OBSERVED_ARMS.items():
        out[name] = (OBSERVED_STEP0, [lo + (hi - lo) * t for t in line], 0.0)
    out["null c.8"] = (base, [base] * CHECKPOINTS, CORR)
    out["+5 flat c.8"] = (base, [base + 0.05] * CHECKPOINTS, CORR)
    return out


def draw_arm(rng: np.random.Generator, n: int, base: float, targets: list[float], discord: float,
             corr: float = 0.0) -> list[list[bool]]:
    """Step 0's and each checkpoint's per-item correctness (rows of n bools). corr: on that share of items (drawn
    per checkpoint) a checkpoint answers as the one before it, so neighbours agree more than two independent draws;
    with flat targets each checkpoint's distribution given step 0 is unchanged (the c.8 rows)."""
    b = rng.random(n) < base
    rows = [b.tolist()]
    prev = None
    for t in targets:
        delta = t - base
        if not abs(delta) <= discord <= 2 * min(base, 1 - base) - abs(delta):
            raise ValueError(f"target {t:.3f}: a discordance of {discord} cannot move {base} by {delta:+.3f}")
        lose, gain = (discord - delta) / 2 / base, (discord + delta) / 2 / (1 - base)
        cur = b ^ (rng.random(n) < np.where(b, lose, gain))
        if prev is not None and corr > 0:
            cur = np.where(rng.random(n) < corr, prev, cur)
        prev = cur
        rows.append(cur.tolist())
    return rows


def old_rule(steps: list[int], correct: list[list[bool]], prompts: list[str], min_zs: list[float]) -> dict[float, int]:
    """rl format 10, per threshold: the most accurate checkpoint whose sign test against step 0 on all the items has
    z >= min_z (the earliest on a tie), else 0. (The sim's prompts are distinct, so keys change nothing; left out
    for speed.)"""
    zs = [(step, paired_sign(correct[0], right)["z"], sum(right)) for step, right in zip(steps[1:], correct[1:], strict=True)]
    out = {}
    for min_z in min_zs:
        best, best_step = -1, 0
        for step, z, n in zs:
            if z >= min_z and n > best:
                best, best_step = n, step
        out[min_z] = best_step
    return out


def simulate(n: int, targets: list[float], arms: int, seed: int, min_zs: list[float], base: float = BASE,
             discord: float = DISCORD, rules: tuple[str, ...] = ("old", "bonferroni", "new", "final"),
             corr: float = 0.0) -> dict:
    """Per rule (old, bonferroni, new at each min_z, final): ships (arms that shipped a step > 0) and the summed true
    gain."""
    rng = np.random.default_rng(seed)
    prompts = [f"dev item {i}" for i in range(n)]
    steps = [0] + [10 * (k + 1) for k in range(len(targets))]
    gain = {s: t - base for s, t in zip(steps[1:], targets, strict=True)} | {0: 0.0}
    names = ([r for r in ("old", "bonferroni") if r in rules] + ([f"new z>={z}" for z in min_zs] if "new" in rules else [])
             + (["final"] if "final" in rules else []))
    out = {k: {"ships": 0, "gain": 0.0} for k in names}
    for _ in range(arms):
        correct = draw_arm(rng, n, base, targets, discord, corr)
        picks = {}
        if "old" in rules:
            picks["old"] = old_rule(steps, correct, prompts, [OLD_MIN_Z])[OLD_MIN_Z]
        if "bonferroni" in rules:
            picks["bonferroni"] = selection.decide(steps, correct, prompts, rule="bonferroni", alpha=ALPHA,
                                                   planned=len(targets))["selected_step"]
        if "new" in rules:
            for z in min_zs:
                picks[f"new z>={z}"] = selection.decide(steps, correct, prompts, z, rule="select_then_confirm")["selected_step"]
        if "final" in rules:
            picks["final"] = selection.decide(steps, correct, prompts, rule="final", alpha=ALPHA)["selected_step"]
        for k, s in picks.items():
            out[k]["ships"] += s > 0
            out[k]["gain"] += gain[s]
    return {k: {"rate": v["ships"] / arms, "ci": wilson(v["ships"], arms), "gain": v["gain"] / arms}
            for k, v in out.items()}


def exact_null_rate(units: int, discord: float, min_z: float) -> float:
    """P(z >= min_z) for the sign test on `units` distinct items under the null, exactly: each item discordant with
    probability `discord`, a discordant one gained or lost with probability 1/2 (the new rule's false-ship rate)."""
    total = 0.0
    for n in range(1, units + 1):
        pn = math.comb(units, n) * discord**n * (1 - discord) ** (units - n)
        if pn > 1e-15:
            total += pn * sum(math.comb(n, g) for g in range(n + 1) if (2 * g - n) / math.sqrt(n) >= min_z) / 2**n
    return total


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", type=int, default=2000, help="simulated rl runs per scenario and size")
    ap.add_argument("--items", default="384,800", help="distinct dev items, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", type=float, default=BASE, help="step 0's expected accuracy (null and gain rows)")
    ap.add_argument("--discord", type=float, default=DISCORD, help="share of items a checkpoint changes")
    a = ap.parse_args(argv)
    min_z = default_min_z()
    min_zs = [min_z] + ([2.0] if min_z != 2.0 else [])
    sizes = [int(x) for x in a.items.split(",")]
    t0 = time.time()
    print(f"# rl_selection_sim: {date.today()} {platform.node()} {platform.processor() or platform.machine()} "
          f"python {platform.python_version()}; argv {sys.argv[1:]}")
    print(f"# {a.arms} arms per row, 10 checkpoints, step 0 at {a.base} (arms A-D: {OBSERVED_STEP0}), discordance "
          f"{a.discord}; old = best of all checkpoints with z >= {OLD_MIN_Z} on all items; bonferroni = "
          f"selection.decide's default rule at alpha {ALPHA} over 10; new = select_then_confirm (select half -> "
          f"candidate, confirm half -> sign test), schema default min_z {min_z}")
    print("# arm A-D rows are parametric reconstructions of the observed curves (straight lines over the reported "
          "ranges), not the recorded items\n")
    head = f"{'scenario':<11} {'items':>5} {'halves':>8}  " + "  ".join(
        f"{k:>26}" for k in ["old z>=2.0", "bonferroni (default)"] + [f"new z>={z}" for z in min_zs] + ["final"])
    print(head)
    print(f"{'':<11} {'':>5} {'sel/conf':>8}  " + "  ".join(f"{'ships [95% CI]  gain':>26}" for _ in range(3 + len(min_zs))))
    for name, (base, targets, corr) in scenarios(a.base).items():
        for i, n in enumerate(sizes):
            sel, conf = selection.halves([f"dev item {j}" for j in range(n)])
            r = simulate(n, targets, a.arms, a.seed + 1000 * i, min_zs, base=base, discord=a.discord, corr=corr)
            cells = [f"{v['rate']:6.3f} [{v['ci'][0]:.3f},{v['ci'][1]:.3f}] {100 * v['gain']:+5.2f}" for v in r.values()]
            print(f"{name:<11} {n:>5} {len(sel):>3}/{len(conf):<4}  " + "  ".join(f"{c:>26}" for c in cells), flush=True)
    print("\n# the new rule's null rate exactly (one sign test on the confirm half; binomial, not simulated):")
    units = sorted({96, 148, *(len(selection.halves([f"dev item {j}" for j in range(n)])[1]) for n in sizes)})
    print(f"#   (148: the confirm half of small's 384 dev items, 298 distinct prompts; discordance {a.discord})")
    for c in sorted({1.645, 1.7, 2.0, *min_zs}):
        rates = [f"{u} items {exact_null_rate(u, a.discord, c):.4f}" for u in units]
        print(f"#   min_z {c:<5}: " + ", ".join(rates))
    print(f"\n# ships: share of arms that shipped a checkpoint (null: false ships; else power); gain: mean true gain "
          f"shipped, points.\n# {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
