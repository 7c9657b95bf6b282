"""b1's architecture past pretrain (issue #41): an MoE model with Engram and top-1 routing (b1's) through sft, rl,
export and bench on the CPU; every rung but bf16 quantizes the expert banks, and bench scores every stage and rung."""

from __future__ import annotations

import json

import pytest
import torch
from pipeline_util import manifest
from safetensors import safe_open
from test_posttrain import TINY, build_chain

# ffn_hidden 128: each expert matrix holds 4 096 weights, quant.MIN_QUANT_NUMEL, so the banks are quantized
MOE = {**TINY, "model": {**TINY["model"], "ffn_hidden": 128, "moe": True, "n_experts": 4, "moe_top_k": 1}}


@pytest.fixture(scope="module")
def moe_chain(tmp_path_factory, small_corpus, quality_examples):
    return build_chain(tmp_path_factory.mktemp("moe_chain"), small_corpus, quality_examples, MOE)


def test_an_moe_model_goes_through_sft_rl_export_and_bench(moe_chain):
    work, plan = moe_chain
    for stage in ("pretrain", "sft", "rl", "export"):  # each stage's evals route through the experts
        c = manifest(work, plan, stage)["counters"]
        assert sum(v for k, v in c.items() if k.startswith("eval.moe.tokens.expert_")) > 0, stage
    rungs = manifest(work, plan, "export")["final"]["rungs"]
    assert list(rungs) == ["bf16", "int8", "mxfp4", "ternary"] and all(r["bpb"] > 0 for r in rungs.values())
    export_dir = work / plan.artifact_dir("export", plan.chain["tiny"]["export"]) / "rungs"
    for rung in ("bf16", "int8", "mxfp4", "ternary"):
        with safe_open(str(export_dir / f"{rung}.safetensors"), "pt") as f:
            bank = {k: f.get_tensor(k) for k in f.keys() if k.startswith("blocks.0.ffn.w_up::")}
        if rung == "bf16":
            assert [t.dtype for t in bank.values()] == [torch.bfloat16]
        else:  # the bank's parts: no bf16 copy of the weights beside them
            assert "blocks.0.ffn.w_up::w" not in bank and len(bank) >= 2, (rung, sorted(bank))
    bench = json.loads((work / plan.artifact_dir("bench", plan.chain["tiny"]["bench"]) / "bench.json").read_text())
    assert list(bench["stages"]) == ["pretrain", "sft", "rl"] and list(bench["rungs"]) == list(rungs)
    for scores in [*bench["stages"].values(), *bench["rungs"].values()]:  # BPB and held-out tasks for each
        assert scores["bpb"] > 0 and scores["tasks_gen"]["n"] == bench["heldout_items"]
