"""`dormouse plan`: the digest chain of each preset, or one job's JSON for running a stage by hand.

    dormouse plan                                   # every preset: stage -> digest
    dormouse filter --job "$(dormouse plan --preset tiny --stage filter)"
    dormouse plan --preset small --stage rl --set rl.seed=1         # a job with a preset override
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dormouse.planner.plan import add_plan_arguments, describe_overrides, plan_from_args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(ap)
    ap.add_argument("--preset")
    ap.add_argument("--stage")
    args = ap.parse_args(argv)
    plan = plan_from_args(args)
    config = plan.config
    if args.preset and args.preset not in plan.chain:
        raise SystemExit(f"dormouse plan: no preset {args.preset!r} in the plan (presets: {', '.join(plan.presets)}; "
                         f"a new one goes in config/presets/ and config.yaml's presets)")
    if args.stage:
        preset = args.preset or config["preset"]
        if args.stage not in plan.chain[preset]:
            raise SystemExit(f"dormouse plan: no stage {args.stage!r} (stages: {', '.join(plan.chain[preset])})")
        print(plan.job_json(args.stage, plan.chain[preset][args.stage]))
        return 0
    if plan.overrides:  # on stderr: stdout stays the table (or the job's JSON)
        preset = args.preset or config["preset"]
        view = plan.view_name(preset)
        print(f"dormouse plan: {describe_overrides(plan.overrides)}: " + (
            f"{preset}'s views of such a run go to results/{view}/ (results/{preset}/ stays the preset's own)"
            if view != preset else f"no digest of {preset} changes; its views stay results/{preset}/"), file=sys.stderr)
    for preset, stages in plan.chain.items():
        if args.preset and preset != args.preset:
            continue
        for stage, digest in stages.items():
            done = Path(plan.manifest_path(stage, digest)).exists()
            note = passes_note(plan, stages) if stage == "pretrain" else ""
            print(f"{preset:8s} {stage:8s} {digest} {'built' if done else 'missing'}{note}")
    return 0


def passes_note(plan, stages: dict) -> str:
    """A preset's planned passes over its train shards, once its shard artifact exists (the stage refuses past
    train.max_epochs)."""
    shard = Path(plan.manifest_path("shard", stages["shard"]))
    if not shard.exists():
        return "  (passes over the train shards: known once the shard is built)"
    from dormouse.data.byte_stream import planned_epochs  # imports torch: only once a shard exists
    from dormouse.data.shards import train_bytes

    n = train_bytes(json.loads(shard.read_text()))
    train = plan.job("pretrain", stages["pretrain"]).params["train"]
    passes = planned_epochs(n, train["batch_size"], train["seq_len"], train["steps"])
    cap = train["max_epochs"]
    verdict = "REFUSED by the stage: past max_epochs" if cap is not None and passes > cap else "within max_epochs"
    return f"  passes {passes:.2f} over {n:,} train bytes ({verdict} {cap})"
