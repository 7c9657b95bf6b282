"""The issue-#31 benchmark scripts run on CPU at tiny shapes: first_steps.py's phases (with an MoE, whose routing
it reads from the device tally) and moe_h200.py's expert paths against the loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_util import configure, plan_in, run_chain

ROOT = Path(__file__).resolve().parent.parent


def test_first_steps_times_each_phase_of_an_moe_step(tmp_path):
    out = tmp_path / "phases.jsonl"
    r = subprocess.run([sys.executable, "-m", "benchmarks.first_steps", "--preset", "tiny", "--steps", "3",
                        "--device", "cpu", "--stack-every", "0", "--model", '{"moe": true, "n_experts": 4}',
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["phase"] for row in rows] == ["build_model", "build_optimizers", "compile_regions_setup", "step0_forward",
                                              "step0_backward_opt", "step1_forward", "step1_backward_opt", "step2_syncs", "end"]
    assert rows[-1]["counters"]["moe.path.blocked_bmm"] > 0 and rows[-1]["loss"] < 6  # ran the MoE, a real loss


def test_moe_bench_rows_match_the_loop(tmp_path):
    out = tmp_path / "moe.tsv"
    r = subprocess.run([sys.executable, "-m", "benchmarks.moe_h200", "--preset", "tiny", "--dry-run-cpu",
                        "--reps", "2", "--warmup", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    header, *rows = [line.split("\t") for line in out.read_text().splitlines()]
    got = {row[header.index("row")]: row for row in rows}
    assert {"loop", "grouped_mm", "blocked_bmm"} <= set(got)
    for path in ("grouped_mm", "blocked_bmm"):  # bf16 autocast on CPU: rounding-level differences at most
        assert float(got[path][header.index("max_rel_err")]) < 0.05 and float(got[path][header.index("ms")]) > 0


@pytest.mark.slow
def test_gpu_scale_quality_pauses_resumes_and_ends(workdir, small_corpus, quality_examples, tmp_path):
    """benchmarks/gpu_scale_quality.sh on CPU with a tiny job (~1 min): the first call pauses its run before the call's
    limit, the next resumes it to the budget, and the one after that has nothing left to do."""
    config = configure(workdir, small_corpus, *quality_examples)
    run_chain(workdir, config, stages=("filter", "shard"))
    job = tmp_path / "job.json"
    job.write_text(plan_in(workdir, config).job_json("pretrain", plan_in(workdir, config).chain["tiny"]["pretrain"]))
    env = dict(os.environ, PY=sys.executable, JOB=str(job), PARTS="", BUDGET="6", CALL_S="32", MARGIN_S="27", MIN_S="2",
               RUNS="tiny:ours", OUT=str(tmp_path / "out"), STATE=str(tmp_path / "state"))
    said = []
    for _ in range(3):
        r = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_scale_quality.sh")], cwd=workdir, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        said.append(r.stdout)
    assert "paused; call again" in said[0] and "all runs done" in said[1] and "tiny:ours: done" in said[2]
    rows = (tmp_path / "out" / "q_tiny_ours.tsv").read_text().splitlines()
    assert float(rows[-1].split("\t")[1]) >= 6  # the last row reached the budget's training seconds
