"""The benchmark history: one JSON line per pretrain artifact, and a regression gate over it.

    dormouse history                                  # the table of results/history.jsonl
    dormouse history --check                          # exit 1 if the newest run regressed
    dormouse history --add results/store/pretrain/*   # backfill from finished artifacts

An entry holds when the run finished, its digest, the comparability key (below), throughput,
peak memory, wall time, eval BPB and the git commit. Entries are appended, never rewritten; an
artifact digest appears at most once (appending it again is a no-op).

Comparability key (`KEY_FIELDS`), built from the manifest, never from the preset name:
  device       the GPU name ("NVIDIA H200") for cuda runs, "cpu" for CPU runs
  model        sha256 of the canonical JSON of params.model, 12 hex chars (shape, arms, KDA chunk)
  batch_size, seq_len, dtype, optimizer   from params.train
  torch        torch version from the manifest's environment
  cpu_threads  torch intra-op threads for CPU runs (None on cuda); the manifest does not record it,
               so unless it carries `torch_threads` it is 1: pretrain pins one thread on CPU
               (runtime.deterministic_cpu, since 790c929)
  cuda_graphs  True when the steps replayed CUDA graphs (train.cuda_graphs; the manifest's
               cuda_graphs.captures), else None: their private pools leave the allocated peak incomparable
  qat          "<rung>@<fraction>" of train.qat (a quantization-aware finish runs eagerly and quantizes every
               step, dormouse/train/qat.py); absent (None) without one
  micro_batch_size, compile   train.micro_batch_size (gradient accumulation) and train.compile when not the
               default cuda; absent (None) at their defaults, so earlier entries stay comparable
Two entries are compared only when every key field is equal.

Throughput: median `tokens_per_s` (bytes/s: the model is byte-level) over the logged rows of
metrics.jsonl after the warm-up rule drops
  - rows at step <= 10% of train.steps (LR warm-up, allocator growth, cudnn/Triton autotune),
  - the first logged row of the run, and the first row after a resume (`resumed_from_step`):
    that window holds process start-up and, on cuda, kernel autotune (191 s of one H200 run);
if that leaves nothing, every row but the first; with one row, that row. Each row's rate covers
the steps since the previous log, including any eval or checkpoint in between; the median
ignores those few slow windows.

Regression gate (`check`): the NEWEST entry (latest `created`) against the latest earlier entry
with the same key. It fails when tokens/s < previous x (1 - tolerance) or peak memory >
previous x (1 + tolerance). Default tolerance 0.10. With no earlier comparable entry it passes
and says so. Run-to-run noise on the shared 2-core dev VM is about +-30% (benchmarks/README.md),
so there the gate needs a looser --tolerance; on a dedicated GPU 10% is a real change.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from dormouse.core.store import ArtifactError, canonical_json, open_artifact

DEFAULT_HISTORY = Path("results/history.jsonl")
DEFAULT_TOLERANCE = 0.10
WARMUP_FRAC = 0.10  # rows at step <= this fraction of train.steps are warm-up
KEY_FIELDS = ("device", "model", "batch_size", "seq_len", "dtype", "optimizer", "torch", "cpu_threads", "world_size",
              "cuda_graphs", "qat", "micro_batch_size", "compile")


# -----------------------------------------------------------------------------
# entries

def model_hash(model_params: dict) -> str:
    return hashlib.sha256(canonical_json(model_params).encode()).hexdigest()[:12]


def steady_throughput(rows: list[dict], steps: int, resumed_from_step: int = 0, branched_from_step: int = 0
                      ) -> tuple[float | None, int]:
    """(median tokens/s after the warm-up rule in the module docstring, number of rows it used). A run branched from
    its trunk's checkpoint (train.branched_from_step) times only its own rows: the ones before are the trunk's."""
    timed = [r for r in rows if r.get("tokens_per_s") is not None and r["step"] > branched_from_step]
    if not timed:
        return None, 0
    first_rows = {timed[0]["step"]}
    after_resume = [r["step"] for r in timed if r["step"] > resumed_from_step]
    if resumed_from_step and after_resume:
        first_rows.add(after_resume[0])
    kept = [r for r in timed if r["step"] > WARMUP_FRAC * steps and r["step"] not in first_rows]
    if not kept:
        kept = timed[1:] or timed
    return round(statistics.median(r["tokens_per_s"] for r in kept), 1), len(kept)


def entry_from_artifact(art_dir: Path) -> dict:
    """One history entry from a finished pretrain artifact (metrics.jsonl is checked against the manifest)."""
    art = open_artifact(art_dir, stage="pretrain")
    m = art.manifest
    model, train = m["params"]["model"], m["params"]["train"]
    env, final, code, counters = m.get("environment", {}), m.get("final", {}), m.get("code", {}), m.get("counters", {})
    on_cuda = str(final.get("device", train.get("device", "cpu"))).startswith("cuda")
    # environment.device names GPU 0 of the machine even for a CPU run, so the run's own device decides
    device = (final.get("gpu") or env.get("device") or "cuda") if on_cuda else "cpu"
    cpu_threads = None if on_cuda else int(final.get("torch_threads") or env.get("torch_threads") or 1)
    rows = [json.loads(line) for line in art.file("metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = counters.get("train.steps") or train["steps"]
    tokens_per_s, n_rows = steady_throughput(rows, steps, counters.get("resumed_from_step", 0),
                                             counters.get("train.branched_from_step", 0))
    created = m["created_unix"]
    return {
        "created": datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="seconds"),
        "created_unix": created,
        "digest": m["digest"],
        "key": {
            "device": device,
            "model": model_hash(model),
            "batch_size": train["batch_size"],
            "seq_len": train["seq_len"],
            "dtype": train.get("dtype"),
            "optimizer": train.get("optimizer"),
            "torch": env.get("versions", {}).get("torch"),
            "cpu_threads": cpu_threads,
            "world_size": int(final.get("world_size") or 1),  # tokens/s sums the ranks; memory is rank 0's
            "cuda_graphs": True if counters.get("cuda_graphs.captures") else None,  # None: entries before it compare
            # only when on: entries without it (every run before it, every run without a finish) read as None
            **({"qat": f"{train['qat']['rung']}@{train['qat']['fraction']}"} if train.get("qat") else {}),
            # likewise only when set: accumulation changes the step's time and memory by design; compile off or
            # everywhere is another program than the default (cuda)
            **({"micro_batch_size": train["micro_batch_size"]} if train.get("micro_batch_size") else {}),
            **({"compile": train["compile"]} if train.get("compile", "cuda") != "cuda" else {}),
        },
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_rows": n_rows,
        "peak_memory_gib": final.get("peak_memory_gib") if on_cuda else None,
        "wall_time_s": m.get("wall_time_s"),
        "eval_bpb": final.get("eval_bpb"),
        "steps": steps,
        "params_total": final.get("params", {}).get("total"),
        "git_commit": code.get("git_commit"),
        "git_dirty": code.get("git_dirty"),
    }


def comparable_key(entry: dict) -> tuple:
    return tuple(entry["key"].get(f) for f in KEY_FIELDS)


# -----------------------------------------------------------------------------
# the history file

def _parse(text: str, path: Path) -> list[dict]:
    entries = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e}); fix or remove it by hand") from None
    return entries


def read_history(history_path: Path) -> list[dict]:
    history_path = Path(history_path)
    return _parse(history_path.read_text(), history_path) if history_path.exists() else []


def append(history_path: Path, entry: dict) -> bool:
    """Append one entry as a JSON line; False (nothing written) if its digest is already there.

    An exclusive flock spans the read-check-write, so concurrent appends from several processes
    neither interleave nor both add the same digest; the line goes out in one O_APPEND write."""
    history_path = Path(history_path)
    history_path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(entry, sort_keys=False) + "\n").encode()
    fd = os.open(history_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with open(fd, "rb", closefd=False) as f:
            existing = _parse(f.read().decode(), history_path)
        if any(e.get("digest") == entry["digest"] for e in existing):
            return False
        os.write(fd, line)
        return True
    finally:
        os.close(fd)  # releases the lock


# -----------------------------------------------------------------------------
# the regression gate

def _order(entries: list[dict]) -> list[dict]:
    """Oldest first by creation time; file order breaks ties (a backfilled old run sorts by its own time)."""
    return [e for _, e in sorted(enumerate(entries), key=lambda ie: (ie[1].get("created_unix", 0), ie[0]))]


def _ratio(new, old):
    return new / old if new is not None and old else None


def check(entries: list[dict], tolerance: float = DEFAULT_TOLERANCE) -> tuple[bool, str]:
    """Newest entry vs the latest earlier entry with the same comparable key (rule in the module docstring)."""
    if not entries:
        return True, "history is empty: nothing to check"
    ordered = _order(entries)
    new = ordered[-1]
    key = comparable_key(new)
    earlier = [e for e in ordered[:-1] if comparable_key(e) == key and e["digest"] != new["digest"]]
    head = f"newest {new['digest']} ({new['created']}, {_key_text(new)})"
    if not earlier:
        return True, f"{head}: no earlier comparable entry (same {', '.join(KEY_FIELDS)}); nothing to compare"
    old = earlier[-1]
    lines = [f"{head} vs previous {old['digest']} ({old['created']})"]
    ok = True
    tps = _ratio(new.get("tokens_per_s"), old.get("tokens_per_s"))
    if tps is None:
        lines.append("  tokens/s: missing on one side, not compared")
    else:
        bad = tps < 1 - tolerance
        ok &= not bad
        lines.append(f"  tokens/s {new['tokens_per_s']:,.0f} vs {old['tokens_per_s']:,.0f}: ratio {tps:.3f} "
                     f"(floor {1 - tolerance:.3f}) {'REGRESSION' if bad else 'ok'}")
    mem = _ratio(new.get("peak_memory_gib"), old.get("peak_memory_gib"))
    if mem is None:
        lines.append("  peak memory: not recorded (CPU run or missing), not compared")
    else:
        bad = mem > 1 + tolerance
        ok &= not bad
        lines.append(f"  peak memory {new['peak_memory_gib']:.3f} vs {old['peak_memory_gib']:.3f} GiB: ratio {mem:.3f} "
                     f"(ceiling {1 + tolerance:.3f}) {'REGRESSION' if bad else 'ok'}")
    if new.get("eval_bpb") is not None and old.get("eval_bpb") is not None:
        lines.append(f"  eval BPB {new['eval_bpb']:.4f} vs {old['eval_bpb']:.4f} (not gated)")
    return ok, "\n".join(lines)


# -----------------------------------------------------------------------------
# the table and the CLI

def _key_text(e: dict) -> str:
    k = e["key"]
    threads = f" x{k['cpu_threads']}thr" if k.get("cpu_threads") else ""
    return f"{k['device']}{threads} model {k['model'][:8]} {k['batch_size']}x{k['seq_len']} {k['dtype']} torch {k['torch']}"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(entries: list[dict]) -> str:
    header = ("date", "device", "model", "BxT", "tokens/s", "peak GiB", "eval BPB", "digest")
    rows = [header]
    for e in _order(entries):
        k = e["key"]
        device = k["device"] + (f" x{k['cpu_threads']}thr" if k.get("cpu_threads") else "")
        rows.append((e["created"][:16].replace("T", " "), device, k["model"][:8], f"{k['batch_size']}x{k['seq_len']}",
                     _fmt(e.get("tokens_per_s"), ",.0f"), _fmt(e.get("peak_memory_gib"), ".2f"),
                     _fmt(e.get("eval_bpb"), ".4f"), e["digest"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {4, 5, 6}  # numbers
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse history", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, default=DEFAULT_HISTORY, help=f"the history jsonl (default {DEFAULT_HISTORY})")
    ap.add_argument("--add", nargs="+", type=Path, default=[], metavar="ARTIFACT_DIR",
                    help="append entries from finished pretrain artifacts first (backfill); a digest already there "
                         "is not added again; an unfinished or non-pretrain dir is reported and makes the exit status 2")
    ap.add_argument("--check", action="store_true",
                    help="gate the newest entry against the previous comparable one; exit 1 on a regression (off: just the table)")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help=f"allowed relative drop in tokens/s and rise in peak memory (default {DEFAULT_TOLERANCE})")
    args = ap.parse_args(argv)
    if not 0 <= args.tolerance < 1:
        ap.error(f"--tolerance must be in [0, 1), got {args.tolerance}")

    skipped = 0
    for art_dir in args.add:
        try:
            entry = entry_from_artifact(art_dir)
        except ArtifactError as e:  # e.g. a run still in progress under a glob: say so, add the rest
            print(f"[history] skipped: {e}", file=sys.stderr)
            skipped += 1
            continue
        added = append(args.file, entry)
        print(f"[history] {'added' if added else 'already there'} {entry['digest']} ({art_dir})")
    entries = read_history(args.file)
    print(table(entries) if entries else f"[history] {args.file}: no entries")
    if args.check:
        ok, report = check(entries, args.tolerance)
        print(report, file=sys.stdout if ok else sys.stderr)
        if not ok:
            print(f"[history] regression beyond tolerance {args.tolerance}", file=sys.stderr)
            return 1
    return 2 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
