"""Optimizers and the learning-rate schedule of pretraining.

Muon (StackedMuon below: torch.optim.Muon's math, batched) for the 2-D weight matrices inside blocks; AdamW for everything else
(embeddings, head, norms, gains, Engram tables, gates). Warmup-stable-decay: linear warmup, flat,
then linear decay toward `min_lr_frac` of the peak over the last `decay_frac` of the steps (decay_start =
int(total * (1 - decay_frac))). Step decay_start runs at the peak and the line reaches `min_lr_frac` one step after
the last, so the last of n decay steps runs at min + (1 - min) / n (tiny's pretrain: 0.115 for 0.1). Kept as is:
moving the line one step would change every trained artifact for a 1/n difference.
"""

from __future__ import annotations

import types

import torch

from dormouse.train.settings import OptimSettings


def wsd_multiplier(step: int, total: int, warmup: int, decay_frac: float, min_lr_frac: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    decay_start = int(total * (1 - decay_frac))
    if step < decay_start or total <= decay_start:
        return 1.0
    progress = (step - decay_start) / max(total - decay_start, 1)
    return 1.0 - (1.0 - min_lr_frac) * min(progress, 1.0)


def build_optimizers(model, settings: OptimSettings, muon_cls=None) -> list[torch.optim.Optimizer]:
    """muon_cls: StackedMuon unless given (benchmarks/pretrain_h200.py --muon torch passes torch.optim.Muon)."""
    hidden, other = model.param_groups()
    ids = [id(p) for p in hidden + other]
    assert len(ids) == len(set(ids)) == len(list(model.parameters())), "every parameter in exactly one optimizer"
    opts = []
    # Fused AdamW on CUDA: one kernel, and it skips a non-finite step from the device (dormouse/train/firewall.py).
    fused = torch.cuda.is_available() and next(model.parameters()).is_cuda
    if settings.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        raise SystemExit(f"optimizer: muon requested but torch {torch.__version__} has no torch.optim.Muon (no silent AdamW fallback)")
    if hidden:
        if settings.optimizer == "muon":
            opts.append((muon_cls or StackedMuon)(hidden, lr=settings.muon_lr, momentum=0.95, nesterov=True,
                                         weight_decay=settings.weight_decay, adjust_lr_fn="match_rms_adamw"))
        else:  # optimizer: adamw for every parameter; hidden matrices keep the configured decay
            opts.append(torch.optim.AdamW(hidden, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay,
                                          fused=fused))
    opts.append(torch.optim.AdamW(other, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused))
    for opt in opts:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return opts


def set_lr(opts: list[torch.optim.Optimizer], multiplier: float) -> None:
    for opt in opts:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier


class StackedMuon(torch.optim.Muon):
    """torch.optim.Muon with the Newton–Schulz iterations run on a stack of every matrix of one shape up
    to a transpose (baddbmm; a tall matrix joins its transpose's stack, as Newton–Schulz runs on the wide
    form anyway), not one matrix at a time: ~15 launches per shape a step instead of per matrix. Written
    here because torch's Muon (2.13) has no batched path; the state (momentum_buffer per parameter),
    the math and the lr adjustment are torch's, so checkpoints load either way. Equal to torch's up to
    bf16 rounding (tests/test_optim.py). On small (H200) its step is 9.1x torch's and the whole train step
    1.42x (benchmarks/records/2026-12-03-throughput-h200-run2).

    The elementwise work around the iterations is two functions over every stack of a group, `_momentum`
    (momentum, the firewall's selection, the bf16 cast and the per-matrix norm) and `_apply` (decay and
    update). On CUDA each is one torch.compile graph: eagerly they were ~13 passes over the fp32 weights and
    state, ~4.7 of medium's 11 ms a step; with the graphs medium's step went 104.9 -> 100.8 ms
    (benchmarks/records/2026-12-04-throughput-h200-run7). The first step compiles them (~10 s at medium). Every stack's
    bf16 Newton–Schulz input and output now exist at once (not one stack at a time): ~4 more bytes per hidden-matrix weight at the peak.

    A 3-D parameter is a bank of matrices (an MoE's experts, dormouse/model/ffn.py): each of its matrices is
    orthogonalised, normalised and lr-adjusted on its own, as separate 2-D parameters would be (bit for bit for a
    wide bank; a tall bank's own iteration may round a bf16 ulp apart from its transposed matrices'), and the
    bank joins its shape's stack whole (no per-expert tensors, so the compiled graphs take a few dozen inputs
    at b1, not thousands); a bank of tall matrices has a stack of its own, in its own layout (`_tall_bank`). torch's Muon refuses 3-D parameters; this class checks them itself.

    `step(ok=...)` takes the NaN firewall's decision as a bool 0-d tensor on the device (as fused AdamW
    takes `found_inf`): where it is False the step changes no parameter and no state, and nothing waits
    for the host. The new momentum and the update are selected with torch.where (not scaled by ok), so a
    non-finite gradient cannot leak into either."""

    def __init__(self, params, **kwargs):
        # torch's argument checks and defaults, through a throwaway 2-D parameter (its __init__ refuses banks)
        defaults = torch.optim.Muon([torch.zeros(1, 1, requires_grad=True)], **kwargs).defaults
        torch.optim.Optimizer.__init__(self, params, defaults)
        bad = [tuple(p.shape) for g in self.param_groups for p in g["params"] if p.dim() not in (2, 3)]
        if bad:
            raise ValueError(f"StackedMuon takes 2-D matrices and 3-D banks of matrices, got shapes {bad}")

    @torch.no_grad()
    def step(self, closure=None, ok: torch.Tensor | None = None):
        from torch.optim._muon import _adjust_lr

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ratios = self.__dict__.setdefault("_lr_ratios", {})  # per-matrix lr adjustment, kept on the device
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            if not params:
                continue
            momentum, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            by_shape: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                key = (min(p.shape[-2:]), max(p.shape[-2:]), _tall_bank(p), p.device, p.dtype)
                by_shape.setdefault(key, []).append(i)
            stacks = list(by_shape.values())
            talls = [key[2] for key in by_shape]
            cuda = params[0].is_cuda
            layout = tuple((key, tuple(_matrices(params[i].shape) for i in idx)) for key, idx in by_shape.items())  # what the compiled graphs are for
            xs = _fused(_momentum, cuda, layout)([[_oriented(grads[i]) for i in idx] for idx in stacks],
                                         [[_oriented(bufs[i]) for i in idx] for idx in stacks],
                                         momentum, group["nesterov"], group["eps"], ok)
            orthos = [_newton_schulz_iterations(x, group["ns_coefficients"], group["ns_steps"], tall)
                      for x, tall in zip(xs, talls)]
            scales = []
            for idx, x in zip(stacks, xs):
                shapes = tuple(tuple(params[i].shape) for i in idx)  # what the ratios depend on (orientation too)
                rkey = (shapes, group["adjust_lr_fn"], x.device)
                if rkey not in ratios:  # one per matrix, a bank's matrices in order
                    ratios[rkey] = torch.tensor([-_adjust_lr(1.0, group["adjust_lr_fn"], sh[-2:])
                                                 for sh in shapes for _ in range(_matrices(sh))],
                                                device=x.device)[:, None, None]
                scales.append(ratios[rkey] * lr)  # a device op: lr changes every step, no recompile, no copy
            decay = None
            if wd:  # a 0-d device tensor too: the compiled graph takes it as an input, so a new lr does not recompile
                decay = scales[0].new_full((), 1 - lr * wd)
            _fused(_apply, cuda, layout)([[_oriented(params[i]) for i in idx] for idx in stacks], orthos, scales, decay, ok)
        return loss


# How StackedMuon runs `_momentum` and `_apply`: "auto" = inductor graphs on CUDA and eager elsewhere; a
# torch.compile backend name = compiled with it on any device (the CPU tests trace with "aot_eager", which needs no
# C++ build); None = eager everywhere (muon_bench's "StackedMuon, eager" row, the GPU test's reference).
ELEMENTWISE_BACKEND: str | None = "auto"
_COMPILED: dict = {}


def _fused(fn, cuda: bool, layout: tuple):
    """fn as ELEMENTWISE_BACKEND says: compiled, one graph over every stack of the group, or fn itself. One
    torch.compile per (fn, backend, stack layout), each on its own copy of fn's code object: dynamo keeps its graphs
    and its limit of 8 recompiles per code object, and one process can hold more layouts than that (the GPU tests, a
    benchmark's several models), past which a fullgraph compile raises instead of compiling."""
    backend = ("inductor" if cuda else None) if ELEMENTWISE_BACKEND == "auto" else ELEMENTWISE_BACKEND
    if backend is None:
        return fn
    key = (fn, backend, layout)
    if key not in _COMPILED:
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        _COMPILED[key] = torch.compile(own, fullgraph=True, dynamic=False, backend=backend)
    return _COMPILED[key]


def _momentum(gs: list[list[torch.Tensor]], bs: list[list[torch.Tensor]], momentum: float, nesterov: bool,
              eps: float, ok: torch.Tensor | None) -> list[torch.Tensor]:
    """Per stack (lists of views of one matrix shape as the stack holds it, 2-D or banks): the new momentum into bs (where ok),
    and the Newton–Schulz input, the update stacked in bf16 with each matrix divided by its norm (torch's Muon's
    first steps)."""
    xs = []
    for g_list, b_list in zip(gs, bs):
        updates = []
        for g, b in zip(g_list, b_list):  # matrix by matrix: compiled, each is one kernel writing its slice of the stack
            new_b = b.lerp(g, 1 - momentum)
            u = g.lerp(new_b, momentum) if nesterov else new_b
            updates.append(u if u.dim() == 3 else u[None])
            b.copy_(new_b if ok is None else torch.where(ok, new_b, b))
        xs.append(_normalized_bf16(torch.cat(updates), eps))
    return xs


def _apply(ps: list[list[torch.Tensor]], orthos: list[torch.Tensor], scales: list[torch.Tensor],
           decay: torch.Tensor | None, ok: torch.Tensor | None) -> None:
    """Per stack: p <- p * decay + ortho * scale (scale: -lr times the per-matrix ratio). Where not ok, p is
    selected back whole (torch.where, not an update of -0.0: inductor and triton may drop a constant's sign)."""
    for p_list, ortho, scale in zip(ps, orthos, scales):
        at = 0
        for p in p_list:
            n = _matrices(p.shape)
            update = ortho[at : at + n] * scale[at : at + n]
            new = (p * decay if decay is not None else p) + (update if p.dim() == 3 else update[0])
            p.copy_(new if ok is None else torch.where(ok, new, p))
            at += n


# False: tall banks join their transposes' stack as tall matrices do (before session 17; muon_bench.py times both)
TALL_BANK_STACKS = True


def _tall_bank(t: torch.Tensor) -> bool:
    """A bank of tall matrices (an MoE's down projections) keeps its own stack in its own layout: as the transpose
    of a wide stack, every elementwise pass of the step read and wrote it across its strides (b1's 12 down banks'
    momentum kernels ran at ~1/5 of the memory rate: benchmarks/records/2026-12-05-b1-scale-h200). A tall 2-D
    matrix still joins its transpose's stack: one launch fewer per shape, and it is small."""
    return TALL_BANK_STACKS and t.dim() == 3 and t.shape[-2] > t.shape[-1]


def _oriented(t: torch.Tensor) -> torch.Tensor:
    """t as its stack holds it: a tall bank as it is, a tall matrix as its transpose (a view), a wide one as it is."""
    return t.mT if t.shape[-2] > t.shape[-1] and not _tall_bank(t) else t


def _matrices(shape) -> int:
    """How many matrices a parameter of this shape holds: 1, or a bank's first dimension."""
    return shape[0] if len(shape) == 3 else 1


def _normalized_bf16(g: torch.Tensor, eps: float) -> torch.Tensor:
    x = g.bfloat16()
    return x / x.flatten(1).norm(dim=1).clamp(min=eps)[:, None, None]


def _newton_schulz_iterations(x: torch.Tensor, coefficients, steps: int, tall: bool = False) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz's iterations over a stack [n, A, B] of normalised wide
    matrices (A <= B): one bmm and two baddbmm a step for the whole stack. tall: a stack [n, B, A] of tall ones,
    iterated as the transposes of the wide form (X <- aX + X(bG + cG^2), G = X^T X), so nothing is transposed in
    memory: the GEMMs take transposed operands as they are."""
    a, b, c = coefficients
    for _ in range(steps):
        if tall:
            gram = torch.bmm(x.transpose(1, 2), x)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.bmm(x, _plus_identity(poly, a)) if NS_FOLD_A else torch.baddbmm(x, x, poly, beta=a)
        else:
            gram = torch.bmm(x, x.transpose(1, 2))
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.bmm(_plus_identity(poly, a), x) if NS_FOLD_A else torch.baddbmm(x, poly, x, beta=a)
    return x


# Newton–Schulz's a*X folded into the Gram polynomial's diagonal, X <- (bG + cG^2 + aI) X: one bmm instead of a
# baddbmm, whose additive input torch copies into its output first (b1, H200: 8.7 ms of its 148 ms step are those
# copies, the X-sized ones ~4.8). Equal in exact arithmetic; in bf16 a*X rounds inside the polynomial's diagonal
# instead of once at the output, so off by default until benchmarks/muon_bench.py's row shows it faster on the GPU.
NS_FOLD_A = False


def _plus_identity(m: torch.Tensor, a: float) -> torch.Tensor:
    """m + a*I for a stack of square matrices, in place (m is the iteration's own temporary)."""
    m.diagonal(dim1=-2, dim2=-1).add_(a)
    return m

