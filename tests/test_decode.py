"""Recurrent decoding (ByteLM.prefill / step, LMState, dormouse.posttrain.decode.generate) against the full forward.

Every model here has its weights perturbed away from init (init zeroes the residual branches' output
projections and the Engram conv, so a fresh model's blocks are inert and parity would check nothing).
fp32 on CPU throughout; the FLA recurrent kernel is checked against the torch recurrence on a GPU only.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import model_util
import pytest
import torch
from model_util import rand_bytes

from interpret_util import run_interpreted
from dormouse.model.config import ModelConfig
from dormouse.model.engram import Engram
from dormouse.model.gpt import ByteLM, LMState, cat_states
from dormouse.model.kda import kda_recurrent, l2norm, recurrent_kda_torch
from dormouse.posttrain.decode import generate, prefill_prompts, sample_next

TINY = dict(d_model=32, n_heads=2, head_dim=16, ffn_hidden=48, n_core=2, kda_chunk_size=16,
            n_experts=4, moe_top_k=2, engram_rows=97, engram_dim=8)
# prelude + core looped twice + coda, MoE, an Engram on every distinct block (so also on the looped core)
ALL_ON = dict(n_prelude=1, n_core=1, n_loop=2, n_coda=1, moe=True, engram=True, engram_layers=(0, 1, 2))
CONFIGS = {
    "all_on_conv4": dict(ALL_ON, kda_conv_size=4),
    "all_on_conv0": dict(ALL_ON, kda_conv_size=0),
    "engram_order5_dense": dict(n_core=2, engram=True, engram_orders=(1, 2, 5), engram_layers=(1,)),
    "plain": dict(n_core=2),
}
# fp32, chunked forward vs step-by-step on O(1) logits: typically 1e-6, spikes to ~3e-5 over seeds. That is
# rounding (batched vs single-row matmuls, amplified where a mixer output is small and its gated RMSNorm
# rescales it), not the algorithm: the same comparison in float64 agrees to 1e-13 (the fp64 test below).
ATOL, RTOL = 5e-5, 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def live_model(cfg_kw: dict, seed: int = 0, scale: float = 0.05) -> ByteLM:
    return model_util.live_model(ModelConfig(**{**TINY, **cfg_kw}), seed, scale)


def full_logits(m: ByteLM, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(idx)[0]


def rand_prompt(n: int, seed: int) -> bytes:
    return bytes(rand_bytes(1, n, seed)[0].tolist())


# --------------------------------------------------------------------------------------------------
# Parity with the full forward
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_step_by_step_and_prefill_then_steps_match_full_forward(name):
    m = live_model(CONFIGS[name])
    T = 37  # no multiple of the chunk (16)
    idx = rand_bytes(2, T)
    ref = full_logits(m, idx)  # [2, T, V]
    counters = Counter()
    with torch.no_grad():
        state, steps = None, []
        for t in range(T):
            lg, state = m.step(idx[:, t], state, counters)
            steps.append(lg)
        torch.testing.assert_close(torch.stack(steps, 1), ref, atol=ATOL, rtol=RTOL)
        n_mixer_calls = m.cfg.depth * T
        assert counters["kda_path.torch_recurrent"] == n_mixer_calls and "kda_path.torch" not in counters
        for cut in (1, 2, 3, 17, 33):  # shorter than the Engram history / conv window, across a chunk edge
            lg, st = m.prefill(idx[:, :cut])
            torch.testing.assert_close(lg, ref[:, :cut], atol=ATOL, rtol=RTOL)
            outs = []
            for t in range(cut, T):
                lg_t, st = m.step(idx[:, t], st)
                outs.append(lg_t)
            torch.testing.assert_close(torch.stack(outs, 1), ref[:, cut:], atol=ATOL, rtol=RTOL)
            # a multi-byte continuation (chunked path with an initial state) too
            lg2, st2 = m.prefill(idx[:, cut:], m.prefill(idx[:, :cut])[1])
            torch.testing.assert_close(lg2, ref[:, cut:], atol=ATOL, rtol=RTOL)
            for a, b in zip(st2.tensors(), st.tensors()):
                torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["all_on_conv4", "all_on_conv0"])
def test_step_by_step_is_exact_in_float64(name, monkeypatch):
    """The model runs its sensitive parts in fp32 through `.float()`; with `.float()` a no-op on float64
    tensors the whole model runs in fp64, and stepping matches the full forward to rounding (1e-13)."""
    to_fp32 = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: t if t.dtype == torch.float64 else to_fp32(t))
    m = live_model(CONFIGS[name], seed=2).double()
    idx = rand_bytes(2, 37, seed=7)
    with torch.no_grad():
        ref = m(idx)[0]
        state, steps = m.prefill(idx[:, :5])[1], []
        for t in range(5, 37):
            lg, state = m.step(idx[:, t], state)
            steps.append(lg)
    assert ref.dtype == torch.float64 and state.blocks[1].mixer.recurrent.dtype == torch.float64
    torch.testing.assert_close(torch.stack(steps, 1), ref[:, 5:], atol=1e-10, rtol=1e-10)


def test_training_forward_unchanged_by_the_state_plumbing():
    m = live_model(CONFIGS["all_on_conv4"])
    idx = rand_bytes(2, 20)
    logits, loss = m(idx, torch.roll(idx, -1, 1))
    assert loss.requires_grad and logits.shape == (2, 20, 256)
    lg, state = m.prefill(idx)
    assert torch.equal(lg, logits) and isinstance(state, LMState)


def test_engram_ids_with_history_equal_the_full_sequence_ids():
    cfg = ModelConfig(**{**TINY, "engram": True, "engram_orders": (1, 2, 3, 5)})
    eg = Engram(cfg, position=0)
    idx = rand_bytes(3, 30)
    full = eg.local_ids(idx)
    for cut in (1, 2, 4, 11):
        hist = torch.nn.functional.pad(idx[:, :cut], (4, 0))[:, -4:]  # last 4 bytes, zeros before the start
        part = eg.local_ids(idx[:, cut:], hist, torch.full((3,), cut))
        assert torch.equal(part, full[:, cut:])
    # rows at different absolute positions in one batch: the reserved rows follow each row's own position
    hist, start = torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 3])
    ids = eg.local_ids(idx[:2, :1], hist, start)  # [2, 1, n_tables]
    reserved = torch.tensor([s.rows - 1 for s in eg.specs])
    orders = torch.tensor([s.order for s in eg.specs])
    assert torch.equal(ids[0, 0] == reserved, orders >= 2)  # position 0: every order >= 2 has no n-gram
    assert torch.equal(ids[1, 0] == reserved, orders >= 5)  # position 3: only order 5 lacks history


# --------------------------------------------------------------------------------------------------
# The state: layout, size, batch operations
# --------------------------------------------------------------------------------------------------
def test_state_layout_and_size_independent_of_bytes_consumed():
    m = live_model(CONFIGS["all_on_conv4"])
    cfg = m.cfg
    with torch.no_grad():
        _, s_short = m.prefill(rand_bytes(2, 3))
        _, s_long = m.prefill(rand_bytes(2, 90))
        _, s_stepped = m.step(torch.tensor([7, 9]), s_long)
    assert len(s_short.blocks) == cfg.depth == 4 and m.schedule == [0, 1, 1, 2] and s_short.batch_size == 2
    shapes = [t.shape for t in s_short.tensors()]
    assert shapes == [t.shape for t in s_long.tensors()] == [t.shape for t in s_stepped.tensors()]
    assert sum(t.numel() for t in s_long.tensors()) == sum(t.numel() for t in s_short.tensors())
    blk = s_long.blocks[1]  # the core's first iteration (blocks[2]: its second)
    assert blk.mixer.recurrent.shape == (2, 2, 16, 16) and blk.mixer.recurrent.dtype == torch.float32
    assert [c.shape for c in blk.mixer.conv] == [(2, 3, 32)] * 3
    eg = m.blocks[1].engram
    assert blk.engram.bytes.shape == (2, eg.max_order - 1) and blk.engram.conv.shape == (2, 3 * eg.max_order, 32)
    assert blk.engram.n_seen.tolist() == [90, 90] and s_stepped.blocks[1].engram.n_seen.tolist() == [91, 91]
    # the looped core block keeps one state per iteration: same weights, different states
    assert not torch.allclose(s_long.blocks[1].mixer.recurrent, s_long.blocks[2].mixer.recurrent)
    assert not torch.allclose(s_long.blocks[1].engram.conv, s_long.blocks[2].engram.conv)


def test_state_select_repeat_cat_equal_separate_runs():
    m = live_model(CONFIGS["all_on_conv4"])
    a, b = rand_bytes(3, 9, seed=2), rand_bytes(2, 21, seed=3)  # different lengths (positions differ)
    nxt = torch.tensor([5, 200, 17])
    with torch.no_grad():
        _, sa = m.prefill(a)
        _, sb = m.prefill(b)
        ref_a = m.step(nxt, sa)[0]  # [3, V]
        ref_b = m.step(nxt[:2], sb)[0]
        # select (indices, reordered) and a bool mask
        sel = m.step(nxt[[2, 0]], sa.select([2, 0]))[0]
        torch.testing.assert_close(sel, ref_a[[2, 0]], atol=1e-6, rtol=1e-6)
        mask = m.step(nxt[1:], sa.select(torch.tensor([False, True, True])))[0]
        torch.testing.assert_close(mask, ref_a[1:], atol=1e-6, rtol=1e-6)
        # repeat_interleave: each row G times in a row
        rep = m.step(nxt.repeat_interleave(2), sa.repeat_interleave(2))[0]
        torch.testing.assert_close(rep, ref_a.repeat_interleave(2, 0), atol=1e-6, rtol=1e-6)
        # cat: two batches prefilled separately (at different positions), stepped together
        both = m.step(torch.cat([nxt, nxt[:2]]), cat_states([sa, sb]))[0]
        torch.testing.assert_close(both, torch.cat([ref_a, ref_b]), atol=1e-6, rtol=1e-6)
        # and the joined batch keeps matching the full forward over several steps
        st, cur, seqs = cat_states([sa, sb]), torch.cat([nxt, nxt[:2]]), [list(r) for r in a.tolist()] + [
            list(r) for r in b.tolist()]
        for _ in range(4):
            lg, st = m.step(cur, st)
            for r, c in zip(seqs, cur.tolist()):
                r.append(c)
            for r, row_lg in zip(seqs, lg):
                torch.testing.assert_close(row_lg, full_logits(m, torch.tensor([r]))[0, -1], atol=ATOL, rtol=RTOL)
            cur = lg.argmax(-1)
    with pytest.raises(ValueError, match="block states"):
        m.prefill(a, LMState(sa.blocks[:-1]))


# --------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------
def greedy_by_full_forward(m: ByteLM, prompt: bytes, n: int, stop: int | None) -> bytes:
    seq, out = list(prompt), []
    for _ in range(n):
        b = int(full_logits(m, torch.tensor([seq]))[0, -1].argmax())
        seq.append(b)
        out.append(b)
        if b == stop:
            break
    return bytes(out)


def test_greedy_equals_repeated_full_forward_argmax_and_mixed_lengths_batch():
    m = live_model(CONFIGS["all_on_conv4"])
    prompts = [rand_prompt(5, 10), rand_prompt(1, 11), rand_prompt(12, 12), rand_prompt(5, 13)]
    counters = Counter()
    outs = generate(m, prompts, 15, stop_byte=None, counters=counters)
    assert [len(o) for o in outs] == [15] * 4  # max length
    for p, o in zip(prompts, outs):
        assert o == greedy_by_full_forward(m, p, 15, None)
        assert generate(m, [p], 15, stop_byte=None) == [o]  # one-by-one == batched
    assert counters["decode.prompt_bytes"] == 23 and counters["decode.new_bytes"] == 60
    assert counters["decode.rows_stopped.max_new_bytes"] == 4
    # per mixer call: prefills of lengths 5 and 12 chunked, of length 1 a recurrent step; then 14 batched steps
    assert counters["kda_path.torch"] == 2 * m.cfg.depth
    assert counters["kda_path.torch_recurrent"] == (1 + 14) * m.cfg.depth


def test_stop_byte_ends_a_row_and_the_rest_continue():
    m = live_model(CONFIGS["all_on_conv4"])
    prompts = [rand_prompt(6, 20), rand_prompt(3, 21)]
    free = generate(m, prompts, 12, stop_byte=None)
    stop = free[0][4]  # a byte row 0 emits at step 5
    outs = generate(m, prompts, 12, stop_byte=stop)
    for f, o in zip(free, outs):
        cut = f.find(bytes([stop]))
        expect = f if cut < 0 else f[: cut + 1]  # stop byte included, nothing after it
        assert o == expect
    assert outs[0][-1] == stop and len(outs[0]) <= 5
    assert generate(m, prompts, 0) == [b"", b""]
    with pytest.raises(ValueError, match="empty prompt"):
        generate(m, [b"ab", b""], 3)
    with pytest.raises(AssertionError, match="eval"):
        generate(m.train(), prompts, 3)


def test_sampling_seeded_reproducible_top_k_1_is_greedy_and_logprobs_are_raw():
    m = live_model(CONFIGS["all_on_conv0"])
    prompts = [rand_prompt(4, 30), rand_prompt(9, 31), rand_prompt(4, 32)]

    def sample(seed, **kw):
        return generate(m, prompts, 20, temperature=1.3, stop_byte=None,
                        generator=torch.Generator().manual_seed(seed), **kw)

    a, b, c = sample(0), sample(0), sample(1)
    assert a == b and a != c
    assert sample(0, top_k=1) == generate(m, prompts, 20, stop_byte=None)
    # top_k = 5: every sampled byte is among the 5 largest logits there
    for p, (o, lp) in zip(prompts, sample(2, top_k=5, return_logprobs=True)):
        logits = full_logits(m, torch.tensor([list(p + o)]))[0, len(p) - 1 : -1]  # [n, V] at each sampled byte
        ranks = (logits > logits.gather(-1, torch.tensor(list(o))[:, None])).sum(-1)
        assert (ranks < 5).all()
        # log-probs: log_softmax of the raw logits (no temperature, no top-k) at the sampled bytes
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(o))[:, None])[:, 0]
        assert lp.shape == (len(o),) and lp.dtype == torch.float32
        torch.testing.assert_close(lp, ref, atol=1e-4, rtol=1e-5)


def test_samples_per_prompt_equals_repeated_prompts():
    m = live_model(CONFIGS["all_on_conv4"])
    prompts = [rand_prompt(4, 60), rand_prompt(7, 61)]
    counters = Counter()
    grouped = generate(m, prompts, 10, temperature=1.0, stop_byte=None, samples_per_prompt=3, counters=counters,
                       generator=torch.Generator().manual_seed(4), return_logprobs=True)
    flat = generate(m, [p for p in prompts for _ in range(3)], 10, temperature=1.0, stop_byte=None,
                    generator=torch.Generator().manual_seed(4), return_logprobs=True)
    assert [o for o, _ in grouped] == [o for o, _ in flat] and len({o for o, _ in grouped[:3]}) > 1
    for (_, a), (_, b) in zip(grouped, flat):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert counters["decode.prompt_bytes"] == 11  # each prompt prefilled once
    assert generate(m, prompts, 6, stop_byte=None, samples_per_prompt=2) == [
        o for o in generate(m, prompts, 6, stop_byte=None) for _ in range(2)]


def test_sample_next_greedy_and_top_k_mask():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]])
    assert sample_next(logits).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, 1.0, 2, g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0, 2}
    with pytest.raises(ValueError):
        sample_next(logits, -1.0)


def test_prefill_prompts_groups_lengths_and_restores_order():
    m = live_model(CONFIGS["engram_order5_dense"])
    prompts = [rand_prompt(7, 40), rand_prompt(3, 41), rand_prompt(7, 42)]
    counters = Counter()
    with torch.no_grad():
        logits, state = prefill_prompts(m, prompts, counters)
        for i, p in enumerate(prompts):
            lg, st = m.prefill(torch.tensor([list(p)]))
            torch.testing.assert_close(logits[i], lg[0, -1], atol=1e-6, rtol=1e-6)
            for a, b in zip(state.select([i]).tensors(), st.tensors()):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert counters["kda_path.torch"] == 2 * m.cfg.depth  # two distinct lengths: two prefills


def test_prefill_prompts_continues_each_rows_state():
    """The serve batcher's chunked prefill: pieces of equal length, some starting a prompt and some continuing one
    (a state per row), in one call, give each prompt's whole-prompt logits and state (separate prefills per
    start/continue group: a batch cannot mix a None state with states)."""
    m = live_model(CONFIGS["all_on_conv4"])
    prompts = [rand_prompt(45, 50), rand_prompt(29, 51), rand_prompt(16, 52)]
    counters = Counter()
    with torch.no_grad():
        whole_lg, whole_st = prefill_prompts(m, prompts)
        _, head = prefill_prompts(m, [prompts[0][:16], prompts[1][:13]])  # cut across the KDA chunk (16) and not
        lg, st = prefill_prompts(m, [prompts[0][16:32], prompts[1][13:], prompts[2]], counters,
                                 [head.select([0]), head.select([1]), None])
        lg0, st0 = prefill_prompts(m, [prompts[0][32:]], None, [st.select([0])])
    assert counters["kda_path.torch"] == 2 * m.cfg.depth  # 16 bytes continuing, 16 bytes starting: two prefills
    torch.testing.assert_close(torch.cat([lg0, lg[1:]]), whole_lg, atol=ATOL, rtol=RTOL)
    for a, b in zip(cat_states([st0, st.select([1, 2])]).tensors(), whole_st.tensors()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="2 states for 3 prompts"):
        prefill_prompts(m, prompts, None, [None, None])


# --------------------------------------------------------------------------------------------------
# The KDA recurrence itself
# --------------------------------------------------------------------------------------------------
def _fla_naive():
    spec = importlib.util.find_spec("fla")
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    file_spec = importlib.util.spec_from_file_location("_fla_kda_naive_decode", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


def kda_inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = l2norm(r(B, T, H, K)), l2norm(r(B, T, H, K)), r(B, T, H, V)
    g = -torch.nn.functional.softplus(r(B, T, H, K)) * 0.5
    return q, k, v, g, torch.sigmoid(r(B, T, H)), r(B, H, K, V)


def test_recurrent_kda_torch_matches_fla_naive_recurrent_and_counts_its_path():
    q, k, v, g, beta, h0 = kda_inputs(2, 13, 2, 8, 12)
    o, s = recurrent_kda_torch(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = _fla_naive().naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref.float(), atol=1e-5, rtol=1e-5)
    counters = Counter()
    o1, s1 = kda_recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h0, counters=counters)
    assert counters == {"kda_path.torch_recurrent": 1} and o1.shape == (2, 1, 2, 12) and s1.shape == h0.shape
    o0, s0 = recurrent_kda_torch(q, k, v, g, beta)  # no initial state = zeros
    torch.testing.assert_close(o0, recurrent_kda_torch(q, k, v, g, beta, initial_state=torch.zeros_like(h0))[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FLA's Triton kernels)")
def test_fla_recurrent_matches_torch_recurrence_and_generate_runs_on_gpu():
    q, k, v, g, beta, h0 = kda_inputs(3, 1, 4, 64, 64, seed=5)
    counters = Counter()
    with torch.inference_mode():
        o, s = kda_recurrent(*(x.cuda() for x in (q, k, v, g, beta)), initial_state=h0.cuda(), counters=counters)
    assert counters == {"kda_path.fla_recurrent": 1}
    o_ref, s_ref = recurrent_kda_torch(q, k, v, g, beta, initial_state=h0)
    torch.testing.assert_close(o.cpu(), o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s.cpu(), s_ref, atol=1e-4, rtol=1e-4)
    # the model on the GPU (FLA chunk prefill + FLA recurrent steps) against itself on the CPU, fp32
    m = live_model(CONFIGS["all_on_conv4"])
    idx = rand_bytes(2, 40, seed=8)
    with torch.inference_mode():
        lg_cpu, st = m.prefill(idx[:, :30])
        steps_cpu = [lg_cpu[:, -1]]
        for t in range(30, 40):
            lg, st = m.step(idx[:, t], st)
            steps_cpu.append(lg)
        m.cuda()
        counters = Counter()
        lg_gpu, st = m.prefill(idx[:, :30].cuda(), None, counters)
        steps_gpu = [lg_gpu[:, -1]]
        for t in range(30, 40):
            lg, st = m.step(idx[:, t].cuda(), st, counters)
            steps_gpu.append(lg)
    assert counters["kda_path.fla"] == m.cfg.depth and counters["kda_path.fla_recurrent"] == 10 * m.cfg.depth
    torch.testing.assert_close(torch.stack(steps_gpu, 1).cpu(), torch.stack(steps_cpu, 1), atol=5e-3, rtol=5e-3)
    outs = generate(m, [rand_prompt(6, 50), rand_prompt(2, 51)], 10, temperature=1.0, top_k=20, stop_byte=None,
                    generator=torch.Generator().manual_seed(0), return_logprobs=True)  # bf16 autocast
    assert [len(o) for o, _ in outs] == [10, 10] and all(torch.isfinite(lp).all() for _, lp in outs)


_INTERPRETED_STEPS = r"""
import json, sys, torch
from collections import Counter
from benchmarks import triton_interpret
triton_interpret.apply()
sys.path.insert(0, "tests")
from test_decode import CONFIGS, live_model
from dormouse.model import kda
from dormouse.posttrain import rowrng

out = {}
for name in ("all_on_conv4", "engram_order5_dense"):
    m = live_model(CONFIGS[name]).eval()
    idx = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, state = m.prefill(idx[:, :9])  # the prompt on the torch path
        ref, st = [], state
        for t in range(9, 12):
            lg, st = m.step(idx[:, t], st)
            ref.append(lg)
        kda.on_gpu = rowrng.on_gpu = lambda t: True  # every CUDA branch, Triton interpreted
        c, st, errs = Counter(), state, []
        for i, t in enumerate(range(9, 12)):
            lg, st = m.step(idx[:, t], st, c)
            errs.append((lg - ref[i]).abs().max().item())
        kda.on_gpu = rowrng.on_gpu = lambda t: t.is_cuda
    out[name] = {"err": max(errs), "counters": {k: v for k, v in c.items() if "path" in k}}
print(json.dumps(out))
"""


def test_decode_steps_on_every_cuda_branch_give_the_torch_paths_logits_under_triton_interpreter():
    """Whole-model decode steps with every CUDA branch taken (one-launch convs, FLA's recurrent kernel and gated
    norm, Engram's one-kernel hash), Triton interpreted on the CPU, continue a prompt's state to the logits the
    torch path gives (fp32; MoE, loop, Engram and an order-5 Engram model)."""
    pytest.importorskip("fla.ops.kda", reason="fla-core (with triton): the CUDA branches' kernels")
    res = run_interpreted(_INTERPRETED_STEPS)
    for name, r in res.items():
        assert r["err"] <= 1e-4, (name, r)
        c = r["counters"]
        assert c.get("kda_gates.torch", 0) == 0 and c.get("norm_gate_path.torch", 0) == 0, (name, c)
        assert c["conv_path.triton_step"] > 0 or CONFIGS[name].get("kda_conv_size") == 0, (name, c)
    assert res["engram_order5_dense"]["counters"]["engram.hash_path.triton"] > 0
