"""`dormouse plan`: the digest chain of each preset, or one job's JSON for running a stage by hand.

    dormouse plan                                   # every preset: stage -> digest
    dormouse filter --job "$(dormouse plan --preset tiny --stage filter)"
    dormouse plan --preset small --stage rl --set rl.seed=1         # a job with a preset override
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dormouse.engine.plan import load_plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="config.yaml (default: config/config.yaml of the clone around the cwd)")
    ap.add_argument("--corpus", help="override config corpus (as snakemake --config corpus=...)")
    ap.add_argument("--set", help="preset overrides, 'key=value,...' (as snakemake --config set=...)")
    ap.add_argument("--preset")
    ap.add_argument("--stage")
    args = ap.parse_args(argv)
    plan = load_plan(args.config, args.set, **({"corpus": args.corpus} if args.corpus else {}))
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
