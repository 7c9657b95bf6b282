"""What every stage entry point shares: parse `--job`, verify its inputs, open its artifact writer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dormouse.core import progress
from dormouse.data.raw import raw_input
from dormouse.core.store import Artifact, ArtifactError, ArtifactWriter, open_artifact, published


def parse_job(argv: list[str] | None, stage: str, doc: str) -> dict:
    ap = argparse.ArgumentParser(prog=f"dormouse {stage}", description=doc)
    ap.add_argument("--job", required=True, help="job JSON (as printed by `dormouse plan`), or @file holding it")
    ap.add_argument("--presets", default="", help="the presets that plan this job, comma-separated (for messages; no param)")
    ap.add_argument("--terminal-progress", action="store_true",
                    help="stderr is what a person sees: keep it for progress lines, send the rest to stdout (the log)")
    args = ap.parse_args(argv)
    if args.terminal_progress:
        progress.to_terminal()
    job = read_job(args.job, stage)
    job["presets"] = [p for p in args.presets.split(",") if p]
    print(f"[{stage}] job {job['digest']}\n[{stage}] params {json.dumps(job['params'], sort_keys=True)}", flush=True)
    # Already built (Snakemake deleted manifest.json before this rerun, or after a failed job): the artifact is
    # verified and left untouched, and the job succeeds. An altered one raises ArtifactError (never rebuilt over).
    if published(Path(job["out"])) is not None:
        print(f"[{stage}] {job['out']}: already published with this digest, every file verified; nothing to do", flush=True)
        raise SystemExit(0)
    return job


JOB_KEYS = ("stage", "format_version", "digest", "params", "inputs", "retractions", "out")


def read_job(arg: str, stage: str) -> dict:
    """--job's value: JSON text, @file, or a path to a file holding it; one line naming the problem otherwise."""
    hint = f"pass the output of `dormouse plan --preset <preset> --stage {stage}` (the text, @file or a file path)"
    path = Path(arg[1:]) if arg.startswith("@") else Path(arg) if not arg.lstrip().startswith("{") else None
    if path is not None:
        if not path.is_file():
            raise SystemExit(f"dormouse {stage}: --job {arg!r} is neither JSON nor a file; {hint}")
        arg = path.read_text()
    try:
        job = json.loads(arg)
    except json.JSONDecodeError as e:
        raise SystemExit(f"dormouse {stage}: --job is not JSON ({e}); {hint}") from None
    missing = [k for k in JOB_KEYS if not isinstance(job, dict) or k not in job]
    if missing:
        raise SystemExit(f"dormouse {stage}: --job lacks {', '.join(missing)}; {hint}")
    if job["stage"] != stage:
        raise SystemExit(f"dormouse {stage}: the job is for stage {job['stage']!r}: run `dormouse {job['stage']} --job ...`")
    return job


def input_artifact(job: dict, name: str) -> Artifact:
    """Open an upstream artifact: it is the digest the plan named and every file it lists is on disk at its listed
    size, checked now, before the stage reads any of it; each file the stage reads is hashed on its first read."""
    inp = job["inputs"][name]
    art = open_artifact(Path(job["out"]).parent.parent / inp["stage"] / inp["digest"], stage=inp["stage"])
    if art.digest != inp["digest"]:
        raise ArtifactError(f"{art.path}: digest {art.digest} != planned {inp['digest']}")
    return art.check_sizes()


def check_raw_input(job: dict, name: str) -> list[str]:
    """Raw inputs must still be what the plan fingerprinted (files may change between plan and run)."""
    inp = job["inputs"][name]
    now = raw_input(inp["specs"])
    if now["digest"] != inp["digest"]:
        raise ArtifactError(
            f"raw input {name} {inp['specs']} changed since the plan was made "
            f"(fingerprint {now['digest']} != {inp['digest']}); rerun snakemake to re-plan"
        )
    return inp["specs"]


def writer(job: dict) -> ArtifactWriter:
    return ArtifactWriter(
        Path(job["out"]),
        job["stage"],
        job["format_version"],
        job["params"],
        {k: v["digest"] for k, v in job["inputs"].items()},
        job["retractions"],
    )


def summary(stage: str, counters) -> None:
    for k, v in sorted(counters.items()):
        print(f"[{stage}] {k}: {v}", file=sys.stdout)
