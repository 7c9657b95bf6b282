"""Feed-forward arms of a block: a dense SwiGLU, or a dropless top-k mixture of SwiGLU experts.

MoE contract (what the trainer and the pipeline rely on):
- Router: a bias-free linear d_model -> n_experts, run in fp32 (autocast off); softmax over experts, then
  top-k. With k >= 2 the k weights are renormalised to sum to one; with k = 1 the weight is the top
  probability itself, as in the Switch Transformer (renormalised it would be p / p = 1, and the language-model
  loss would give the router no gradient: only the balancing loss would train it).
- Dropless: NO capacity limit. Every token is processed by exactly its k experts, so the output at a
  position depends only on that position's input (never on the other tokens of the batch).
- Experts are separate `SwiGLU` modules (2-D `nn.Linear` weights each), so Muon sees 2-D matrices.
  Every expert is called every forward, with zero tokens if none were routed to it, so no expert weight
  ever ends with `grad is None` (keeps DDP and the optimizers' state uniform).
- After each forward `self.aux_loss` holds the Switch-style load-balancing loss
  n_experts * sum_i f_i * P_i (f_i: fraction of the N*k routed slots that went to expert i, no gradient;
  P_i: mean router probability of expert i). It is 1.0 for a perfectly balanced router.
- Counters: `counters["moe.tokens.expert_{i}"] += tokens routed to expert i` (summing to N*k per call).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """y = W_down(silu(W_gate x) * W_up x); no biases. `w_down` is the branch's output projection."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor, counters: Counter | None = None) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))

    def output_projections(self) -> list[nn.Linear]:
        return [self.w_down]


class MoE(nn.Module):
    """Dropless top-k mixture of `n_experts` SwiGLU experts (see the module docstring)."""

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"moe_top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, hidden) for _ in range(n_experts))
        self.aux_loss: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (probs [N, E] fp32, top-k expert ids [N, k], the experts' weights [N, k] fp32)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        probs = logits.softmax(dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        return probs, top_i, (top_w if self.top_k == 1 else top_w / top_w.sum(dim=-1, keepdim=True))

    def forward(self, x: torch.Tensor, counters: Counter | None = None) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        n, k, e = xf.shape[0], self.top_k, self.n_experts
        probs, top_i, top_w = self.route(xf)
        flat_e = top_i.reshape(-1)  # slot s = token * k + j
        order = torch.argsort(flat_e, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat_e, minlength=e)
        sizes = counts.tolist()  # one host sync: the split sizes are data-dependent
        tokens = order // k
        xs = xf[tokens]
        ws = top_w.reshape(-1)[order].unsqueeze(-1)
        ys = []
        for expert, xe, we in zip(self.experts, xs.split(sizes), ws.split(sizes)):
            ys.append(expert(xe).float() * we)  # called even with 0 rows: grads stay tensors
        y_sorted = torch.cat(ys)
        y_slots = torch.empty_like(y_sorted)
        y_slots[order] = y_sorted  # un-sort: a permutation, so no atomics and a deterministic sum
        out = y_slots.view(n, k, -1).sum(dim=1)
        f = counts.float() / (n * k)
        if self.training and torch.distributed.is_available() and torch.distributed.is_initialized():
            # data parallel: balance the global batch's routing, not each rank's share (no gradient flows through f)
            torch.distributed.all_reduce(f)
            f = f / torch.distributed.get_world_size()
        self.aux_loss = e * torch.sum(f * probs.mean(dim=0))
        if counters is not None:
            for i, c in enumerate(sizes):
                counters[f"moe.tokens.expert_{i}"] += c
        return out.to(x.dtype).view(shape)

    def output_projections(self) -> list[nn.Linear]:
        return [ex.w_down for ex in self.experts]
