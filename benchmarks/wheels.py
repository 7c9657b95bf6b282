"""What a device call carries beside the checkout, made here (the dev VM): the wheels for the GPU image's Python
(cp312 x86-64) of what a set of requirements installs that the image lacks (benchmarks/gpu_image_packages.txt lists
what it has), the ignored folder they go in named in .git/info/exclude, and the call's carry limit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
CARRY_LIMIT_MIB = 64


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (ROOT / "benchmarks/gpu_image_packages.txt").read_text().splitlines()
    return {norm(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def resolve(requirements: list[str]) -> list[tuple[str, str]]:
    """(name, version) of everything `requirements` install, by pip's own resolver (this Python's markers: the
    image's 3.12 differs in none of these packages' requirements)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), *requirements], check=True)
        data = json.loads(report.read_text())
    return sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in data["install"])


def fetch_wheel(name: str, version: str, dest: Path) -> str:
    """One wheel for cp312 x86-64 into dest: a binary from the index, else (an sdist-only pure-Python package) built
    here. Returns how."""
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(dest),
                        f"{name}=={version}"], capture_output=True, text=True)
    if r.returncode == 0:
        return "downloaded"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, f"{name}=={version}"],
                       check=True)
        built = list(Path(tmp).glob("*.whl"))
        if len(built) != 1 or not re.search(r"-py[23.]*-none-any\.whl$", built[0].name):
            raise SystemExit(f"wheels: {name}=={version} has no cp312 wheel and did not build as a "
                             f"pure-Python one ({[b.name for b in built]}): add it to the image list or pin another")
        built[0].rename(dest / built[0].name)
    return "built from its sdist"


def wheels(dest: Path, requirements: list[str], leave_out: set[str] = frozenset()) -> None:
    """The wheels of what `requirements` install that the image lacks, but `leave_out`'s, into dest."""
    have = image_packages() | {norm(n) for n in leave_out}
    need = [(n, v) for n, v in resolve(requirements) if norm(n) not in have]
    wanted = {norm(n) for n, _ in need}
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # a pin changed since the last run: one version of each only
        if norm(old.name.split("-")[0]) not in wanted or not any(
                old.name.lower().startswith(f"{n.replace('-', '_').lower()}-{v}-") for n, v in need):
            old.unlink()
    for name, version in need:
        if any(w.name.lower().startswith(f"{name.replace('-', '_').lower()}-{version}-") for w in dest.glob("*.whl")):
            continue
        how = fetch_wheel(name, version, dest)
        print(f"  {name}=={version}: {how}")
    print(f"wheels: {len(need)} packages the image lacks, in {dest}")


def exclude_in_git(pattern: str) -> None:
    """`pattern` in this checkout's .git/info/exclude (a worktree's .git is a file: git says where it lives)."""
    exclude = ROOT / subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout.strip()
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if pattern not in (exclude.read_text().splitlines() if exclude.exists() else []):
        with exclude.open("a") as f:
            f.write(pattern + "\n")
