"""CPU speed of the pure-torch chunked KDA core (dormouse.model.kda.chunk_kda_torch), forward + backward.

    .venv/bin/python -m benchmarks.kda_cpu_bench [--B 4] [--T 512] [--H 4] [--K 32] [--V 32] [--chunks 16,32,64]
                                                 [--threads 1]

Prints tokens/s (B*T per fwd+bwd step; best and median of --reps after --warmup) for the chunked core, and for
the full KDAMixer layer at the same B, T (d_model = H*K), per chunk size. One thread by default: on a shared
2-core box a second intra-op thread made a step up to 8x slower (OpenMP hand-offs stall under load).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dormouse.model.config import ModelConfig
from dormouse.model.kda import KDAMixer, chunk_kda_torch, l2norm


def bench(step, warmup: int, reps: int) -> tuple[float, float]:
    """(best, median) seconds per call."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("B", 4), ("T", 512), ("H", 4), ("K", 32), ("V", 32), ("threads", 1),
                          ("warmup", 2), ("reps", 7)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--chunks", default="16,32,64", help="comma-separated chunk sizes")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    q = l2norm(torch.randn(B, T, H, K)).requires_grad_()
    k = l2norm(torch.randn(B, T, H, K)).requires_grad_()
    v = torch.randn(B, T, H, V, requires_grad=True)
    g = (-torch.empty(H).uniform_(1, 16)[:, None] * F.softplus(torch.randn(B, T, H, K))).requires_grad_()
    beta = torch.rand(B, T, H, requires_grad=True)

    for chunk in (int(c) for c in a.chunks.split(",")):

        def core_step(chunk=chunk):
            o, _ = chunk_kda_torch(q, k, v, g, beta, chunk_size=chunk)
            o.square().mean().backward()

        best, med = bench(core_step, a.warmup, a.reps)
        print(f"chunk_kda_torch B={B} T={T} H={H} K={K} V={V} chunk={chunk} threads={a.threads}: "
              f"{best * 1e3:.1f} ms fwd+bwd (median {med * 1e3:.1f}), {B * T / best:,.0f} tokens/s")

        cfg = ModelConfig(d_model=H * K, n_heads=H, head_dim=K, kda_chunk_size=chunk)
        mixer = KDAMixer(cfg)
        x = torch.randn(B, T, cfg.d_model)

        def layer_step(mixer=mixer, x=x):
            y, _ = mixer(x)
            y.square().mean().backward()

        best, med = bench(layer_step, a.warmup, a.reps)
        print(f"  KDAMixer d_model={cfg.d_model} chunk={chunk}: {best * 1e3:.1f} ms fwd+bwd (median {med * 1e3:.1f}), "
              f"{B * T / best:,.0f} tokens/s")


if __name__ == "__main__":
    main()
