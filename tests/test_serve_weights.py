"""dormouse/serve/weights.py: the served model's weights cast once to what autocast casts them to every step. The
model computes the same bits after as before (CPU autocast here; the GPU test in tests/test_decode_step.py)."""

import copy

import pytest
import torch
from test_decode import CONFIGS, live_model

from dormouse.serve.weights import cast_for_autocast, stack_projections


def logits_under_autocast(m, idx):
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, st = m.prefill(idx)
        b, st = m.prefill(idx[:, :5], st)
        c, _ = m.step(idx[:, 0], st)
    return a, b, c


@pytest.mark.parametrize("name", ["all_on_conv4", "engram_order5_dense"])
def test_weights_cast_once_give_the_same_bits_and_what_is_read_in_fp32_stays_fp32(name):
    m = live_model(CONFIGS[name]).eval()
    before = copy.deepcopy(m)
    idx = torch.randint(0, 256, (3, 37), generator=torch.Generator().manual_seed(1))
    done = cast_for_autocast(m, torch.device("cpu"))
    dtypes = {n: p.dtype for n, p in m.named_parameters()}
    assert done["serve.weights_cast_once"] > 0 and done["serve.weights_cast_bytes_saved"] > 0
    assert dtypes["embed.weight"] == torch.float32 and dtypes["norm.weight"] == torch.float32  # lookup; gain
    assert all(dtypes[n] == torch.bfloat16 for n in dtypes if n.endswith((".w_up", ".w_down", "ffn.w_gate"))) or \
        not any(n.endswith(".w_up") for n in dtypes)
    for x, y in zip(logits_under_autocast(before, idx), logits_under_autocast(m, idx)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["all_on_conv4", "plain"])
def test_projections_stacked_once_give_the_same_bits_and_stay_out_of_checkpoints(name):
    """A served model's in_proj weight stacked once (after the cast, as `dormouse serve` does): the same logits bit
    for bit, no cat left in a step, nothing new in the state dict."""
    m = live_model(CONFIGS[name]).eval()
    idx = torch.randint(0, 256, (3, 37), generator=torch.Generator().manual_seed(2))
    cast_for_autocast(m, torch.device("cpu"))
    before = copy.deepcopy(m)
    keys = set(m.state_dict())
    done = stack_projections(m)
    assert done == {"serve.projections_stacked": m.cfg.n_blocks}
    assert set(m.state_dict()) == keys
    for x, y in zip(logits_under_autocast(before, idx), logits_under_autocast(m, idx)):
        assert torch.equal(x, y)
    q_weights = set()

    class Stacks(torch.utils._python_dispatch.TorchDispatchMode):  # cats of a mixer's projection weights
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.cat.default and args[0][0].data_ptr() in q_weights:
                Stacks.seen += 1
            return func(*args, **(kwargs or {}))

    q_weights = {b.mixer.q_proj.weight.data_ptr() for b in before.blocks}
    with Stacks():
        logits_under_autocast(before, idx)
    assert Stacks.seen == 3 * len(m.schedule)  # unstacked: a cat in each applied block's every call
    Stacks.seen, q_weights = 0, {b.mixer.q_proj.weight.data_ptr() for b in m.blocks}
    with Stacks():
        logits_under_autocast(m, idx)
    assert Stacks.seen == 0  # stacked once: never again

