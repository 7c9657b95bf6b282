"""The filter stage on one core against N worker processes, same job, same run (issue #29 item 2).

    .venv/bin/python -m benchmarks.filter_workers_bench --corpus corpus/scale/data --files 3 --workers 2

Runs `dormouse filter --job` (the preset's job with `corpus` set to the chosen files, planned as Snakemake
plans it) twice in a scratch store: OMP_NUM_THREADS=1 (one process), then OMP_NUM_THREADS=N (the grant the
stage reads). Each run's wall clock and peak RSS of the whole process tree (GNU time -v is not needed: the
stage runs under `resource.getrusage(RUSAGE_CHILDREN)`, whose ru_maxrss is the largest child's), MB/s of
text read, and whether the two artifacts hold identical documents (every docs part's sha256 from their
manifests). Prints the ratio and appends rows to benchmarks/results.tsv.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_env import ROOT, append_tsv, cpu_model, git_rev, mem_gib, rerun_command
from dormouse.core.config import load_yaml  # noqa: E402
from dormouse.planner.plan import build_plan  # noqa: E402


def run_once(job: str, workers: int, cwd: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(workers)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dormouse.cli", "filter", "--job", job], cwd=cwd, env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"filter with {workers} workers failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"wall_s": wall, "maxrss_mib": max(rss, before) / 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=ROOT / "corpus/scale/data")
    ap.add_argument("--files", type=int, default=3, help="the first N raw files of --corpus (sorted by name)")
    ap.add_argument("--preset", default="b1")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-tsv", action="store_true")
    args = ap.parse_args(argv)

    files = sorted(p for p in args.corpus.iterdir() if p.name.endswith((".jsonl.zst", ".jsonl", ".parquet")))[: args.files]
    with tempfile.TemporaryDirectory(prefix="filter-workers-") as tmp:
        work = Path(tmp)
        (work / "corpus").mkdir()
        for f in files:
            os.symlink(f.resolve(), work / "corpus" / f.name)
        config = load_yaml(ROOT / "config/config.yaml")
        config.update(corpus=str(work / "corpus"), presets=[args.preset], preset=args.preset)
        cwd = os.getcwd()
        os.chdir(ROOT)  # the presets' example sets are paths under the repository
        try:
            plan = build_plan(config)
            job = json.loads(plan.job_json("filter", plan.chain[args.preset]["filter"]))
        finally:
            os.chdir(cwd)
        job["out"] = str(work / "store" / "filter" / job["digest"])
        job = json.dumps(job)
        text_mb = None
        rows, docs = [], {}
        for workers in (1, args.workers):
            r = run_once(job, workers, ROOT)
            manifest = json.loads((Path(json.loads(job)["out"]) / "manifest.json").read_text())
            text_mb = manifest["counters"]["bytes_read"] / 1e6
            docs[workers] = {n: m["sha256"] for n, m in manifest["files"].items() if n.startswith("docs-")}
            rows.append({"workers": workers, **r, "mb_s": text_mb / r["wall_s"], "kept_mb": manifest["counters"]["bytes_kept"] / 1e6})
            shutil.rmtree(Path(json.loads(job)["out"]))
            print(f"[filter_workers] {workers} worker(s): {r['wall_s']:.1f} s, {text_mb / r['wall_s']:.2f} MB/s of "
                  f"{text_mb:.0f} MB, peak RSS {r['maxrss_mib']:.0f} MiB", flush=True)
    same = docs[1] == docs[args.workers]
    ratio = rows[0]["wall_s"] / rows[1]["wall_s"]
    print(f"[filter_workers] {args.workers} workers / one: {ratio:.2f}x throughput; documents identical: {same}")
    if not args.no_tsv:
        cmd = rerun_command("benchmarks.filter_workers_bench", argv, python="python")
        import fasttext
        import numpy

        append_tsv([{"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_model()}; {os.cpu_count()} cores; {mem_gib():.0f} GiB",
                     "versions": f"python {sys.version.split()[0]}, numpy {numpy.__version__}, fasttext "
                                 f"{getattr(fasttext, '__version__', '0.9.3')}", "command": cmd,
                      "metric": f"filter throughput, {args.workers} workers vs 1 ({text_mb:.0f} MB of {len(files)} files)",
                      "value": f"{rows[1]['mb_s']:.2f} MB/s", "baseline": f"{rows[0]['mb_s']:.2f} MB/s",
                      "ratio": f"{ratio:.2f}", "note": f"identical documents: {same}; peak RSS {rows[0]['maxrss_mib']:.0f} / "
                                                        f"{rows[1]['maxrss_mib']:.0f} MiB; git {git_rev()}"}])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
