"""benchmarks/decode_launches.py: the kernels a decode step launches on the CUDA path, counted on the CPU with FLA's
kernels under Triton's interpreter (a fresh process: TRITON_INTERPRET is read when FLA's kernels are decorated)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fla.ops.kda", reason="fla-core (with triton): the step's CUDA path")
ROOT = Path(__file__).resolve().parent.parent


def test_a_tiny_step_counts_its_launches_and_leaves_the_gates_to_the_kernel(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.decode_launches", "--presets", "tiny", "--rows", "2",
                           "--steps", "2", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    ops = row["by_op"]
    depth = 2  # tiny's applied blocks
    assert ops["triton.fused_recurrent_kda_fwd_kernel"] == depth and ops["triton._step3"] == depth  # q, k, v convs: one
    assert "triton.causal_conv1d_fwd_kernel" not in ops and "aten.pad" not in ops
    assert "aten.softplus" not in ops and "aten.exp" not in ops  # the decay gate and norms run inside FLA's kernel
    assert ops["triton._uniforms"] == 1 and "aten.__xor__" not in ops  # the sampler's hash: one kernel, not ~200
    assert ops["aten.copy_"] == 2 and ops["aten._foreach_copy_"] <= 3  # the state written back a dtype at a time
    assert ops["triton.layer_norm_gated_fwd_kernel"] == depth and "aten.rsqrt" not in ops  # the output's gated norm
    assert row["triton_per_step"] == sum(v for k, v in ops.items() if k.startswith("triton."))
    assert row["launches_per_step"] == pytest.approx(sum(ops.values()))
    assert row["weights_cast_once"] > 0  # serve's bf16 weights, as on CUDA
