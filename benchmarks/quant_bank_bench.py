"""Fake quantization of one MoE expert bank (QAT's forward, dormouse/model/quant.py): the whole bank in one call
against one matrix at a time (the baseline, timed in the same run), per rung, on the given device.

    python3 -m benchmarks.quant_bank_bench --device cuda          # b1's shape: 64 experts of 576 x 512
    .venv/bin/python -m benchmarks.quant_bank_bench --device cpu
"""

from __future__ import annotations

import argparse
import time

import torch

from dormouse.model import quant as Q  # noqa: E402


def timed(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up (kernels, allocator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--out-dim", type=int, default=576)
    ap.add_argument("--in-dim", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    W = torch.randn(args.experts, args.out_dim, args.in_dim, generator=torch.Generator().manual_seed(0)).to(device)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
          f"bank {tuple(W.shape)}, {args.reps} reps")
    print(f"{'rung':8s} {'bank ms':>9s} {'per-matrix ms':>14s} {'ratio':>6s}")
    for rung in ("int8", "fp8", "mxfp4", "nvfp4", "ternary"):
        q, dq = Q._QUANT[rung]
        whole = timed(lambda q=q, dq=dq: dq(q(W), W.shape), device, args.reps)
        alone = timed(lambda q=q, dq=dq: torch.stack([dq(q(m), m.shape) for m in W]), device, args.reps)
        print(f"{rung:8s} {whole * 1e3:9.2f} {alone * 1e3:14.2f} {alone / whole:5.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
