"""The export stage's rung source: what it hands the quantizers must load back into the same model."""

from __future__ import annotations

import torch
from model_util import live_model, rand_bytes

from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM
from dormouse.model import quant
from dormouse.model.quant import rung_source_state


def test_bf16_rung_keeps_engram_hash_and_the_model(tmp_path, one_thread):
    # Odd 31-bit multipliers: a float32 round trip would change them and with them every hashed row.
    cfg = ModelConfig(d_model=32, n_heads=2, head_dim=16, ffn_hidden=64, n_core=2, engram=True,
                      engram_rows=1021, engram_dim=8)
    model = live_model(cfg)
    state = rung_source_state(model)
    assert any(int(v.max()) >= 2**24 for k, v in state.items() if k.endswith("hash_multipliers"))
    path = tmp_path / "bf16.safetensors"
    quant.save_rung(path, state, "bf16", eligible=lambda name, t: True)
    back = ByteLM(cfg)
    back.load_state_dict(quant.load_rung(path), strict=True)
    back.eval()
    for k, v in model.state_dict().items():
        if not v.is_floating_point():
            assert torch.equal(back.state_dict()[k], v), k
    # Against the same weights rounded to bf16 in place, the rung is exact.
    rounded = ByteLM(cfg)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
                             for k, v in model.state_dict().items()})
    rounded.eval()
    x = rand_bytes(2, 48)
    with torch.no_grad():
        torch.testing.assert_close(back(x)[0], rounded(x)[0], atol=0, rtol=0)
