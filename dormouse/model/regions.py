"""torch.compile regions: the tensor code between the KDA kernel calls, compiled on the GPU.

On the H200 a small model's eager step is launch-bound: each layer issues many small elementwise kernels
(norms, gates, short convs) around one `chunk_kda` call, and the host, not the GPU, sets the pace
(benchmarks/records/2026-12-04-throughput-h200-run3). FLA's kernels are `torch.compiler.disable`d, so a whole-model compile
breaks the graph at every layer anyway; compiling the pieces between the kernel calls gets the fusion
with no graph breaks, and keeps the arm counters (`counters[...] += ...`: dynamo would guard on their
values and recompile every step) in the eager code around them. What stays eager: the KDA core, the
mixer's short convs (Triton kernels on CUDA, `dormouse.model.conv_triton` and FLA's: FLA's alone was 0.84 ms
less per medium layer than `silu_conv` under inductor, benchmarks/records/2026-12-04-throughput-h200-run5), the embedding, each block's Engram residual add, an MoE FFN (it
syncs on its routing), the loss, the optimizers and the firewall.

A module lists its regions by name in `regions()` (a method returning method names: pure tensor
functions, no counters, no host syncs). `compile_regions(model)` compiles each such function of the
class once (`torch.compile(fullgraph=True)`) and binds it to every instance: dynamo inlines nn.Modules
and treats their parameters as graph inputs, so every block of a stack reuses one compiled graph (per
input signature), and a deepcopy of the model rebinds to the copy's own parameters.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    """F.conv1d(x.transpose(1, 2), weight, dilation=dilation, groups=C).transpose(1, 2) as W shifted
    multiply-adds on [B, L, C] (history already prepended), accumulated in fp32 and returned in x's
    dtype: no transposes, and under torch.compile one fused kernel each way (cuDNN's depthwise conv is an
    opaque call the compiler cannot fuse with the SiLU after it). weight [C, 1, W]; returns
    [B, L - (W - 1) * dilation, C]."""
    W = weight.shape[-1]
    T = x.shape[1] - (W - 1) * dilation
    xf, w = x.float(), weight[:, 0].float()  # [C, W]; fp32 sums whatever the autocast (a bf16 chain rounds W times)
    y = xf[:, :T] * w[:, 0]
    for i in range(1, W):
        y = y + xf[:, i * dilation : i * dilation + T] * w[:, i]
    return y.to(x.dtype)


def silu_conv(x: torch.Tensor, weight: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    return F.silu(causal_depthwise_conv(x, weight, dilation))


_COMPILED: dict[tuple, object] = {}  # (class, region, backend, mode) -> the compiled function, shared by instances


def uncompile_regions(model: nn.Module) -> int:
    """The compiled regions unbound again (each module's own methods run eagerly): how many were. For a caller that
    compiled and then failed to use them (serve's fallback)."""
    n = 0
    for m in model.modules():
        hook = getattr(m, "regions", None)
        for r in hook() if callable(hook) else ():
            n += m.__dict__.pop(r, None) is not None
    return n


def compile_regions(model: nn.Module, backend: str = "inductor", mode: str | None = None) -> list[str]:
    """Compile every region of every submodule in place (see the module docstring). Returns the qualified
    names compiled, e.g. ["logits", "blocks.0.mix_ffn", ...]. Idempotent: a compiled region is left as it is."""
    done = []
    for name, m in model.named_modules():
        hook = getattr(m, "regions", None)
        for r in hook() if callable(hook) else ():
            if r in m.__dict__:  # an instance attribute shadows the method: compiled before
                continue
            key = (type(m), r, backend, mode)
            if key not in _COMPILED:
                _COMPILED[key] = torch.compile(getattr(type(m), r), backend=backend, mode=mode, fullgraph=True)
            setattr(m, r, types.MethodType(_COMPILED[key], m))  # deepcopy rebinds a MethodType to the copy
            done.append(f"{name}.{r}" if name else r)
    return done
