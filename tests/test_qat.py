"""Quantization-aware training (dormouse/train/qat.py): the fake-quantized forward is the rung file's forward,
gradients reach the fp32 master weights through the straight-through estimator, and QAT cannot be silently off."""

from __future__ import annotations

import pytest
import torch
from model_util import live_model, rand_bytes

from dormouse.model.config import ModelConfig
from dormouse.posttrain import quant
from dormouse.stages.export import rung_source_state
from dormouse.train.optim import build_optimizers
from dormouse.train.qat import QAT_RUNGS, FakeQuant, finish_start

CFG = ModelConfig(d_model=64, n_heads=2, head_dim=32, ffn_hidden=96, n_core=2, kda_chunk_size=16,
                  engram=True, engram_rows=97, engram_dim=8)
TRAIN = {"optimizer": "muon", "lr": 3e-3, "muon_lr": 2e-2, "weight_decay": 0.0}


def exported(model, rung: str, path) -> torch.nn.Module:
    """The model as export writes the rung and loads it back (dormouse/stages/export.py's calls)."""
    quant.save_rung(path, rung_source_state(model), rung, eligible=quant.eligible_for(rung))
    return quant.load_rung_model(path, model.cfg, torch.device("cpu"))


@pytest.mark.parametrize("rung", QAT_RUNGS)
def test_the_quantized_forward_is_the_exported_rung_and_not_the_plain_one(rung, tmp_path, one_thread):
    model = live_model(CFG)
    fq = FakeQuant(model, rung)
    x = rand_bytes(2, 40)
    with torch.no_grad():
        plain = model(x)[0]
        with fq.applied():
            seen = model(x)[0]
        back = exported(model, rung, tmp_path / f"{rung}.safetensors")(x)[0]
    torch.testing.assert_close(seen, back, atol=0, rtol=0)
    assert (seen - plain).abs().max() > 1e-4  # QAT on is a different forward (a silent no-op fails here)
    recipe = quant.read_rung(tmp_path / f"{rung}.safetensors")[1]
    assert fq.quantized == sorted(n for n, e in recipe["tensors"].items() if e["rule"] == rung)  # export's tensors
    assert fq.applications == 1
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], plain, atol=0, rtol=0)  # the context leaves the model as it was


def test_gradients_flow_straight_through_to_the_fp32_masters(one_thread):
    model = live_model(CFG).train()
    fq = FakeQuant(model, "ternary")
    x, y = rand_bytes(2, 40), rand_bytes(2, 40, seed=2)
    keys = list(model.state_dict())
    with fq.applied():
        assert list(model.state_dict()) == keys and all(type(p) is torch.nn.Parameter for p in model.parameters())
        _, loss = model(x, y)
    loss.backward()
    # straight through: the gradient at W is the gradient at Q(W), i.e. a plain model holding the rung's values
    twin = live_model(CFG).train()
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(quant.fake_quant(fq.rules[name], dict(model.named_parameters())[name]))
    twin(x, y)[1].backward()
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in fq.quantized)
    # Muon and AdamW step the masters, which stay fp32 and off the ternary grid
    opts = build_optimizers(model, TRAIN)
    for opt in opts:
        opt.step()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert fq.moved() == len(fq.quantized) > 0


def test_only_export_eligible_matrices_see_the_rung_and_narrow_ones_stay_bf16():
    cfg = ModelConfig(d_model=48, n_heads=2, head_dim=24, ffn_hidden=96, n_core=1, kda_chunk_size=16)
    model = live_model(cfg)
    fq = FakeQuant(model, "nvfp4")
    assert fq.quantized and all(quant.default_eligible(n, model.get_parameter(n)) for n in fq.quantized)
    assert not any(n.endswith(("embed.weight", "head.weight")) for n in fq.quantized)
    assert {r for r in fq.rules.values()} == {"nvfp4", "bf16"}
    with pytest.raises(ValueError, match="qat rung"):
        FakeQuant(model, "bf16")


def test_finish_start():
    assert finish_start(200, 0.2) == 160 and finish_start(200, 0.0) == 200 and finish_start(10, 1.0) == 0


def test_qat_keys_at_their_default_stay_out_of_the_digest():
    """train.qat, sft.qat and rl.qat came after the digests were pinned: null (off) leaves every params slice as it
    was; a rung enters its stage's slice."""
    from pathlib import Path

    from dormouse.engine.config import load_preset, load_yaml
    from dormouse.engine.registry import POSTTRAIN_LATER_DEFAULTS, TRAIN_LATER_DEFAULTS, stage_params

    root = Path(__file__).resolve().parents[1]
    schema = load_yaml(root / "workflow" / "schemas" / "preset.schema.yaml")["properties"]
    assert {k: schema["train"]["properties"][k]["default"] for k in TRAIN_LATER_DEFAULTS} == TRAIN_LATER_DEFAULTS
    for stage in ("sft", "rl"):
        assert {k: schema[stage]["properties"][k]["default"] for k in POSTTRAIN_LATER_DEFAULTS} == POSTTRAIN_LATER_DEFAULTS
    preset = load_preset("tiny", root)
    assert preset["train"]["qat"] is None and preset["sft"]["qat"] is None
    assert "qat" not in stage_params("pretrain", preset)["train"]
    assert all("qat" not in stage_params(s, preset)[s] for s in ("sft", "rl"))
    preset = load_preset("tiny", root, "train.qat={rung: ternary, fraction: 0.2},sft.qat=ternary,rl.qat=nvfp4")
    assert stage_params("pretrain", preset)["train"]["qat"] == {"rung": "ternary", "fraction": 0.2}
    assert stage_params("sft", preset)["sft"]["qat"] == "ternary" and stage_params("rl", preset)["rl"]["qat"] == "nvfp4"
