"""dormouse.model.conv_triton (the short conv's training kernels) against the torch path, on CPU under
Triton's interpreter, and on the GPU where there is one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

_INTERPRETED = r"""
import json, torch
from benchmarks import triton_interpret
triton_interpret.apply()  # no benchmarker; scalar loop bounds under numpy 2
from dormouse.model import conv_triton
from dormouse.model.conv_triton import silu_conv_triton
from dormouse.model.regions import silu_conv

default_rows = conv_triton._rows_per_program

torch.manual_seed(0)
out = {}
for name, B, T, C, W, dtype, wide, tiles in [
        ("fp32", 2, 70, 24, 4, torch.float32, 1, None), ("short", 2, 3, 8, 4, torch.float32, 1, None),
        ("w3", 1, 130, 72, 3, torch.float32, 1, None), ("bf16", 2, 67, 16, 4, torch.bfloat16, 1, None),
        ("strided", 2, 66, 16, 4, torch.bfloat16, 3, None),
        # more rows a program in the weight-gradient pass (the GPU's medium shape takes 512): empty tiles; W 2
        ("rows128", 2, 300, 24, 4, torch.float32, 1, 128), ("rows64_w2", 1, 200, 8, 2, torch.float32, 1, 64)]:
    conv_triton._rows_per_program = default_rows if tiles is None else (lambda B, T, n=tiles: n)
    # "strided": x is the middle C columns of a [B, T, 3C] tensor, as KDAMixer.in_proj hands k to the conv
    base = torch.randn(B, T, wide * C).to(dtype)
    cols = slice(C, 2 * C) if wide > 1 else slice(0, C)
    w = torch.randn(C, 1, W)
    xs = [base.clone().requires_grad_() for _ in range(2)]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    head = torch.zeros(B, W - 1, C, dtype=dtype)
    y_ref = silu_conv(torch.cat([head, xs[0][..., cols]], 1), ws[0])
    y = silu_conv_triton(xs[1][..., cols], ws[1])
    dy = torch.randn(y.shape).to(dtype)
    y_ref.backward(dy)
    y.backward(dy)
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    out[name] = {"y": rel(y, y_ref), "dx": rel(xs[1].grad, xs[0].grad), "dw": rel(ws[1].grad, ws[0].grad),
                 "dtype": str(y.dtype), "contiguous": y.is_contiguous(), "strided_in": not xs[1][..., cols].is_contiguous(),
                 "untouched_cols": bool((xs[1].grad[..., :C] == 0).all()) if wide > 1 else None}
conv_triton._rows_per_program = default_rows
kernels = (conv_triton._fwd, conv_triton._bwd_g, conv_triton._bwd_dx)
configs = [list(k.configs) for k in kernels]
worst = 0.0
for i in range(max(len(c) for c in configs)):  # each tile shape once (the interpreter's autotuner takes the first)
    for k, c in zip(kernels, configs):
        k.configs, k.cache = [c[i % len(c)]], {}
    x = torch.randn(2, 150, 40, requires_grad=True)
    w = torch.randn(40, 1, 4, requires_grad=True)
    y = silu_conv_triton(x, w)
    y.backward(dy := torch.randn_like(y))
    dx, dw = x.grad, w.grad
    x.grad = w.grad = None
    silu_conv(torch.cat([x.new_zeros(2, 3, 40), x], 1), w).backward(dy)
    worst = max(worst, rel(dx, x.grad), rel(dw, w.grad))
out["configs"] = {"n": max(len(c) for c in configs), "worst": worst}
print(json.dumps(out))
"""


def test_triton_short_conv_matches_the_torch_path_under_the_interpreter(tmp_path):
    """Forward, dx and dw of the kernels against `regions.silu_conv` with zero history: T across tile edges and
    below W, C not a multiple of the block, W 3 and 4, bf16, and a column view of a wider tensor."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 8 and res.pop("configs")["worst"] <= 1e-5
    for name, r in res.items():
        # bf16: the torch path rounds the conv to bf16 before SiLU and its SiLU' product to bf16; the kernel
        # keeps both in fp32 until g is stored
        tol = 2e-2 if name in ("bf16", "strided") else 1e-5
        assert r["y"] <= tol and r["dx"] <= tol and r["dw"] <= tol, (name, r)
        assert r["contiguous"], name
    assert res["bf16"]["dtype"] == res["strided"]["dtype"] == "torch.bfloat16"
    assert res["strided"]["strided_in"] and res["strided"]["untouched_cols"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_short_conv_matches_the_torch_path_on_gpu():
    from dormouse.model.conv_triton import silu_conv_triton
    from dormouse.model.regions import silu_conv

    torch.manual_seed(0)
    dev = torch.device("cuda")
    B, T, C = 8, 4100, 320  # 8 row tiles a program in the weight-gradient pass, as at medium
    for dtype, W, tol in ((torch.float32, 4, 1e-4), (torch.bfloat16, 4, 2e-2), (torch.float32, 3, 1e-4)):
        base = torch.randn(B, T, 3 * C, device=dev).to(dtype)
        w = torch.randn(C, 1, W, device=dev)
        xs = [base.clone().requires_grad_() for _ in range(2)]
        ws = [w.clone().requires_grad_() for _ in range(2)]
        y_ref = silu_conv(torch.cat([base.new_zeros(B, W - 1, C), xs[0][..., C:2 * C]], 1), ws[0])
        y = silu_conv_triton(xs[1][..., C:2 * C], ws[1])
        dy = torch.randn_like(y)
        y_ref.backward(dy)
        y.backward(dy)
        for a, b in ((y, y_ref), (xs[1].grad, xs[0].grad), (ws[1].grad, ws[0].grad)):
            assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= tol, (dtype, W)
