"""The issue-#31 benchmark scripts run on CPU at tiny shapes: first_steps.py's phases (with an MoE, whose routing
it reads from the device tally) and moe_h200.py's expert paths against the loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_first_steps_times_each_phase_of_an_moe_step(tmp_path):
    out = tmp_path / "phases.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/first_steps.py"), "--preset", "tiny", "--steps", "3",
                        "--device", "cpu", "--stack-every", "0", "--model", '{"moe": true, "n_experts": 4}',
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["phase"] for row in rows] == ["build_model", "build_optimizers", "compile_regions_setup", "step0_forward",
                                              "step0_backward_opt", "step1_forward", "step1_backward_opt", "step2_syncs", "end"]
    assert rows[-1]["counters"]["moe.path.blocked_bmm"] > 0 and rows[-1]["loss"] < 6  # ran the MoE, a real loss


def test_moe_bench_rows_match_the_loop(tmp_path):
    out = tmp_path / "moe.tsv"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/moe_h200.py"), "--preset", "tiny", "--dry-run-cpu",
                        "--reps", "2", "--warmup", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    header, *rows = [line.split("\t") for line in out.read_text().splitlines()]
    got = {row[header.index("row")]: row for row in rows}
    assert {"loop", "grouped_mm", "blocked_bmm"} <= set(got)
    for path in ("grouped_mm", "blocked_bmm"):  # bf16 autocast on CPU: rounding-level differences at most
        assert float(got[path][header.index("max_rel_err")]) < 0.05 and float(got[path][header.index("ms")]) > 0
