"""The served model's weights in the dtype autocast casts them to, once at start instead of in every step.

Under bf16 autocast every matmul weight is cast from fp32 on each use; a captured decode step casts them on every
replay (its autocast cache is off). For b1 that was 2.25 ms of a 5 ms step on an H100, casting the expert banks
(benchmarks/records/2026-12-06-serve-h100). A served model is never trained, so those casts can be done once.

Exact by construction, not by a list: one probe prefill and step run under the serving autocast with a dispatch mode
that sees every aten op touching a parameter's storage. A parameter is cast only if every such op is a view of it or
its cast to the autocast dtype, so every value the model computes is bit for bit what it was; a parameter read in
fp32 anywhere (norm gains, the embedding, the fp32 head, a conv weight) stays fp32. A Triton kernel's reads are not
aten ops: a weight only a kernel reads is never seen cast, so it stays (a weight both cast and read raw by a kernel
would not be: the GPU test compares the logits bit for bit)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dormouse.model.gpt import ByteLM
from dormouse.model.kda import KDAMixer


_aten = torch.ops.aten
# ops whose output holds its inputs' values (or, for the new_* constructors, only their dtype) moved, not computed:
# on a cast weight they give the cast of what they gave (cat of the six projection weights in the KDA mixer's in_proj)
_MOVES = {_aten.cat.default, _aten.stack.default, _aten.clone.default, _aten.index.Tensor, _aten.index_select.default,
          _aten.gather.default, _aten.constant_pad_nd.default, _aten.new_zeros.default, _aten.new_empty.default,
          _aten.new_ones.default, _aten.zeros_like.default, _aten.empty_like.default, _aten.contiguous.default}


_CASTS = {_aten._to_copy.default, _aten.to.dtype, _aten.to.dtype_layout, _aten.to.device, _aten.to.other}


def _storage(t: torch.Tensor) -> int:
    """Its memory's address; 0 for an empty tensor (all share it: never counted as a parameter's)."""
    return t.untyped_storage().data_ptr()


class _ParamUses(TorchDispatchMode):
    """Which parameters an op casts to `dtype` (directly or through views and moves of them), and which any other op
    reads. Tensors derived from parameters are kept alive during the probe, so no other tensor reuses their memory."""

    def __init__(self, params: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.derived = {_storage(p): {n} for n, p in params.items() if p.dtype == torch.float32}
        self.kept: list[torch.Tensor] = []
        self.cast: set[str] = set()
        self.other: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and _storage(t)]
        sources = set().union(*(self.derived.get(_storage(t), set()) for t in ins))
        if not sources:
            return out
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and _storage(t)]
        if func in _CASTS and outs and all(t.dtype == self.dtype for t in outs):
            self.cast |= sources
        elif (func in _MOVES or func.is_view) and not func._schema.is_mutable:
            for t in outs:
                self.derived.setdefault(_storage(t), set()).update(sources)
                self.kept.append(t)
        else:
            self.other |= sources
        return out


def castable_parameters(model: ByteLM, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The names of the parameters that serving under `dtype` autocast only ever casts to `dtype` (see above)."""
    uses = _ParamUses(dict(model.named_parameters()), dtype)
    idx = torch.arange(6, device=device).reshape(2, 3) + 65
    with torch.inference_mode(), torch.autocast(device.type, dtype=dtype), uses:
        _, state = model.prefill(idx)  # the chunked path from the start
        _, state = model.prefill(idx, state)  # and continuing a state
        model.step(idx[:, 0], state)  # the recurrent path
    model.take_routing(None)  # the probe's MoE routing tally is no serving
    return sorted(uses.cast - uses.other)


def cast_for_autocast(model: ByteLM, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Cast the castable parameters in place; returns what was done, for the server's counters."""
    names = castable_parameters(model, device, dtype)
    params = dict(model.named_parameters())
    saved = 0
    with torch.no_grad():
        for n in names:
            p = params[n]
            saved += p.numel() * (p.element_size() - torch.empty((), dtype=dtype).element_size())
            p.data = p.data.to(dtype)
    return {"serve.weights_cast_once": len(names), "serve.weights_cast_bytes_saved": saved,
            "serve.weights_kept_fp32": sum(p.dtype == torch.float32 for p in params.values())}


def stack_projections(model: ByteLM) -> dict:
    """Each KDA mixer's six input projections stacked once (`KDAMixer.frozen_in_proj`), not on every call: a cat and
    its zero pad, two launches a layer of a decode step and of every prefill. Only for a model whose weights no
    longer change (a served one, after `cast_for_autocast`): a captured step reads the stacked copy, never the
    parameters. The same matrix, so the same bits. Returns what was done, for the server's counters."""
    mixers = [m for m in model.modules() if isinstance(m, KDAMixer)]
    with torch.no_grad():
        for m in mixers:
            m.frozen_in_proj = m.in_proj_weight()  # a new tensor (a cat of the weights), made under no_grad
    return {"serve.projections_stacked": len(mixers)}

