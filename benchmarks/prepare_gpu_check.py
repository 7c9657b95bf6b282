"""Make here (the dev VM, repository root, after `make env`) what benchmarks/gpu_check.sh needs beside the checkout
on a bare GPU machine, all under the ignored folder .gpucheck/ (the one path a device call carries; <= 64 MiB with
the tree):

  .gpucheck/whl/      wheels for the GPU image's Python (cp312) of every package the check imports that the image
                      lacks (benchmarks/gpu_image_packages.txt lists what it has): fla-core, Snakemake and its deps,
                      fastapi/uvicorn, the openai client, lm-eval and its deps. Resolved by pip at the pins below;
                      the few sdist-only pure-Python ones are built into wheels here.
  .gpucheck/data.tgz  the tiny preset's data stages as the GPU chain starts from them (the GPU never runs the
                      CPU-only filter: fastText is not on the image): the demo corpus's build marker, the filter
                      artifact's manifest (its 83 MB fastText model and kept docs stay here; no GPU stage reads
                      them), the shard and anchors artifacts whole. Snakemake takes their digest paths as built.

    .venv/bin/python benchmarks/prepare_gpu_check.py      # ~2 min the first time (pip), then seconds

Then a device call: carry [".gpucheck"], command `bash benchmarks/gpu_check.sh`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the check imports on the GPU machine, at the project's pins (requirements*.txt); torch, triton, numpy,
# pyarrow, PyYAML, safetensors and the rest come with the image.
REQUIREMENTS = ["fla-core==0.6.0", "einops==0.8.2", "jsonschema==4.26.0", "zstandard==0.25.0", "snakemake==9.27.1",
                "fastapi==0.165.0", "uvicorn==0.55.0", "openai==3.63.0", "lm_eval==0.4.13", "safetensors==0.8.0",
                "ml_dtypes==0.5.4"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
CARRY_LIMIT_MIB = 64


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (ROOT / "benchmarks/gpu_image_packages.txt").read_text().splitlines()
    return {norm(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def resolve(requirements: list[str] = REQUIREMENTS) -> list[tuple[str, str]]:
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
            raise SystemExit(f"prepare_gpu_check: {name}=={version} has no cp312 wheel and did not build as a "
                             f"pure-Python one ({[b.name for b in built]}): add it to the image list or pin another")
        built[0].rename(dest / built[0].name)
    return "built from its sdist"


def wheels(dest: Path, requirements: list[str] = REQUIREMENTS, leave_out: set[str] = frozenset()) -> None:
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


def tiny_data(dest: Path) -> None:
    """The tiny preset's data stages, built here by Snakemake when missing, packed as the GPU chain reads them."""
    venv = ROOT / ".venv/bin"
    subprocess.run([str(venv / "snakemake"), "--cores", "2", "--quiet", "rules", "--", "results/tiny/anchors.json"],
                   cwd=ROOT, check=True, env={**os.environ, "PATH": f"{venv}:{os.environ['PATH']}"})
    plan = {}
    for stage in ("filter", "shard", "anchors"):
        job = json.loads(subprocess.run([str(venv / "python"), "-m", "dormouse.cli", "plan", "--preset", "tiny",
                                         "--stage", stage], cwd=ROOT, check=True, capture_output=True,
                                        text=True).stdout)
        plan[stage] = Path(job["out"]).resolve().relative_to(ROOT)
    members = [Path("corpus/demo/BUILD.json"), plan["filter"] / "manifest.json", plan["shard"], plan["anchors"]]
    with tarfile.open(dest, "w:gz") as tar:
        for m in members:
            if not (ROOT / m).exists():
                raise SystemExit(f"prepare_gpu_check: {m} missing after the data stages ran")
            tar.add(ROOT / m, arcname=str(m))
    print(f"data: {dest} ({dest.stat().st_size / 2**20:.1f} MiB): " + ", ".join(map(str, members)))


def exclude_in_git(pattern: str) -> None:
    """`pattern` in this checkout's .git/info/exclude (a worktree's .git is a file: git says where it lives)."""
    exclude = ROOT / subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout.strip()
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if pattern not in (exclude.read_text().splitlines() if exclude.exists() else []):
        with exclude.open("a") as f:
            f.write(pattern + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpucheck")
    args = ap.parse_args(argv)
    exclude_in_git("/.gpucheck/")
    wheels(args.out / "whl")
    tiny_data(args.out / "data.tgz")
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file()) / 2**20
    tree = int(subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True).stdout.count(b"\0"))
    print(f".gpucheck: {total:.1f} MiB (the tree travels too: {tree} tracked files; the call's limit is "
          f"{CARRY_LIMIT_MIB} MiB in all)")
    if total > CARRY_LIMIT_MIB - 8:
        print(f"prepare_gpu_check: .gpucheck is {total:.1f} MiB, too close to the {CARRY_LIMIT_MIB} MiB carry limit",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
