"""Quantization-aware training (issue #28): the forward sees a rung's weights, the optimizers step fp32 masters.

`FakeQuant(model, rung)` gives every floating parameter the rule the rung file would (quant.tensor_rule with
quant.eligible_for, export's own: the rung for the matrices export quantizes, bf16 for everything else), and
inside `with fq.applied():` every parameter reads as

    fake_quant(rule, W) + (W - W.detach())     # value: the rung file's tensor; gradient: straight to W

the straight-through estimator (Bengio et al. 2013; BitNet b1.58 trains its absmean ternary the same way). The
value is the dequantized tensor exactly (adding a zero; only a -0 becomes +0), so a forward inside the context
is the forward of the model export loads back from the rung file (tests/test_qat.py). The swap shadows each
module's attribute in its instance __dict__ for the duration: state_dict(), parameters(), the optimizers
(Muon and AdamW step the fp32 Parameters), checkpoints and DDP's gradient hooks never see the quantized
tensors, while every read of the attribute inside (nn.Linear, KDA's fused input projection, the decode path,
compiled regions) does. The tensors are made on entry: enter once per step, after the optimizer moved the
weights. Export's `quantize_tables` is not followed: QAT keeps the Engram tables bf16, as export does by default.
"""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from dormouse.model import quant

QAT_RUNGS = tuple(r for r in quant.RUNGS if r != "bf16")  # a bf16 "finish" would be the autocast it already runs


def through(fq: FakeQuant | None):
    """`fq.applied()`, or nothing when the stage has no QAT."""
    return fq.applied() if fq is not None else nullcontext()


class FakeQuant:
    def __init__(self, model: nn.Module, rung: str):
        if rung not in QAT_RUNGS:
            raise ValueError(f"qat rung {rung!r}; one of {QAT_RUNGS}")
        self.model, self.rung = model, rung
        self.narrow: list[str] = []  # eligible but narrower than the rung's block: bf16, as export keeps them
        eligible = quant.eligible_for(rung, narrow=self.narrow)
        self.params = dict(model.named_parameters())
        self.rules = {name: quant.tensor_rule(rung, name, p, eligible) for name, p in self.params.items()}
        if not self.quantized:
            raise ValueError(f"qat: the model has no matrix {rung} quantizes (quant.default_eligible: 2-D, at least "
                             f"{quant.MIN_QUANT_NUMEL} weights, not an embedding, head, table or router)")
        rule_of = {id(p): self.rules[name] for name, p in self.params.items()}
        # every attribute a parameter is read through (a tied weight is two), with its rule
        self.slots = [(module, leaf, p, rule_of[id(p)])
                      for module in model.modules() for leaf, p in module.named_parameters(recurse=False)]
        self.applications = 0  # contexts entered: the counters' proof that the quantized forward ran

    @property
    def quantized(self) -> list[str]:
        """The parameters that see the rung (the rest see bf16)."""
        return sorted(n for n, r in self.rules.items() if r == self.rung)

    @contextmanager
    def applied(self):
        values = {}
        for _, _, p, rule in self.slots:
            if id(p) not in values:
                q = quant.fake_quant(rule, p)
                values[id(p)] = q + (p - p.detach()) if torch.is_grad_enabled() and p.requires_grad else q
        for module, leaf, p, _ in self.slots:
            module.__dict__[leaf] = values[id(p)]  # found before nn.Module.__getattr__ looks in _parameters
        self.applications += 1
        try:
            yield
        finally:
            for module, leaf, _, _ in self.slots:
                module.__dict__.pop(leaf, None)

    def moved(self) -> int:
        """How many rung tensors the quantizer changes now (0: the rung is the identity on these weights, so a forward
        through it is the plain one)."""
        return sum(not torch.equal(quant.fake_quant(self.rung, self.params[n]), self.params[n].detach())
                   for n in self.quantized)

    def report(self) -> dict:
        return {"rung": self.rung, "tensors": self.quantized, "tensors_bf16": sum(r == "bf16" for r in self.rules.values()),
                "kept_bf16_narrower_than_block": list(self.narrow)}


def file_counters(c, fq: FakeQuant, stage: str, steps: int) -> dict:
    """The manifest's proof that a stage trained through the rung, beside the loop's own train.qat.steps (`steps`):
    qat.tensors.<rung>, .bf16, qat.tensors_moved, qat.tensors_narrower_than_block, qat.contexts; and its `final.qat`
    entry. A rung that moved no tensor while steps ran is refused: the stage would have trained a plain forward."""
    moved = fq.moved()
    if steps and not moved:
        raise SystemExit(f"{stage}: {fq.rung} leaves every quantized tensor as it is: it trained a plain forward")
    report = fq.report()
    c[f"qat.tensors.{fq.rung}"] = len(report["tensors"])
    c["qat.tensors.bf16"] = report["tensors_bf16"]
    c["qat.tensors_moved"] = moved
    c["qat.tensors_narrower_than_block"] = len(report["kept_bf16_narrower_than_block"])
    c["qat.contexts"] = fq.applications  # in this process (a resumed pretrain: since the resume)
    return {**report, "steps": steps}


def lineage_entry(stage: str, summary: dict) -> dict:
    """One line of config.json's `qat`: a stage that trained through a rung (export labels its rungs from it)."""
    return {"stage": stage, "rung": summary["rung"], "steps": summary["steps"], "tensors": len(summary["tensors"])}


def upstream_lineage(art) -> list[dict]:
    """The `qat` lineage in an upstream model artifact's config.json ([] when no stage trained through a rung)."""
    return json.loads(art.file("config.json").read_text()).get("qat", [])
