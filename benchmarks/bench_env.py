"""What every benchmark writes beside its figures: machine, versions, git revision, the TSV row."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
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


def git_rev(root: Path = ROOT) -> str:
    """HEAD's short hash, and for a changed tree "+dirty tree <hash>": the git tree of the whole working tree
    (untracked files that git does not ignore included), which `git log --format='%h %T'` matches to the
    commit holding the same files. The device tool ships a working tree whose .git may be older than it."""
    def git(*args, env=None):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, env=env).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        if not git("status", "--porcelain"):
            return rev
        with tempfile.TemporaryDirectory() as tmp:  # a throwaway index (a copy: unchanged files skip hashing);
            index = Path(tmp) / "index"  # the repo's index and HEAD are left alone, new blobs join its objects
            own = root / git("rev-parse", "--git-path", "index")
            if own.is_file():
                shutil.copyfile(own, index)
            env = {**os.environ, "GIT_INDEX_FILE": str(index)}
            git("add", "-A", env=env)
            tree = git("write-tree", env=env)
        return f"{rev}+dirty tree {tree[:10]}"
    except OSError:
        return "?"


def append_tsv(rows: list[dict]) -> None:
    new = not TSV.exists() or TSV.stat().st_size == 0
    with open(TSV, "a", encoding="utf-8") as f:
        if new:
            f.write("\t".join(TSV_HEADER) + "\n")
        for r in rows:
            f.write("\t".join(str(r.get(k, "")).replace("\t", " ").replace("\n", " ") for k in TSV_HEADER) + "\n")


def append_jsonl(path: str | Path | None, rows: list[dict]) -> None:
    """Each row as a JSON line at the end of `path` (nothing when path is None: the script's --out not given)."""
    if path is None:
        return
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def package_versions(names) -> dict:
    """{"python": ..., name: installed version or None} from the packages' metadata (nothing imported)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def rerun_command(module: str, argv: list[str] | None = None, python: str = "python3") -> str:
    """The command line that reruns a benchmark from the repository root: `python3 -m benchmarks.<name> ARGS`
    (ARGS: argv, default this process's)."""
    return shlex.join([python, "-m", module, *(sys.argv[1:] if argv is None else argv)])


def plan_job(stage: str, preset: str) -> dict:
    """`dormouse plan --preset P --stage S`, the job's JSON parsed."""
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}")
    return json.loads(subprocess.run(["dormouse", "plan", "--preset", preset, "--stage", stage], cwd=ROOT, env=env,
                                     capture_output=True, text=True, check=True).stdout)
