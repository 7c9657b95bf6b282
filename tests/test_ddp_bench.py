"""benchmarks/ddp_h200.py on CPU (its GPU half runs on a lent multi-GPU machine): the scaling columns, and the
whole driver over gloo with 1 and 2 worker processes. Timings are never asserted."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks.ddp_h200 as bench

REPO = Path(__file__).resolve().parent.parent


def test_scaling_columns_compare_with_the_same_presets_one_gpu_rows():
    rows = [{"preset": "small", "gpus": 1, "system": "compiled", "status": "ok", "tokens_per_s": 100},
            {"preset": "small", "gpus": 1, "system": "graphed", "status": "ok", "tokens_per_s": 125},
            {"preset": "small", "gpus": 2, "system": "compiled", "status": "ok", "tokens_per_s": 150},
            {"preset": "medium", "gpus": 1, "system": "compiled", "status": "ok", "tokens_per_s": 40},
            {"preset": "medium", "gpus": 2, "system": "compiled", "status": "ok", "tokens_per_s": 76},
            {"preset": "medium", "gpus": 4, "system": "compiled", "status": "failed: torchrun exit 1"}]
    bench.add_scaling(rows)
    small1, small1g, small2, med1, med2, med4 = rows
    assert small1["efficiency"] == 1.0 and small1["vs_graphed"] == 0.8
    assert small1g["vs_graphed"] == 1.0 and "efficiency" not in small1g  # graphed is no baseline of itself at W
    assert small2["efficiency"] == 0.75 and small2["vs_graphed"] == 1.2
    assert med2["efficiency"] == 0.95 and "vs_graphed" not in med2  # medium has no graphed row here
    assert "efficiency" not in med4
    lines = bench.table(rows).splitlines()
    assert len(lines) == 2 + len(rows) and lines[0].split()[:3] == ["preset", "GPUs", "system"]


@pytest.mark.slow  # ~20 s: two torchruns
def test_dry_run_over_gloo_writes_a_row_per_world_size(tmp_path):
    out = tmp_path / "ddp.tsv"
    run = subprocess.run([sys.executable, "-m", "benchmarks.ddp_h200", "--dry-run-cpu", "--presets", "small", "--gpus", "1", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out, encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [(r["gpus"], r["system"], r["status"]) for r in rows] == [("1", "compiled", "ok"), ("2", "compiled", "ok")]
    assert [r["rows_per_rank"] for r in rows] == ["2", "1"] and {r["global_batch"] for r in rows} == {"2"}
    assert float(rows[0]["efficiency"]) == 1.0 and 0 < float(rows[1]["efficiency"])
    assert "DDP" in rows[1]["note"] and "DDP" not in rows[0]["note"]
    assert run.stdout.rstrip().splitlines()[-1].split()[:3] == ["small", "2", "compiled"]  # the table is printed last
