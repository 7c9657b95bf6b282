"""What every benchmark writes beside its figures: machine, versions, git revision, the TSV row."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TSV = ROOT / "benchmarks" / "results.tsv"
TSV_HEADER = ["date", "machine", "versions", "command", "metric", "value", "baseline", "ratio", "note"]


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mem_gib() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("nan")


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except OSError:
        return "?"


def append_tsv(rows: list[dict]) -> None:
    new = not TSV.exists() or TSV.stat().st_size == 0
    with open(TSV, "a", encoding="utf-8") as f:
        if new:
            f.write("\t".join(TSV_HEADER) + "\n")
        for r in rows:
            f.write("\t".join(str(r.get(k, "")).replace("\t", " ").replace("\n", " ") for k in TSV_HEADER) + "\n")


def plan_job(stage: str, preset: str) -> str:
    """`dormouse plan --preset P --stage S` as JSON text."""
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}")
    return subprocess.run(["dormouse", "plan", "--preset", preset, "--stage", stage], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True).stdout
