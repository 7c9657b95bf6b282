"""`dormouse retractions`: the ledger, what each entry hits now, and what it superseded on disk.

    dormouse retractions                 # every entry, every preset
    dormouse retractions --preset tiny

An entry's id enters the digest of the jobs of its stage whose params match (dormouse.planner.plan), so the
artifacts built before the entry existed keep their old digests. This command finds them: an
artifact on disk is superseded by an entry when the entry matches its params and its manifest does
not list the id, or when one of its inputs is superseded. Its new digest is recomputed from its own
manifest with the id (or the superseded inputs' new digests) put in.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dormouse.planner.plan import load_plan, matching_retractions
from dormouse.planner.registry import STAGES
from dormouse.core.store import artifact_digest


def load_store(store: Path) -> dict[tuple[str, str], dict]:
    """(stage, digest) -> manifest for every finished artifact (manifests only; files not hashed)."""
    out = {}
    for stage in STAGES:
        for mpath in sorted((store / stage).glob("*/manifest.json")):
            m = json.loads(mpath.read_text())
            out[(stage, m["digest"])] = m
    return out


def superseded(entry: dict, manifests: dict[tuple[str, str], dict]) -> list[dict]:
    """Artifacts on disk that this entry retracts, in chain order, each with its replacement digest."""
    new_digest: dict[str, str] = {}  # old digest -> new digest
    rows = []
    for stage in STAGES:  # chain order: upstream replacements are known first
        own = {d: m for (s, d), m in sorted(manifests.items()) if s == stage}
        # within a stage, an input of the same stage first (a branched finish's trunk is a pretrain; one level deep)
        for digest, m in sorted(own.items(), key=lambda dm: any(v in own for v in dm[1]["inputs"].values())):
            hit = entry["stage"] == stage and entry["id"] not in m["retractions"] and matching_retractions([entry], stage, m["params"])
            inputs = {k: new_digest.get(v, v) for k, v in m["inputs"].items()}
            if not hit and inputs == m["inputs"]:
                continue
            retractions = sorted(set(m["retractions"]) | ({entry["id"]} if hit else set()))
            new = artifact_digest(stage, m["format_version"], m["params"], inputs, retractions)
            new_digest[digest] = new
            rows.append({"stage": stage, "old": digest, "new": new, "why": "matched" if hit else "upstream"})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse retractions", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="config.yaml (default: config/config.yaml of the clone around the cwd)")
    ap.add_argument("--preset", help="only this preset's hits")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    plan = load_plan(args.config)
    manifests = load_store(Path(plan.store))
    report = []
    for entry in plan.retractions:
        hits = [
            {"preset": preset, "stage": stage, "digest": digest}
            for preset, stages in plan.chain.items()
            if not args.preset or preset == args.preset
            for stage, digest in stages.items()
            if entry["id"] in plan.job(stage, digest).retractions
        ]
        report.append({**entry, "hits": hits, "superseded": superseded(entry, manifests)})
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    if not report:
        print(f"no retractions in {plan.config['retractions']}")
    for r in report:
        print(f"{r['id']} ({r['date']}) stage={r['stage']} match={json.dumps(r['match'])} fixed_in={r['fixed_in']}")
        print(f"  reason: {r['reason']}")
        for h in r["hits"] or [{"preset": "-", "stage": "-", "digest": "no planned job matches"}]:
            print(f"  hits   {h['preset']:8s} {h['stage']:8s} {h['digest']}")
        for s in r["superseded"]:
            print(f"  superseded {s['stage']:8s} {s['old']} -> {s['new']} ({s['why']})")
    return 0

