"""Per-preset result files (`results/<view>/anchors.json`): a stage's result plus its digest chain.

The view folder is the preset's name, or `<preset>@<tag>` for a run with overrides (dormouse.planner.plan,
Plan.view_name); each file records the overrides it was made with, so a one-off run says what it was.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dormouse.tools import history
from dormouse.core.config import ConfigError
from dormouse.core.store import open_artifact


def digest_chain(artifact_dir: Path, store: Path) -> list[dict]:
    """The artifact and every upstream artifact (verified), downstream first."""
    chain, todo, seen = [], [Path(artifact_dir)], set()
    while todo:
        art = open_artifact(todo.pop(0))
        if art.digest in seen:
            continue
        seen.add(art.digest)
        chain.append({
            "stage": art.stage,
            "digest": art.digest,
            "retractions": art.manifest["retractions"],
            "inputs": art.manifest["inputs"],
            "git_commit": art.manifest["code"]["git_commit"],
        })
        for name, digest in art.manifest["inputs"].items():
            # an input is named for its stage, but for bench's export_ptq (a QAT chain's twin): the digest says
            candidate = next((d for d in (store / name / digest, *sorted(store.glob(f"*/{digest}")))
                              if (d / "manifest.json").exists()), None)
            if candidate is not None:
                todo.append(candidate)
    return chain


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse view")
    ap.add_argument("kind", choices=["anchors", "pretrain", "bench"])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--view", default=None, help="the view folder's name (default: the preset's)")
    ap.add_argument("--overrides", type=json.loads, default={},
                    help="the run's overrides as JSON (Plan.overrides), recorded in the view")
    ap.add_argument("--artifact", required=True, help="the artifact's directory or manifest.json")
    ap.add_argument("--store", default="results/store")
    ap.add_argument("--out", required=True)
    ap.add_argument("--history", type=Path, default=None,
                    help="pretrain: also append the run to this benchmark history (dormouse history), once per digest")
    args = ap.parse_args(argv)
    art = open_artifact(args.artifact, stage=args.kind)
    if args.kind == "anchors":
        result = json.loads(art.file("anchors.json").read_text())
    elif args.kind == "bench":
        result = {**json.loads(art.file("bench.json").read_text()), "environment": art.manifest["environment"],
                  "code": art.manifest["code"], "bench_counters": art.manifest["counters"],
                  "bench_wall_time_s": art.manifest["wall_time_s"]}
    else:
        metrics = [json.loads(line) for line in art.file("metrics.jsonl").read_text().splitlines()]
        result = {
            **art.manifest["final"],
            "eval_curve": [{"step": m["step"], "eval_bpb": m["eval_bpb"]} for m in metrics if "eval_bpb" in m],
            "counters": art.manifest["counters"],
        }
    chain = digest_chain(art.path, Path(args.store))
    view = {
        "preset": args.preset,
        "view": args.view or args.preset,
        "overrides": args.overrides,
        **result,
        "digest_chain": chain,
        "retractions_applied": sorted({r for link in chain for r in link["retractions"]}),
    }
    out = Path(args.out)
    recorded = json.loads(out.read_text()).get("overrides") if out.exists() else None
    if recorded is not None and recorded != args.overrides:  # a label reused: never replace another run's view
        raise ConfigError(f"{out}: holds the view of a run with overrides {recorded}, not {args.overrides}; "
                          f"name another label (results/{args.preset}@<label>/)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(view, indent=2) + "\n")
    tmp.replace(out)
    if args.kind == "pretrain" and args.history is not None:
        added = history.append(args.history, history.entry_from_artifact(art.path))
        print(f"[view] history {args.history}: {'appended' if added else 'already there'} ({art.path.name})")
    return 0
