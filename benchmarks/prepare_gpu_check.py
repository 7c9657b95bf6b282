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

    .venv/bin/python -m benchmarks.prepare_gpu_check      # ~2 min the first time (pip), then seconds

Then a device call: carry [".gpucheck"], command `bash benchmarks/gpu_check.sh`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.wheels import CARRY_LIMIT_MIB, ROOT, exclude_in_git, wheels

# What the check imports on the GPU machine, at the project's pins (requirements*.txt); torch, triton, numpy,
# pyarrow, PyYAML, safetensors and the rest come with the image.
REQUIREMENTS = ["fla-core==0.6.0", "einops==0.8.2", "jsonschema==4.26.0", "zstandard==0.25.0", "snakemake==9.27.1",
                "fastapi==0.165.0", "uvicorn==0.55.0", "openai==3.63.0", "lm_eval==0.4.13", "safetensors==0.8.0",
                "ml_dtypes==0.5.4"]


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpucheck")
    args = ap.parse_args(argv)
    exclude_in_git("/.gpucheck/")
    wheels(args.out / "whl", REQUIREMENTS)
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
