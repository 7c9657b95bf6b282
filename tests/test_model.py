"""The byte LM (dormouse.model.gpt) with the real KDAMixer: shapes/dtypes, causality with every arm on,
dropless MoE, the loop feeding forward, Engram's lookups, closed-form parameter counts, optimizer groups,
and a tiny overfit. Tiny configs: the whole file runs in well under a minute on a CPU."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from model_util import live_model, rand_bytes

from interpret_util import run_interpreted
from dormouse.model import ffn
from dormouse.model.config import ModelConfig
from dormouse.model.engram import Engram, _is_prime, engram_tables
from dormouse.model.ffn import MoE, take_routing
from dormouse.model.gpt import ByteLM, active_params, count_params
from dormouse.model.kda import KDAMixer
from dormouse.train.optim import StackedMuon

torch.set_num_threads(1)

TINY = dict(d_model=32, n_heads=2, head_dim=16, ffn_hidden=48, n_core=2, kda_chunk_size=16,
            n_experts=4, moe_top_k=2, engram_rows=97, engram_dim=8)
# every arm on: prelude + looped core + coda, MoE everywhere, Engram on the prelude, core and coda blocks
ALL_ON = dict(n_prelude=1, n_core=1, n_loop=2, n_coda=1, moe=True, engram=True, engram_layers=(0, 1, 2))


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**TINY, **kw})


# --------------------------------------------------------------------------------------------------
def test_forward_shapes_fp32_loss_and_every_param_gets_a_grad():
    cfg = tiny(**ALL_ON)
    m = live_model(cfg).train()
    idx = rand_bytes(2, 40)
    logits, loss = m(idx, torch.roll(idx, -1, 1))
    assert logits.shape == (2, 40, 256) and logits.dtype == torch.float32
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and loss.dim() == 0
    assert m(idx)[1] is None
    (loss + 0.01 * m.aux_loss).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name}: gradient is all zero (arm not wired in?)"


def test_fresh_model_loss_near_uniform_and_blocks_start_as_identity():
    cfg = tiny(**ALL_ON)
    torch.manual_seed(0)
    m = ByteLM(cfg).eval()
    idx = rand_bytes(2, 32)
    logits, loss = m(idx, idx)
    assert abs(loss.item() - math.log(256)) < 0.1
    # zero-initialised branch outputs: the stack is embedding -> norm -> head
    ref = m.norm(m.embed(idx)) @ m.head.weight.T
    torch.testing.assert_close(logits, ref)
    for mixer in (b.mixer for b in m.blocks):  # the mixer's own init of its special params is kept
        a = mixer.A_log.exp()
        assert (a >= 1 - 1e-5).all() and (a <= 16 + 1e-4).all() and (mixer.dt_bias == 0).all()


def test_logits_fp32_under_bf16_autocast():
    m = live_model(tiny(**ALL_ON))
    idx = rand_bytes(2, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = m(idx, idx)
    assert logits.dtype == torch.float32 and loss.dtype == torch.float32 and torch.isfinite(loss)


def skew_routers(m: ByteLM, idx: torch.Tensor) -> None:
    """Make every MoE's expert loads uneven, as a trained router's often are: point expert 0's router row
    along the mean of that MoE's inputs (about 70% of the tokens then pick it, ~1.8x the mean load), so
    that an implementation with a capacity limit (factor < ~1.7) would have to drop tokens."""
    seen: dict[MoE, list[torch.Tensor]] = {}
    hooks = [b.ffn.register_forward_pre_hook(lambda mod, a: seen.setdefault(mod, []).append(a[0].flatten(0, -2)))
             for b in m.blocks]
    with torch.no_grad():
        m(idx)
        for h in hooks:
            h.remove()
        for mod, xs in seen.items():
            mu = torch.cat(xs).mean(0)
            mod.router.weight[0] = 200 * mu / mu.square().sum()


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arms", [ALL_ON, dict(moe=True)], ids=["all_arms", "moe_only"])
def test_causal_and_dropless(arms):
    """Earlier logits never depend on later bytes, nor on the other sequences of the batch.
    With MoE on this is the dropless check: a capacity limit makes one token's routing depend on the
    others' (which then get dropped), so changing/adding bytes elsewhere would move these logits."""
    m = live_model(tiny(**arms))
    idx = rand_bytes(3, 48)
    t = 20
    skew_routers(m, idx)
    with torch.no_grad():
        c = Counter()
        base, _ = m(idx, counters=c)
        loads = [c[f"moe.tokens.expert_{e}"] for e in range(m.cfg.n_experts)]
        assert max(loads) > 1.5 * sum(loads) / len(loads), loads  # uneven enough to overflow a capacity
        changed = idx.clone()
        changed[:, t:] = rand_bytes(3, 48 - t, seed=7)
        out, _ = m(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out[:, t:], base[:, t:], atol=1e-3)
        # append bytes: the first 48 positions are unchanged
        longer, _ = m(torch.cat([idx, rand_bytes(3, 30, seed=8)], 1))
        torch.testing.assert_close(longer[:, :48], base, atol=1e-5, rtol=1e-5)
        # other sequences of the batch: row 0 alone == row 0 in the batch
        alone, _ = m(idx[:1])
        torch.testing.assert_close(alone, base[:1], atol=1e-5, rtol=1e-5)


def test_moe_is_dropless_top_k_of_its_experts():
    """MoE output == per-token sum over its k experts of renormalised weight * expert(x)."""
    torch.manual_seed(0)
    moe = MoE(16, 24, n_experts=4, top_k=2)
    x = torch.randn(3, 20, 16)
    x[..., 0] += 4.0
    with torch.no_grad():
        moe.router.weight[0, 0] = 3.0  # every token picks expert 0: twice the mean load, all processed
    c = Counter()
    y = moe(x, c)
    take_routing([moe], c)
    probs = torch.softmax(x.reshape(-1, 16) @ moe.router.weight.T, -1)
    w, i = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.stack([sum(w[n, j] * expert(moe, int(i[n, j]), x.reshape(-1, 16)[n]) for j in range(2))
                       for n in range(60)]).view(3, 20, 16)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert sum(v for k, v in c.items() if k.startswith("moe.tokens.")) == 60 * 2 and c["moe.tokens.expert_0"] == 60
    assert [c[f"moe.tokens.expert_{e}"] for e in range(4)] == torch.bincount(i.reshape(-1), minlength=4).tolist()
    # Switch aux loss: exactly 1 for a uniform router (ties broken by index still give sum f_i = 1)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(x)
    assert moe.aux_loss.item() == pytest.approx(1.0)



@pytest.mark.parametrize("top_k", [1, 2])
def test_the_language_model_loss_reaches_the_router(top_k):
    """With top-1 routing the expert's weight is its router probability (Switch), not p / p = 1: the loss of the
    output alone (no balancing term) must give the router a gradient, as it does with top-2."""
    torch.manual_seed(0)
    moe = MoE(16, 24, n_experts=4, top_k=top_k)
    torch.nn.init.normal_(moe.w_down, std=0.1)  # nonzero expert outputs (the model zeroes w_down, MoE alone does not)
    x = torch.randn(3, 20, 16)
    moe(x).square().mean().backward()
    assert moe.router.weight.grad.norm() > 1e-3, moe.router.weight.grad.norm()
    _, _, w = moe.route(x.reshape(-1, 16))
    if top_k == 1:  # the weight is the top probability, below 1 for a router that is not one-hot
        assert (w < 1).all()

def expert(moe: MoE, i: int, x: torch.Tensor) -> torch.Tensor:
    """Expert i of the banks as a plain SwiGLU."""
    return F.linear(F.silu(F.linear(x, moe.w_gate[i])) * F.linear(x, moe.w_up[i]), moe.w_down[i])


@pytest.mark.parametrize("path", ["grouped_mm", "blocked_bmm"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_expert_paths_match_the_expert_loop_in_outputs_and_gradients(path, top_k):
    """Each fixed-shape expert path against the loop it replaced (MoE.path "loop": split sizes read on the
    host, a Python loop over experts), on uneven loads with an expert no token chose and one whose rows span
    several blocks: the same output and the same gradients for the input, the router and every bank (fp32)."""
    torch.manual_seed(0)
    moe = MoE(16, 24, n_experts=5, top_k=top_k)
    torch.nn.init.normal_(moe.w_down, std=0.1)
    x = torch.randn(3, 40, 16)
    x[..., 0] += 4.0
    x.requires_grad_(True)
    with torch.no_grad():
        moe.router.weight[4] = 0.0
        moe.router.weight[4, 0] = -5.0  # a logit near -20: no token picks expert 4
        moe.router.weight[0, 0] = 0.3  # expert 0 takes the most
    counts = moe.apply_experts(x)[2]
    assert counts[4] == 0 and counts.max() > max(1.5 * counts.float().mean(), ffn.BLOCK_ROWS), counts
    gy = torch.randn(3, 40, 16)
    params = [x, moe.router.weight, moe.w_gate, moe.w_up, moe.w_down]
    moe.path = path
    out = moe(x)
    grads = torch.autograd.grad(out, params, gy)
    moe.path = "loop"
    ref = moe(x)
    ref_grads = torch.autograd.grad(ref, params, gy)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for name, g, r in zip(["x", "router", "w_gate", "w_up", "w_down"], grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6, msg=name)
    assert grads[2][4].abs().sum() == 0 and grads[2][0].abs().sum() > 0  # the idle expert's rows get zeros


def test_the_path_follows_the_dtype_and_is_counted():
    moe = MoE(16, 24, n_experts=4, top_k=2)
    x, c = torch.randn(2, 8, 16), Counter()
    moe(x, c)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x, c)
    assert y.dtype == torch.float32 and c == Counter({"moe.path.blocked_bmm": 1, "moe.path.grouped_mm": 1})
    moe.path = "nosuch"
    with pytest.raises(ValueError, match="MoE.path 'nosuch'"):
        moe(x)


def test_a_training_loop_can_defer_the_routing_counts_to_its_log_steps():
    """With defer_routing in training mode the counts stay on the device (no host read per forward) until
    take_routing; eval mode counts each forward as it ends. The totals are the same either way."""
    cfg = tiny(**ALL_ON)
    m = live_model(cfg).train()
    m.defer_routing = True
    idx = rand_bytes(2, 40)
    c = Counter()
    for _ in range(2):
        m(idx, counters=c)
    assert not any(k.startswith("moe.tokens.") for k in c) and c["loop.iterations"] == 2 * cfg.n_loop
    m.take_routing(c)
    assert sum(v for k, v in c.items() if k.startswith("moe.tokens.")) == 2 * 2 * 40 * cfg.moe_top_k * cfg.depth
    m.take_routing(c)  # the tally restarted at zero
    assert sum(v for k, v in c.items() if k.startswith("moe.tokens.")) == 2 * 2 * 40 * cfg.moe_top_k * cfg.depth
    e = Counter()
    m.eval()(idx, counters=e)
    assert sum(v for k, v in e.items() if k.startswith("moe.tokens.")) == 40 * 2 * cfg.moe_top_k * cfg.depth


def test_moe_counters_sum_to_tokens_times_top_k_per_application():
    cfg = tiny(**ALL_ON)
    m = live_model(cfg)
    c = Counter()
    m(rand_bytes(2, 40), counters=c)
    routed = sum(v for k, v in c.items() if k.startswith("moe.tokens.expert_"))
    assert routed == 2 * 40 * cfg.moe_top_k * cfg.depth  # depth = MoE applications (core counted n_loop times)
    assert set(k for k in c if k.startswith("moe.tokens.")) == {f"moe.tokens.expert_{e}" for e in range(cfg.n_experts)}
    assert c["moe.path.blocked_bmm"] == cfg.depth  # fp32: the padded blocks
    assert c["loop.iterations"] == cfg.n_loop
    assert c["kda_path.torch"] == cfg.depth
    assert m.aux_loss.dim() == 0 and 0 < m.aux_loss.item() < cfg.n_experts


# --------------------------------------------------------------------------------------------------
def test_loop_feeds_each_iteration_into_the_next():
    cfg = tiny(n_prelude=1, n_core=2, n_loop=3, n_coda=1, engram=True, engram_layers=(1,))
    m = live_model(cfg)
    idx = rand_bytes(2, 24)
    with torch.no_grad():
        logits, _ = m(idx)
        # by hand: prelude, core (blocks 1, 2) three times, each on the previous output, coda
        x = m.embed(idx)
        x = m.blocks[0](x, idx)
        for _ in range(3):
            x = m.blocks[2](m.blocks[1](x, idx), idx)
        x = m.blocks[3](x, idx)
        torch.testing.assert_close(logits, m.norm(x) @ m.head.weight.T, atol=1e-5, rtol=1e-5)
        # same weights, fewer iterations -> different output
        m1 = ByteLM(tiny(n_prelude=1, n_core=2, n_loop=1, n_coda=1, engram=True, engram_layers=(1,)))
        m1.load_state_dict(m.state_dict())
        m1.eval()
        logits1, _ = m1(idx)
        assert not torch.allclose(logits1, logits, atol=1e-3)
    assert m.schedule == [0, 1, 2, 1, 2, 1, 2, 3] and cfg.depth == 8


# --------------------------------------------------------------------------------------------------
def test_engram_rows_read_counter_matches_formula():
    cfg = tiny(**ALL_ON)
    m = live_model(cfg)
    c = Counter()
    B, T = 2, 40
    m(rand_bytes(B, T), counters=c)
    n_tables = len(engram_tables(cfg))
    assert n_tables == 1 + 2 + 2  # exact bigram + 2 heads each for orders 3 and 4
    applications = sum(1 for i in m.schedule if i in cfg.engram_layers)  # prelude 1 + core 2 + coda 1
    assert applications == 4
    assert c["engram.rows_read"] == B * T * n_tables * applications


def test_engram_ids_exact_bigram_hashed_heads_and_reserved_rows():
    cfg = tiny(engram=True, engram_orders=(1, 2, 3, 4), engram_heads=3, engram_rows=211)
    specs = engram_tables(cfg)
    assert [(s.order, s.head) for s in specs] == [(1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (4, 0), (4, 1), (4, 2)]
    assert specs[1].rows == 65_537 and specs[0].rows == 256
    moduli = [s.modulus for s in specs if s.hashed]
    assert len(set(moduli)) == 6 and all(_is_prime(p) and p <= 210 for p in moduli)
    eg = Engram(cfg, position=0)
    mult = eg.hash_multipliers[2:]
    assert bool((mult[mult != 0] % 2 == 1).all()) and len({tuple(r.tolist()) for r in mult}) == 6

    idx = rand_bytes(2, 30)
    ids = eg.local_ids(idx)
    assert ids.shape == (2, 30, 8)
    assert torch.equal(ids[..., 0], idx)
    assert torch.equal(ids[:, 1:, 1], idx[:, :-1] * 256 + idx[:, 1:])  # exact: prev*256 + cur
    assert (ids[:, 0, 1] == 65_536).all()  # reserved "no bigram" row at t = 0
    for j, s in enumerate(specs[2:], start=2):
        assert (ids[:, : s.order - 1, j] == s.rows - 1).all()  # reserved row before n-1 bytes of history
        assert ((ids[:, s.order - 1:, j] >= 0) & (ids[:, s.order - 1:, j] < s.modulus)).all()
        # the head's formula, by hand at one position
        t = 17
        mix = 0
        for k in range(s.order):
            mix ^= int(idx[0, t - k]) * int(eg.hash_multipliers[j, k])
        assert int(ids[0, t, j]) == mix % s.modulus
    # locality: the ids at t depend only on the last (order) bytes
    other = rand_bytes(2, 30, seed=5)
    other[:, 10:14] = idx[:, 10:14]
    same = eg.local_ids(other)[:, 13]
    torch.testing.assert_close(same, ids[:, 13])
    # distinct Engram layers hash with distinct multipliers
    assert not torch.equal(Engram(cfg, position=1).hash_multipliers, eg.hash_multipliers)


_INTERPRETED_ENGRAM = r"""
import json, torch
from benchmarks import triton_interpret
triton_interpret.apply()
from dormouse.model.config import ModelConfig
from dormouse.model.engram import Engram
from dormouse.model.engram_triton import row_ids_triton

out = {}
g = torch.Generator().manual_seed(0)
for name, orders, heads in [("1234", (1, 2, 3, 4), 3), ("23", (2, 3), 2), ("1", (1,), 1), ("5", (1, 5), 2)]:
    cfg = ModelConfig.from_dict({"d_model": 32, "n_heads": 2, "head_dim": 16, "ffn_hidden": 64, "n_core": 1,
                                 "engram": True, "engram_orders": list(orders), "engram_heads": heads,
                                 "engram_rows": 211, "engram_dim": 4})
    eg = Engram(cfg, position=1)
    m1 = eg.max_order - 1
    cases = {"fresh": (torch.randint(0, 256, (3, 70), generator=g), None, None)}
    hist = torch.randint(0, 256, (5, m1 + 2), generator=g)[:, 2:]  # strided rows, as a state's slice
    column = torch.randint(0, 256, (5, 2), generator=g)[:, :1]  # a step's bytes: a column of the step's output
    cases["step"] = (column, hist, torch.tensor([0, 1, 2, 3, 1000]))
    cases["piece"] = (torch.randint(0, 256, (2, 9), generator=g), hist[:2], torch.tensor([1, 64]))
    for case, (idx, h, start) in cases.items():
        want = eg.row_ids(idx, h, start)
        got = row_ids_triton(idx, h, start, eg.hash_multipliers, eg.hash_moduli, eg.table_orders, eg.table_rows,
                             eg.offsets, eg.vocab)
        out[f"{name}/{case}"] = {"equal": torch.equal(want, got), "shape": list(got.shape)}
print(json.dumps(out))
"""


def test_engram_row_ids_triton_kernel_gives_the_torch_forms_ids_under_triton_interpreter():
    """The CUDA path's one-kernel hash (`engram_triton`) gives `row_ids` exactly: orders 1 to 5 (exact, bigram,
    hashed heads), from the sequence start, one decode step continuing a state's history (strided, as a state's
    slice) at positions before and past every order, and a prompt piece continuing one."""
    pytest.importorskip("triton", reason="the kernel is Triton")
    res = run_interpreted(_INTERPRETED_ENGRAM)
    assert len(res) == 12 and all(r["equal"] for r in res.values()), res


def test_engram_reads_exactly_the_rows_of_the_input_ngrams():
    cfg = tiny(engram=True, engram_layers=(0,))
    m = live_model(cfg)
    eg = m.blocks[0].engram
    idx = rand_bytes(2, 32)
    read = eg.row_ids(idx).unique()
    with torch.no_grad():
        base, _ = m(idx)
        table = eg.table.weight
        saved = table.clone()
        unread = torch.ones(table.shape[0], dtype=torch.bool)
        unread[read] = False
        table[unread] += 1.0  # rows this input never reads: no effect
        torch.testing.assert_close(m(idx)[0], base)
        table.copy_(saved)
        table[read] += 0.5 * torch.randn_like(table[read])  # rows it reads: the output moves
        assert (m(idx)[0] - base).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------
COUNT_CONFIGS = {
    "plain": tiny(),
    "loop": tiny(n_prelude=1, n_core=2, n_loop=4, n_coda=2),
    "moe": tiny(moe=True, n_experts=6, moe_top_k=2),
    "engram": tiny(engram=True, engram_orders=(1, 2, 3, 5), engram_heads=3, engram_layers=(0, 1)),
    "tied_noconv": tiny(tie_embeddings=True, kda_conv_size=0),
    "all_on": tiny(**ALL_ON),
}


@pytest.mark.parametrize("name", COUNT_CONFIGS)
def test_param_count_formula_matches_model(name):
    cfg = COUNT_CONFIGS[name]
    m = ByteLM(cfg)
    n = count_params(cfg)
    assert n["total"] == sum(p.numel() for p in m.parameters())
    assert n["engram_tables"] == sum(b.engram.table.weight.numel() for b in m.blocks if b.engram is not None)
    expert = 3 * cfg.d_model * cfg.ffn_hidden
    idle = (cfg.n_experts - cfg.moe_top_k) * expert if cfg.moe else 0
    assert active_params(cfg) == n["total"] - cfg.n_blocks * idle
    # flop_params: linear weights of every applied block (top_k experts) plus the head
    applied = sum(w.numel() for i in m.schedule for mod in m.blocks[i].modules()
                  for w in ([mod.weight] if isinstance(mod, torch.nn.Linear) else
                            [mod.w_gate, mod.w_up, mod.w_down] if isinstance(mod, MoE) else [])) - cfg.depth * idle
    assert n["flop_params"] == applied + cfg.vocab_size * cfg.d_model


def test_param_count_default_config():
    cfg = ModelConfig()
    assert count_params(cfg)["total"] == sum(p.numel() for p in ByteLM(cfg).parameters())


@pytest.mark.parametrize("name", ["all_on", "tied_noconv", "engram"])
def test_param_groups_partition_and_muon_accepts_hidden(name):
    m = ByteLM(COUNT_CONFIGS[name])
    hidden, other = m.param_groups()
    ids_h, ids_o = {id(p) for p in hidden}, {id(p) for p in other}
    every = {id(p) for p in m.parameters()}
    assert not ids_h & ids_o and ids_h | ids_o == every and len(hidden) + len(other) == len(every)
    banks = [p for p in hidden if p.dim() == 3]
    assert all(p.dim() in (2, 3) for p in hidden) and len(banks) == (3 * m.cfg.n_blocks if m.cfg.moe else 0)
    named = dict(m.named_parameters())
    hidden_ends = ("q_proj.weight", "o_proj.weight", "w_gate.weight", "w_down.weight", "value_proj.weight",
                   "f_proj.0.weight", "ffn.w_gate", "ffn.w_up", "ffn.w_down")
    other_ends = ("router.weight", "A_log", "dt_bias", "table.weight", "conv1d.weight", "g_proj.1.bias",
                  "mixer_norm.weight", "o_norm_weight")
    expect_hidden = [k for k in named if k.endswith(hidden_ends)]
    expect_other = [k for k in named if k.endswith(other_ends)]
    expect_other += ["embed.weight"] + (["head.weight"] if m.head is not None else [])
    assert expect_hidden and all(id(named[k]) in ids_h for k in expect_hidden)
    assert all(id(named[k]) in ids_o for k in expect_other)
    StackedMuon(hidden, lr=0.02)  # it refuses what is neither a matrix nor a bank of them


# --------------------------------------------------------------------------------------------------
def test_tiny_overfit_one_sequence():
    torch.manual_seed(0)
    m = ByteLM(tiny(n_core=2))
    seq = torch.tensor(list(b"The quick brown fox jumps over the lazy dog; pack my box with 5 jugs"[:65]))
    x, y = seq[None, :-1], seq[None, 1:]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(50):
        _, loss = m(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m(x, y)[1].item() < first / 2, (first, loss.item())


def test_bad_engram_layers_rejected():
    with pytest.raises(ValueError, match="engram_layers"):
        ByteLM(tiny(engram=True, engram_layers=(2,)))  # n_blocks = 2
    assert isinstance(ByteLM(tiny()).blocks[0].mixer, KDAMixer)


def test_preset_parameter_counts_match_the_formula():
    """Every preset's model, built on the meta device (no memory), has the formula's parameter count."""
    from pathlib import Path

    import torch

    from dormouse.core.config import load_preset
    from dormouse.model.config import ModelConfig
    from dormouse.model.gpt import ByteLM, count_params

    root = Path(__file__).resolve().parent.parent
    for name in ("tiny", "small", "medium", "b1"):
        cfg = ModelConfig.from_dict(load_preset(name, root)["model"])
        with torch.device("meta"):
            model = ByteLM(cfg)
        counts = count_params(cfg)
        print(f"{name}: {counts['total']:,} parameters, {counts['active']:,} active")
        assert sum(p.numel() for p in model.parameters()) == counts["total"]
