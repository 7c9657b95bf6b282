"""Feed-forward arms of a block: a dense SwiGLU, or a dropless top-k mixture of SwiGLU experts.

MoE contract (what the trainer and the pipeline rely on):
- Router: a bias-free linear d_model -> n_experts, run in fp32 (autocast off); softmax over experts, then
  top-k. With k >= 2 the k weights are renormalised to sum to one; with k = 1 the weight is the top
  probability itself, as in the Switch Transformer (renormalised it would be p / p = 1, and the language-model
  loss would give the router no gradient: only the balancing loss would train it).
- Dropless: NO capacity limit. Every token is processed by exactly its k experts, so the output at a
  position depends only on that position's input (never on the other tokens of the batch).
- Experts are banks: `w_gate`, `w_up` [E, hidden, d_model] and `w_down` [E, d_model, hidden], expert i's
  SwiGLU being the i-th matrix of each (nn.Linear's [out, in] layout). The tokens are sorted by expert and
  each bank runs as one grouped GEMM over the sorted rows (`F.grouped_mm`; the offsets of the groups stay
  on the device), so a step has no Python loop over experts, no host sync and no data-dependent shape:
  torch.compile regions and CUDA graphs hold. Every bank gets a gradient every step (zero rows for an expert
  no token chose), so DDP and the optimizers' state stay uniform. Muon sees a bank as E matrices
  (dormouse/train/optim.py), export quantizes it matrix by matrix (dormouse/model/quant.py).
- After each forward `self.aux_loss` holds the Switch-style load-balancing loss
  n_experts * sum_i f_i * P_i (f_i: fraction of the N*k routed slots that went to expert i, no gradient;
  P_i: mean router probability of expert i). It is 1.0 for a perfectly balanced router.
- Counters: a forward given counters adds its routing to the device tally `routed` [E]; `take_routing`
  moves tallies into `counters["moe.tokens.expert_{i}"]` (summing to N*k per application) with one host
  read. ByteLM does that after each forward unless a training loop defers it to its log steps.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

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

    def output_projections(self) -> list[torch.Tensor]:
        return [self.w_down.weight]


class MoE(nn.Module):
    """Dropless top-k mixture of `n_experts` SwiGLU experts (see the module docstring)."""

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"moe_top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if d_model % 8 or hidden % 8:  # grouped GEMM rows must be 16-byte aligned in bf16
            raise ValueError(f"an MoE needs d_model and ffn_hidden multiples of 8, got {d_model} and {hidden}")
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.register_buffer("routed", torch.zeros(n_experts, dtype=torch.long), persistent=False)
        self.path = "auto"  # how the experts run (expert_rows); not a param: every path computes the same function
        self.aux_loss: torch.Tensor | None = None
        self.reset_experts(lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)))  # nn.Linear's own default

    @torch.no_grad()
    def reset_experts(self, init: Callable[[torch.Tensor], object]) -> None:
        """init(matrix) expert by expert in the order gate, up, down: the random draws of separate nn.Linear
        experts, so a seed gives the weights it gave before the banks."""
        for i in range(self.n_experts):
            for bank in (self.w_gate, self.w_up, self.w_down):
                init(bank[i])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (probs [N, E] fp32, top-k expert ids [N, k], the experts' weights [N, k] fp32)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        probs = logits.softmax(dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        return probs, top_i, (top_w if self.top_k == 1 else top_w / top_w.sum(dim=-1, keepdim=True))

    def apply_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., D] -> (output [..., D] in x's dtype, mean router probability per expert [E] fp32, tokens
        routed to each expert [E] int64). Fixed shapes and no host read (a torch.compile region) on every
        path but the "loop" reference."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        n, k, e = xf.shape[0], self.top_k, self.n_experts
        probs, top_i, top_w = self.route(xf)
        flat_e = top_i.reshape(-1)  # slot s = token * k + j
        order = torch.argsort(flat_e, stable=True)  # slots grouped by expert
        counts = torch.zeros(e, dtype=torch.long, device=x.device).scatter_add_(0, flat_e, torch.ones_like(flat_e))
        xs = xf[order // k].to(_compute_dtype(x))
        ys = self.expert_rows(xs, flat_e[order], counts).float() * top_w.reshape(-1)[order].unsqueeze(-1)
        y_slots = torch.empty_like(ys)
        y_slots[order] = ys  # un-sort: a permutation, so no atomics and a deterministic sum
        out = y_slots.view(n, k, -1).sum(dim=1)
        return out.to(x.dtype).view(shape), probs.mean(dim=0), counts

    def path_for(self, dtype: torch.dtype) -> str:
        """The expert path rows of this dtype take: `self.path`, or under "auto" the grouped GEMM for bf16 (the
        dtype its CUDA kernel takes, and what a tracing compile accepts) and padded blocks for any other."""
        if self.path != "auto":
            return self.path
        return "grouped_mm" if dtype == torch.bfloat16 else "blocked_bmm"

    def expert_rows(self, xs: torch.Tensor, sorted_e: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (sorted_e: each row's expert; counts: rows per expert) -> each row through its
        expert's SwiGLU, in xs's dtype. Three ways, the same outputs and gradients in fp32 (tests/test_model.py holds
        them to one another); in bf16 blocked_bmm rounds each block's bank gradient before summing the blocks (~0.3%
        apart for an expert of more than BLOCK_ROWS rows), so bf16 takes grouped_mm, equal to the loop there:
        - grouped_mm: one grouped GEMM per bank over the rows (`F.grouped_mm`, offsets on the device);
        - blocked_bmm: every expert's rows zero-padded to whole blocks of BLOCK_ROWS, then one bmm per bank with
          each block's expert matrix gathered (any dtype; the pad rows cost FLOPs and the gather bytes);
        - loop: the implementation before the banks, a Python loop over experts on split sizes read on the host
          (one sync per call): the reference, and a benchmark row."""
        path = self.path_for(xs.dtype)
        if path == "grouped_mm":
            offs = counts.cumsum(0).to(torch.int32)

            def mm(bank, rows):
                return _GROUPED_MM(rows, bank.to(rows.dtype).mT, offs=offs)
            return mm(self.w_down, F.silu(mm(self.w_gate, xs)) * mm(self.w_up, xs))
        if path == "blocked_bmm":
            dest, block_expert = _blocks(sorted_e, counts)
            nb = block_expert.shape[0]
            xp = xs.new_zeros(nb * BLOCK_ROWS, xs.shape[-1]).index_copy(0, dest, xs).view(nb, BLOCK_ROWS, -1)

            def mm(bank, rows):
                return torch.bmm(rows, bank.to(rows.dtype)[block_expert].mT)
            return mm(self.w_down, F.silu(mm(self.w_gate, xp)) * mm(self.w_up, xp)).flatten(0, 1)[dest]
        if path == "loop":
            sizes = counts.tolist()
            return torch.cat([F.linear(F.silu(F.linear(r, self.w_gate[i].to(r.dtype))) * F.linear(r, self.w_up[i].to(r.dtype)),
                                       self.w_down[i].to(r.dtype)) for i, r in enumerate(xs.split(sizes))])
        raise ValueError(f"MoE.path {path!r}: one of auto, {', '.join(PATHS)}")

    def regions(self) -> tuple[str, ...]:
        return ("apply_experts",)

    def forward(self, x: torch.Tensor, counters: Counter | None = None) -> torch.Tensor:
        out, mean_probs, counts = self.apply_experts(x)
        f = counts.float() / counts.sum()
        if self.training and torch.distributed.is_available() and torch.distributed.is_initialized():
            # data parallel: balance the global batch's routing, not each rank's share (no gradient flows through f)
            torch.distributed.all_reduce(f)
            f = f / torch.distributed.get_world_size()
        self.aux_loss = self.n_experts * torch.sum(f * mean_probs)
        if counters is not None:
            self.routed += counts  # read by take_routing, off the step's critical path
            counters[f"moe.path.{self.path_for(_compute_dtype(x))}"] += 1
        return out

    def output_projections(self) -> list[torch.Tensor]:
        return [self.w_down]


PATHS = ("grouped_mm", "blocked_bmm", "loop")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on, else x's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
BLOCK_ROWS = 64  # blocked_bmm's rows per block: an expert wastes fewer than this many padded rows
_GROUPED_MM = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10; the same op before


def _blocks(sorted_e: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocked_bmm's layout, on the device with fixed shapes: where each sorted row goes once every expert's
    rows are padded to whole blocks, and each block's expert (blocks past the last expert's are all padding)."""
    n, e = sorted_e.shape[0], counts.shape[0]
    padded = (counts + BLOCK_ROWS - 1) // BLOCK_ROWS * BLOCK_ROWS
    pad_end = padded.cumsum(0)
    first_row = counts.cumsum(0) - counts  # of each expert, among the sorted rows
    dest = (pad_end - padded)[sorted_e] + torch.arange(n, device=sorted_e.device) - first_row[sorted_e]
    n_blocks = -(-n // BLOCK_ROWS) + e  # the most any routing can need
    starts = torch.arange(n_blocks, device=sorted_e.device) * BLOCK_ROWS
    return dest, torch.searchsorted(pad_end, starts, right=True).clamp(max=e - 1)


def take_routing(moes: Iterable[MoE], counters: Counter | None) -> None:
    """Move the MoEs' routing tallies into `counters` (None: drop them) with one host read; tallies restart at 0."""
    moes = list(moes)
    if not moes:
        return
    total = torch.stack([m.routed for m in moes]).sum(dim=0)
    for m in moes:
        m.routed.zero_()
    if counters is not None:
        for i, c in enumerate(total.tolist()):
            counters[f"moe.tokens.expert_{i}"] += c
