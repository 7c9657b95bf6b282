"""CPU speed of the pure-torch chunked KDA core (dormouse.model.kda.chunk_kda_torch), forward + backward.

    .venv/bin/python benchmarks/kda_cpu_bench.py [--B 4] [--T 512] [--H 4] [--K 32] [--V 32] [--threads 2]

Prints tokens/s (B*T per fwd+bwd step, median of --reps after --warmup) for the chunked core, and for the
full KDAMixer layer at the same B, T (d_model = H*K).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dormouse.model.config import ModelConfig
from dormouse.model.kda import KDAMixer, chunk_kda_torch, l2norm


def bench(step, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("B", 4), ("T", 512), ("H", 4), ("K", 32), ("V", 32), ("chunk", 64), ("threads", 2),
                          ("warmup", 2), ("reps", 7)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    q = l2norm(torch.randn(B, T, H, K)).requires_grad_()
    k = l2norm(torch.randn(B, T, H, K)).requires_grad_()
    v = torch.randn(B, T, H, V, requires_grad=True)
    g = (-torch.empty(H).uniform_(1, 16)[:, None] * F.softplus(torch.randn(B, T, H, K))).requires_grad_()
    beta = torch.rand(B, T, H, requires_grad=True)

    def core_step():
        o, _ = chunk_kda_torch(q, k, v, g, beta, chunk_size=a.chunk)
        o.square().mean().backward()

    t_core = bench(core_step, a.warmup, a.reps)
    print(f"chunk_kda_torch B={B} T={T} H={H} K={K} V={V} chunk={a.chunk} threads={a.threads}: "
          f"{t_core * 1e3:.1f} ms fwd+bwd, {B * T / t_core:,.0f} tokens/s")

    cfg = ModelConfig(d_model=H * K, n_heads=H, head_dim=K, kda_chunk_size=a.chunk)
    mixer = KDAMixer(cfg)
    x = torch.randn(B, T, cfg.d_model)

    def layer_step():
        y, _ = mixer(x)
        y.square().mean().backward()

    t_layer = bench(layer_step, a.warmup, a.reps)
    print(f"KDAMixer d_model={cfg.d_model}: {t_layer * 1e3:.1f} ms fwd+bwd, {B * T / t_layer:,.0f} tokens/s")


if __name__ == "__main__":
    main()
