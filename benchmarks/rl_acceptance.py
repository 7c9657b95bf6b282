"""RL's acceptance (issues #23, #40) read from bench.json files: rl against sft, per seed, and a null arm.

    # one chain per rl seed from the same sft model (jobs: dormouse plan --preset small --stage rl --set rl.seed=1 ...)
    .venv/bin/python -m benchmarks.rl_acceptance --bench s0/bench.json s1/bench.json s2/bench.json \
        --null null/bench.json --out rl_acceptance.json

A seed passes when its shipped rl model answers the held-out items better than sft by the paired sign test
(bench.json `paired.rl_vs_sft`, z >= --min-z, default 2), its sampled accuracy is at or above sft's, and its corpus
BPB is within --max-bpb-rise (default 0.05) of sft's. The acceptance holds when every seed passes, there are at
least --min-seeds (default 3) distinct rl runs of one sft model and, when --null is given (the same rl with
rl.shuffle_rewards: the rewards permuted within each group), the null arm's held-out z is below --null-max-z (default
1) on the same sft model and its dev curve (bench.json's selection.curve) ran past step 0 and ends no higher than step
0's: the gain is RL's, not the selection's, and the null arm trained rather than shipping an untouched model.
The pooled row sums the seeds' gained and lost items (the same held-out items in every seed, so it is a summary,
not a test). Exit 0 when accepted, 1 when not, 2 on bad
input. --plot PNG draws every arm's dev curve (selection.curve from its bench.json's upstream rl: dev accuracy at
step 0 and each checkpoint), the shipped step marked, the null arm dashed. When rl ran but no bench did (a device
call's time ran out), `--logs <arm>_rl.log ... --plot PNG` draws the same curves from rl's logs alone (an arm named
null_* dashed) and judges nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from dormouse.posttrain.task_eval import sign_z  # noqa: E402


def seed_row(path: Path, bench: dict, min_z: float, max_bpb_rise: float) -> dict:
    try:
        sft, rl, paired = bench["stages"]["sft"], bench["stages"]["rl"], bench["paired"]["rl_vs_sft"]
        sampled = [s["tasks_gen"].get("sampled", {}).get("accuracy") for s in (sft, rl)]
        rl_final = bench["upstream"]["rl"]["final"] or {}
        row = {
            "bench": str(path),
            "rl": bench["upstream"]["rl"]["digest"],
            "sft": bench["upstream"]["sft"]["digest"],
            "selected_step": (rl_final.get("selection") or {}).get("selected_step"),
            "greedy_sft": sft["tasks_gen"]["accuracy"], "greedy_rl": rl["tasks_gen"]["accuracy"],
            "gained": paired["gained"], "lost": paired["lost"],
            "sampled_sft": sampled[0], "sampled_rl": sampled[1],
            "bpb_sft": sft["bpb"], "bpb_rl": rl["bpb"],
        }
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: no {e} (bench.json format 3 has stages.sft/rl with tasks_gen, paired.rl_vs_sft and "
                         "upstream.sft/rl)") from None
    g, lost = row["gained"], row["lost"]
    z = sign_z(g, lost)  # from the counts: bench.json's z is rounded
    row["z"] = round(z, 3)
    checks = {
        "z": z >= min_z,
        "sampled_up": None not in sampled and sampled[1] >= sampled[0],
        "bpb_within": rl["bpb"] - sft["bpb"] <= max_bpb_rise,
    }
    return {**row, "checks": checks, "passes": all(checks.values())}


def accept(benches: dict[Path, dict], min_z: float = 2.0, max_bpb_rise: float = 0.05, min_seeds: int = 3,
           null: tuple[Path, dict] | None = None, null_max_z: float = 1.0) -> dict:
    rows = [seed_row(p, b, min_z, max_bpb_rise) for p, b in benches.items()]
    gained, lost = sum(r["gained"] for r in rows), sum(r["lost"] for r in rows)
    null_row = None
    if null is not None:
        null_row = seed_row(null[0], null[1], min_z, max_bpb_rise)
        # it must have trained and learnt nothing: checks past step 0 (not a step-0 ship of an arm that never ran),
        # the last no higher than step 0's dev accuracy
        curve = [tuple(p) for p in ((null[1]["upstream"]["rl"].get("final") or {}).get("selection") or {}).get("curve", [])]
        trained = len(curve) >= 2 and curve[0][0] == 0 and curve[-1][0] > 0
        null_row["dev_curve"] = curve
        null_row["checks"] = {"z_below": null_row["z"] < null_max_z,
                              "same_sft": null_row["sft"] in {r["sft"] for r in rows},
                              "trained": trained,
                              "dev_not_up": trained and curve[-1][1] <= curve[0][1]}
        null_row["passes"] = all(null_row["checks"].values())
    return {
        "seeds": rows,
        "pooled": {"gained": gained, "lost": lost, "z": round(sign_z(gained, lost), 3)},
        "null": null_row,
        "one_sft": len({r["sft"] for r in rows}) == 1,
        "distinct_rl": len({r["rl"] for r in rows}) == len(rows),
        "criteria": {"min_z": min_z, "max_bpb_rise": max_bpb_rise, "min_seeds": min_seeds, "null_max_z": null_max_z},
        # seeds of one sft model, each its own rl run: one bench.json given twice is one seed
        "accepted": len({r["rl"] for r in rows}) >= min_seeds and len({r["sft"] for r in rows}) == 1
                    and all(r["passes"] for r in rows) and (null_row is None or null_row["passes"]),
    }


def heldout_cells(preset: str) -> tuple[list[str], set[str]]:
    """The preset's held-out items' cells (family@difficulty) in bench's item order, and the cells rl skips. The
    preset is read from the working directory's config/ where it has one (a Snakemake workdir), else the checkout's."""
    from dormouse.core.config import load_preset
    from dormouse.posttrain import task_eval
    from dormouse.posttrain.settings import TaskSettings

    here = Path.cwd()
    p = load_preset(preset, here if (here / "config" / "presets" / f"{preset}.yaml").exists()
                    else Path(__file__).resolve().parents[1])
    items = task_eval.heldout_items(TaskSettings.of(p["tasks"]))
    return [f"{it.family}@{it.difficulty}" for it in items], set(p["rl"].get("skip_cells", []))


def cell_flips(bench: dict, cells: list[str], skipped: set[str]) -> dict:
    """Where rl's held-out items flipped against sft's, per cell (gained, lost), and the paired z over the cells rl
    trains and over those it skips: a seed's gain can be the trained cells' while the untrained ones drift."""
    sft, rl = (bench["stages"][s]["tasks_gen"]["items_correct"] for s in ("sft", "rl"))
    if len(sft) != len(cells) or dict(sorted(Counter(cells).items())) != bench.get("heldout_cells", dict(Counter(cells))):
        raise ValueError(f"{len(sft)} held-out items in bench.json, {len(cells)} in the preset's tasks (or other cells): "
                         "not this bench's preset")
    per = {}
    for c, a, b in zip(cells, sft, rl, strict=True):
        g, lost = per.get(c, (0, 0))
        per[c] = (g + (a < b), lost + (a > b))
    out = {"cells": per}
    for part, keep in (("trained", lambda c: c not in skipped), ("skipped", lambda c: c in skipped)):
        g, lost = (sum(v[i] for c, v in per.items() if keep(c)) for i in (0, 1))
        out[part] = {"gained": g, "lost": lost, "z": round(sign_z(g, lost), 3)}
    return out


def dev_curves(benches: dict[Path, dict], null: tuple[Path, dict] | None) -> list[dict]:
    """Per arm: its label, rl digest, dev curve [(step, accuracy)], shipped step, and whether it is the null arm."""
    arms = [(p, b, False) for p, b in benches.items()] + ([(null[0], null[1], True)] if null else [])
    out = []
    for path, bench, is_null in arms:
        sel = ((bench["upstream"]["rl"].get("final") or {}).get("selection")) or {}
        out.append({"label": f"{'null ' if is_null else ''}{path.stem} ({bench['upstream']['rl']['digest'][:8]})",
                    "curve": [tuple(p) for p in sel.get("curve", [])], "selected": sel.get("selected_step"),
                    "null": is_null})
    return out


def curve_of_log(path: Path) -> dict:
    """One arm's dev curve from its rl log: step 0 from the `[rl] dev@0:` line (logs before it have none: their
    `[rl] start:` line is the held-out set, not dev, so the curve starts at the first checkpoint), each checkpoint
    from a metrics row."""
    text = path.read_text()
    if not re.search(r"^\[rl\] (start|params)", text, re.M):
        raise ValueError(f"{path}: no '[rl] start' or '[rl] params' line (not an rl log?)")
    step0 = re.search(r"^\[rl\] dev@0: accuracy ([0-9.]+)", text, re.M)
    chosen = re.search(r"^\[rl\] selected step (\d+) of", text, re.M)
    curve = [(0, float(step0.group(1)))] if step0 else []
    for line in text.splitlines():
        if line.startswith('[rl] {"step"'):
            row = json.loads(line[len("[rl] "):])
            if row.get("dev_accuracy") is not None:
                curve.append((row["step"], row["dev_accuracy"]))
    arm = path.name.removesuffix(".log").removesuffix("_rl")
    return {"label": arm, "curve": curve, "selected": int(chosen.group(1)) if chosen else None,
            "null": arm.startswith("null")}


def plot_dev_curves(curves: list[dict], path: Path) -> None:
    """One PNG: each arm's dev accuracy per checkpoint, its shipped step a filled marker (matplotlib's Agg canvas)."""
    from dormouse.core.figures import new_figure, save

    fig, (ax,) = new_figure(8, 4.5)
    for arm in curves:
        if not arm["curve"]:
            continue
        steps, accs = zip(*arm["curve"], strict=True)
        line, = ax.plot(steps, accs, "--" if arm["null"] else "-", marker="o", markersize=3, label=arm["label"])
        if arm["selected"] in steps:
            ax.plot([arm["selected"]], [accs[steps.index(arm["selected"])]], "o", markersize=9, color=line.get_color(),
                    markerfacecolor="none")
    ax.set_xlabel("rl step (0: the sft model)")
    ax.set_ylabel("dev greedy accuracy (distinct prompts)")
    ax.set_title("rl dev curves; the ring marks the step that shipped")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, nargs="+", help="bench.json files, one per rl seed")
    ap.add_argument("--logs", type=Path, nargs="+", help="rl logs (<arm>_rl.log): only --plot their dev curves")
    ap.add_argument("--min-z", type=float, default=2.0)
    ap.add_argument("--max-bpb-rise", type=float, default=0.05)
    ap.add_argument("--min-seeds", type=int, default=3)
    ap.add_argument("--null", type=Path, default=None, help="the null arm's bench.json (rl.shuffle_rewards)")
    ap.add_argument("--null-max-z", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="PNG of every arm's dev curve")
    ap.add_argument("--preset", default=None, help="the benches' preset: also each seed's held-out flips per cell, and "
                                                   "the paired z over the cells rl trains and over those it skips")
    args = ap.parse_args(argv)
    if args.logs:
        if not args.plot:
            ap.error("--logs draws dev curves: give --plot PNG")
        try:
            curves = [curve_of_log(p) for p in args.logs]
        except (OSError, ValueError) as e:
            print(f"rl_acceptance: {e}", file=sys.stderr)
            return 2
        plot_dev_curves(curves, args.plot)
        for c in curves:
            print(f"{c['label']}: " + " ".join(f"{s}:{a:.4f}" for s, a in c["curve"]) + f"; shipped step {c['selected']}")
        return 0
    if not args.bench:
        ap.error("give --bench (the acceptance) or --logs with --plot (dev curves only)")
    try:
        benches = {p: json.loads(p.read_text()) for p in args.bench}
        null = (args.null, json.loads(args.null.read_text())) if args.null else None
        result = accept(benches, args.min_z, args.max_bpb_rise, args.min_seeds, null, args.null_max_z)
        if args.preset:
            cells, skipped = heldout_cells(args.preset)
            for row, bench in zip(result["seeds"], benches.values(), strict=True):
                row["flips"] = cell_flips(bench, cells, skipped)
    except (OSError, json.JSONDecodeError, ValueError) as e:
        print(f"rl_acceptance: {e}", file=sys.stderr)
        return 2
    for r in result["seeds"]:
        print(f"{r['rl']} (step {r['selected_step']}): greedy {r['greedy_sft']:.4f} -> {r['greedy_rl']:.4f} "
              f"(+{r['gained']} -{r['lost']}, z {r['z']:+.2f}); sampled {r['sampled_sft']} -> {r['sampled_rl']}; "
              f"bpb {r['bpb_sft']:.4f} -> {r['bpb_rl']:.4f}; {'PASS' if r['passes'] else 'FAIL'} {r['checks']}")
    for r in result["seeds"]:
        if "flips" in r:
            f = r["flips"]
            print(f"  {r['rl']} per cell: " + " ".join(f"{c} +{g}-{lost}" for c, (g, lost) in f["cells"].items())
                  + "; trained cells +{gained} -{lost} z {z:+.2f}".format(**f["trained"])
                  + "; skipped cells +{gained} -{lost} z {z:+.2f}".format(**f["skipped"]))
    if result["null"] is not None:
        n = result["null"]
        print(f"null arm {n['rl']} (step {n['selected_step']}): greedy {n['greedy_sft']:.4f} -> {n['greedy_rl']:.4f} "
              f"(+{n['gained']} -{n['lost']}, z {n['z']:+.2f}); dev "
              + " ".join(f"{s}:{a:.4f}" for s, a in n["dev_curve"]) + f"; {'PASS' if n['passes'] else 'FAIL'} {n['checks']}")
    p = result["pooled"]
    print(f"pooled over {len(result['seeds'])} seeds: +{p['gained']} -{p['lost']}, z {p['z']:+.2f}; "
          f"{'one sft model' if result['one_sft'] else 'several sft models'}; "
          f"{'ACCEPTED' if result['accepted'] else 'NOT ACCEPTED'}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot_dev_curves(dev_curves(benches, null), args.plot)
    return 0 if result["accepted"] else 1


if __name__ == "__main__":
    sys.exit(main())
