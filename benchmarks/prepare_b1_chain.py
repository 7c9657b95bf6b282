"""Make what b1's whole chain needs on a GPU machine that reaches no network (issue #41 item 1), here:

  .b1chain/whl/        wheels for the image's Python (cp312) of what the chain imports that the image lacks: the
                       stages' (fla-core, jsonschema, zstandard, ...) and Snakemake's, without pulp (16 MB: Snakemake
                       falls back to its greedy scheduler, which one machine's chain does not miss)
  .b1chain/sdist/      fasttext 0.9.3's sdist (PyPI has no cp312 wheel: built there against the image's pybind11 and
                       setuptools, about a minute)
  corpus/scale_slice/  200 MB of the scale corpus's text (`make scale-slice`, after `make scale`)

    .venv/bin/python -m benchmarks.prepare_b1_chain          # then the device calls of benchmarks/gpu_b1_chain.sh

It prints the carry list and what travels against the call's 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.wheels import CARRY_LIMIT_MIB, ROOT, exclude_in_git, wheels

REQUIREMENTS = ["fla-core==0.6.0", "einops==0.8.2", "jsonschema==4.26.0", "zstandard==0.25.0", "snakemake==9.27.1",
                "safetensors==0.8.0", "ml_dtypes==0.5.4"]
LEAVE_OUT = {"pulp"}
SDISTS = ["fasttext==0.9.3"]
SLICE = Path("corpus/scale_slice")


def sdists(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for spec in SDISTS:
        name, version = spec.split("==")
        if any(p.name.lower().replace("_", "-").startswith(f"{name}-{version}") for p in dest.iterdir()):
            continue
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:", "-d", str(dest),
                        spec], check=True)
        print(f"  {spec}: downloaded")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".b1chain")
    args = ap.parse_args(argv)
    exclude_in_git("/.b1chain/")
    wheels(args.out / "whl", REQUIREMENTS, LEAVE_OUT)
    sdists(args.out / "sdist")
    built = ROOT / SLICE / "BUILD.json"
    if not built.exists():
        raise SystemExit(f"prepare_b1_chain: {SLICE} not built: `make scale` (once, ~1.3 GB of downloads), then "
                         f"`make scale-slice`")
    s = json.loads(built.read_text())["totals"]
    size = {p: sum(f.stat().st_size for f in (ROOT / p).rglob("*") if f.is_file()) for p in (args.out, SLICE)}
    tree = sum((ROOT / f).stat().st_size for f in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                                                 text=True, check=True).stdout.split())
    total = (sum(size.values()) + tree) / 2**20
    print(f"slice: {s['text_bytes'] / 1e6:.1f} MB of text in {size[SLICE] / 2**20:.1f} MiB; wheels and sdists "
          f"{size[args.out] / 2**20:.1f} MiB; tracked tree {tree / 2**20:.1f} MiB: {total:.1f} of "
          f"{CARRY_LIMIT_MIB} MiB")
    if total > CARRY_LIMIT_MIB:
        raise SystemExit("prepare_b1_chain: over the device call's limit: a smaller slice (--text-mb)")
    print(f"carry: [\"{args.out.relative_to(ROOT)}\", \"{SLICE}\"]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
