"""What a run found, in a few lines: printed by Snakemake when a run succeeds (Snakefile `onsuccess`) for every
results/<preset>/bench.json the run wrote, and by `dormouse headline [bench.json ...]` at any time.

    dormouse headline results/tiny/bench.json
    dormouse headline --since 1733400000          # every results/*/bench.json written after that epoch second

Per preset: pretrain's eval BPB against the best n-gram anchor on the same window, held-out task accuracy per stage
with rl's paired test against sft and the step rl shipped, the eval tail's share of the text, every upstream stage's
warnings (a capped or small eval tail), each export rung's BPB, and where to look next.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def _anchor(bench: dict) -> dict | None:
    ladder = (bench.get("anchors") or {}).get("ladder") or []
    return min(ladder, key=lambda a: a["bpb"]) if ladder else None


def headline(bench: dict, path: str | Path) -> list[str]:
    """The lines for one bench.json (format 4 or 5)."""
    preset, stages = bench.get("preset", "?"), bench["stages"]
    overrides = bench.get("overrides") or {}  # a one-off run's (results/<preset>@<tag>/): said, not implied
    said = "; overrides " + ", ".join(f"{k}={v}" for k, v in overrides.items()) if overrides else ""
    lines = [f"[dormouse] {path} (preset {preset}{said}):"]
    pre, best = stages["pretrain"]["bpb"], _anchor(bench)
    if best is not None:
        side = "below" if pre < best["bpb"] else "above"
        lines.append(f"  pretrain eval BPB {pre:.4f}: {abs(pre - best['bpb']):.4f} {side} the best n-gram anchor "
                     f"({best['name']}, order {best['order']}: {best['bpb']:.4f}) on the same "
                     f"{bench['eval_window']['bytes']} bytes")
    acc = ", ".join(f"{s} {stages[s]['tasks_gen']['accuracy']:.3f}" for s in ("pretrain", "sft", "rl") if s in stages)
    rl_vs_sft = bench.get("paired", {}).get("rl_vs_sft", {})
    selection = ((bench.get("upstream", {}).get("rl", {}).get("final") or {}).get("selection")) or {}
    lines.append(f"  held-out task accuracy ({bench.get('heldout_items')} items): {acc}; rl vs sft +{rl_vs_sft.get('gained')}"
                 f" -{rl_vs_sft.get('lost')} (z {rl_vs_sft.get('z')}), rl shipped step {selection.get('selected_step')}")
    shard = (bench.get("upstream") or {}).get("shard") or {}
    sc = shard.get("counters") or {}
    if sc.get("bytes_in"):
        lines.append(f"  eval tail {sc['eval_bytes']} bytes ({sc['eval_bytes'] / sc['bytes_in']:.1%} of the sharded text,"
                     f" {sc['eval_docs']} documents); {sc['train_bytes']} bytes train")
    for stage, up in (bench.get("upstream") or {}).items():
        lines += [f"  WARNING ({stage}): {w}" for w in up.get("warnings") or []]
    rungs = bench.get("rungs") or {}
    if rungs:
        lines.append("  export rungs, BPB: " + ", ".join(f"{r} {v['bpb']:.4f}" for r, v in rungs.items()))
    # serve takes set and corpus as --set/--corpus (dormouse.planner.plan.add_plan_arguments): the same rl model
    serve = f"dormouse serve --preset {preset}" + "".join(f" --{k} {shlex.quote(str(v))}" for k, v in overrides.items()
                                                           if k in ("set", "corpus"))
    lines.append(f"  next: {Path(path).parent}/plots/ (curves, rungs, tasks); {serve}; snakemake --report report.html")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse headline", description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", nargs="*", type=Path, help="bench.json files (default: results/*/bench.json)")
    ap.add_argument("--since", type=float, default=None, help="only files written after this epoch second")
    args = ap.parse_args(argv)
    paths = args.bench or sorted(Path("results").glob("*/bench.json"))
    if args.since is not None:
        paths = [p for p in paths if p.stat().st_mtime >= args.since]
    for p in paths:
        try:
            bench = json.loads(p.read_text())
            print("\n".join(headline(bench, p)))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            print(f"dormouse headline: {p}: cannot read a bench.json ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    return 0
