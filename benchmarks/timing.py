"""How the torch benchmarks time a call: warm-up, then timed calls between synchronises (CUDA events per call on
a GPU), a measured matmul rate for MFU, and a call captured as one CUDA graph."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, steps: int, warmup: int, device: torch.device) -> dict:
    """Warm-up calls (autotune/compile happen here), then `steps` timed calls. fn returns a tensor (a loss) or None."""
    t0 = time.perf_counter()
    first_s = None
    out = None
    for i in range(warmup):
        out = fn()
        if i == 0:
            sync(device)
            first_s = time.perf_counter() - t0
    sync(device)
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    per = []
    t1 = time.perf_counter()
    for i in range(steps):
        if device.type == "cuda":
            events[i][0].record()
            out = fn()
            events[i][1].record()
        else:
            s = time.perf_counter()
            out = fn()
            per.append((time.perf_counter() - s) * 1e3)
    sync(device)
    wall = time.perf_counter() - t1
    if device.type == "cuda":
        per = [a.elapsed_time(b) for a, b in events]
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = None
    last = round(float(out.detach().float().item()), 5) if isinstance(out, torch.Tensor) and out.numel() == 1 else None
    return {"wall_s": wall, "ms_step": wall / steps * 1e3, "ms_step_median": statistics.median(per),
            "warmup_s": warm_s, "first_s": first_s, "peak_gib": peak, "last_loss": last}


def matmul_rate(device: torch.device, n: int | None = None) -> tuple[float, str]:
    """Measured dense matmul rate in FLOP/s (bf16 on CUDA, fp32 on CPU), median of 20 after 3 warm-ups."""
    if device.type == "cuda":
        n = n or 8192
        dtype = torch.bfloat16
    else:
        n = n or 256
        dtype = torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    r = measure(lambda: torch.matmul(a, b), 20, 3, device)  # a, b are freed when this returns
    return 2 * n**3 / (r["ms_step_median"] / 1e3), f"{n}^3 {str(dtype).replace('torch.', '')} torch.matmul"


def as_graph(fn, device: torch.device):
    """fn captured as one CUDA graph after three eager calls on a side stream (Triton autotunes and torch.compile
    compiles there, outside the capture). Returns the replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
