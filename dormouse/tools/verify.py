"""`dormouse verify`: re-hash finished artifacts against their manifests; exit 1 naming every altered file.

    dormouse verify                       # every artifact in the store
    dormouse verify --stage shard         # one stage's artifacts
    dormouse verify --preset tiny         # the artifacts of one preset's chain (those built)

A consumer stage checks the size of every file its inputs list and the sha256 of the files it reads, when it runs;
this hashes every file any manifest lists (`*.ids.jsonl` included), whether or not a stage will read it again, and
checks that no file on disk is unlisted, that `manifest.json` equals its `.manifest.json` copy and names the digest
its params, inputs and retractions give (an edited manifest), and, for --preset, that no artifact of the chain is
missing under one built on it. An unreadable manifest is one problem line, and the rest of the store is still
checked.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from dormouse.core.store import MANIFEST, MANIFEST_KEEP, artifact_digest, file_problem


def artifact_problems(path: Path) -> list[str]:
    """What is wrong with one artifact directory ([] when every file matches its manifest)."""
    manifest_path = path / MANIFEST if (path / MANIFEST).exists() else path / MANIFEST_KEEP
    if not manifest_path.exists():
        return [f"{path}: no {MANIFEST}; not a finished artifact"]
    problems = []
    if manifest_path.name == MANIFEST_KEEP:
        problems.append(f"{path / MANIFEST}: missing ({MANIFEST_KEEP} holds it; running its job puts it back without "
                        f"recomputing: snakemake '{path / MANIFEST}')")
    try:
        manifest = json.loads(manifest_path.read_text())
        keys = ("stage", "format_version", "params", "inputs", "retractions", "files")
        missing = [k for k in keys if k not in manifest]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        return problems + [f"{manifest_path}: unreadable manifest ({type(e).__name__}: {e})"]
    keep = path / MANIFEST_KEEP
    if manifest_path.name == MANIFEST and keep.exists() and keep.read_bytes() != manifest_path.read_bytes():
        problems.append(f"{manifest_path}: differs from its {MANIFEST_KEEP} copy (edited after it was published)")
    if manifest.get("digest") != path.name:
        problems.append(f"{manifest_path}: digest {manifest.get('digest')!r} does not match its directory")
    elif artifact_digest(manifest["stage"], manifest["format_version"], manifest["params"], manifest["inputs"],
                         manifest["retractions"]) != path.name:
        problems.append(f"{manifest_path}: its stage, params, inputs and retractions give another digest than "
                        f"{path.name} (an edited manifest)")
    for name, meta in sorted(manifest.get("files", {}).items()):
        if problem := file_problem(path / name, meta):
            problems.append(f"{path / name}: {problem}")
    listed = {*manifest.get("files", {}), MANIFEST, MANIFEST_KEEP}
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.relative_to(path).as_posix() not in listed:
            problems.append(f"{p}: not in the manifest")
    return problems


def artifact_dirs(store: Path, stage: str | None = None, digests: dict[str, str] | None = None) -> list[Path]:
    if digests is not None:
        dirs = [store / s / d for s, d in digests.items() if stage in (None, s)]
        return [d for d in dirs if (d / MANIFEST).exists() or (d / MANIFEST_KEEP).exists()]
    stages = [store / stage] if stage else sorted(p for p in store.iterdir() if p.is_dir()) if store.is_dir() else []
    return sorted(d for s in stages for d in s.iterdir() if d.is_dir() and not d.name.startswith("."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", help="only this stage's artifacts")
    ap.add_argument("--preset", help="only the artifacts of this preset's digest chain")
    ap.add_argument("--config", help="config.yaml (default: config/config.yaml of the clone around the cwd)")
    ap.add_argument("--store", help="the store (default: the config's `store`)")
    args = ap.parse_args(argv)
    store = Path(args.store) if args.store else None
    digests = None
    if args.preset or store is None:
        from dormouse.planner.plan import load_plan

        plan = load_plan(args.config, **({"store": args.store} if store else {}))
        store = Path(plan.store)
    if args.preset:
        if args.preset not in plan.chain:
            raise SystemExit(f"dormouse verify: no preset {args.preset!r} in the plan ({', '.join(plan.chain)})")
        digests = plan.chain[args.preset]
    dirs = artifact_dirs(store, args.stage, digests)
    bad = 0
    if digests is not None:  # a hole in the chain: an input artifact moved away under one built on it
        def present(p: Path) -> bool:
            return (p / MANIFEST).exists() or (p / MANIFEST_KEEP).exists()

        holes: dict[Path, str] = {}
        for s, d in digests.items():
            if present(store / s / d):
                for inp in plan.job(s, d).inputs.values():
                    if inp["kind"] == "artifact" and args.stage in (None, inp["stage"]):
                        gone = store / inp["stage"] / inp["digest"]
                        if not present(gone):
                            holes.setdefault(gone, f"{s} {d}")
        for gone, user in holes.items():
            bad += 1
            # Snakemake (since 7.7) reruns no job for a missing intermediate while the outputs built on it exist
            print(f"{gone}: missing, while {user}, built on it, is present (moved or deleted?); snakemake does not "
                  f"rebuild it by itself: snakemake {shlex.quote(str(gone / MANIFEST))}", flush=True)
    for d in dirs:
        problems = artifact_problems(d)
        bad += bool(problems)
        for line in problems:
            print(line, flush=True)
    print(f"dormouse verify: {len(dirs)} artifact(s) in {store}, {bad} with problems", flush=True)
    return 1 if bad else 0
