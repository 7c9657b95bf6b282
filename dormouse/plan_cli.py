"""`dormouse plan`: the digest chain of each preset, or one job's JSON for running a stage by hand.

    dormouse plan                                   # every preset: stage -> digest
    dormouse filter --job "$(dormouse plan --preset tiny --stage filter)"
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dormouse.config import load_yaml
from dormouse.plan import build_plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--corpus", help="override config corpus (as snakemake --config corpus=...)")
    ap.add_argument("--preset")
    ap.add_argument("--stage")
    args = ap.parse_args(argv)
    config = load_yaml(Path(args.config))
    if args.corpus:
        config["corpus"] = args.corpus
    plan = build_plan(config)
    if args.stage:
        preset = args.preset or config["preset"]
        print(plan.job_json(args.stage, plan.chain[preset][args.stage]))
        return 0
    for preset, stages in plan.chain.items():
        if args.preset and preset != args.preset:
            continue
        for stage, digest in stages.items():
            done = Path(plan.manifest_path(stage, digest)).exists()
            print(f"{preset:8s} {stage:8s} {digest} {'built' if done else 'missing'}")
    return 0
