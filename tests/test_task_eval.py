"""Held-out task accuracy: greedy and sampled replies graded by the same verifiers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from model_util import live_model

from dormouse.model.config import ModelConfig
from dormouse.data import chat
from dormouse.posttrain import task_eval, tasks
from dormouse.posttrain.decode import generate, generate_static
from dormouse.posttrain.settings import SampledEval, TaskSettings

CFG = ModelConfig(d_model=32, n_heads=2, head_dim=16, ffn_hidden=48, n_core=2, kda_chunk_size=16)
TASKS = TaskSettings(families=("count", "reverse"), difficulties=(1, 2), heldout_items=5, max_new_bytes=8,
                     sampled_eval=SampledEval(samples=0, temperature=1.0, seed=0))
RUN = "float32"
CPU = torch.device("cpu")


def test_sampled_accuracy_at_vanishing_temperature_is_the_greedy_accuracy(one_thread):
    model = live_model(CFG, scale=0.5)
    items = task_eval.heldout_items(TASKS)
    greedy = task_eval.accuracy(model, items, TASKS.max_new_bytes, CPU, RUN)
    cold = task_eval.sampled_accuracy(model, items, TASKS.max_new_bytes, CPU, RUN, samples=3,
                                      temperature=1e-6, seed=0, batch_items=7)
    assert cold["accuracy"] == greedy["accuracy"] and cold["by_cell"] == greedy["by_cell"]
    assert cold["malformed"] == 3 * greedy["malformed"] > 0


def test_sampled_accuracy_grades_each_sample_against_its_own_item(monkeypatch):
    """Sample s of an item answers it correctly when s < item's index mod 3 (so items differ), else
    with a well-formed wrong answer for count and a malformed reply for reverse."""
    items = task_eval.heldout_items(TASKS)
    index = {chat.prompt_bytes(it.prompt): i for i, it in enumerate(items)}

    def fake_generate_static(model, prompts, max_new, *, temperature, seeds, samples_per_prompt, step):
        assert step.dtype == "float32" and step.max_batch == 3 * samples_per_prompt  # RUN is fp32; 3 items a chunk
        assert len(seeds) == len(prompts) * samples_per_prompt
        out = []
        for p in prompts:
            it = items[index[p]]
            for s in range(samples_per_prompt):
                if s < index[p] % 3:
                    out.append(it.answer.encode() + bytes([chat.END]))
                else:
                    out.append(b"99\x03" if it.family == "count" else b"no end")
        return out

    monkeypatch.setattr(task_eval, "generate_static", fake_generate_static)
    r = task_eval.sampled_accuracy(live_model(CFG), items, 8, CPU, RUN, samples=4, temperature=1.0, seed=0, batch_items=3)
    right = [min(i % 3, 4) for i in range(len(items))]
    assert r["accuracy"] == round(sum(right) / (4 * len(items)), 5)
    for cell in r["by_cell"]:
        fam, d = cell.split("@")
        idx = [i for i, it in enumerate(items) if it.family == fam and it.difficulty == int(d)]
        assert r["by_cell"][cell] == round(sum(right[i] for i in idx) / (4 * len(idx)), 5)
    reverse = [i for i, it in enumerate(items) if it.family == "reverse"]
    assert r["malformed"] == sum(4 - right[i] for i in reverse)



def test_greedy_and_sampled_replies_decode_in_the_runs_precision(monkeypatch):
    """decode's steps default to bf16 on CUDA; task_eval passes the run's own precision (train.dtype), so an fp32
    run's held-out accuracy is not decoded in bf16 while its BPB is scored in fp32."""
    seen = []

    def fake_generate_static(model, prompts, max_new, **kw):
        seen.append(kw["step"].dtype)
        return [b"1\x03"] * len(prompts) * kw.get("samples_per_prompt", 1)

    monkeypatch.setattr(task_eval, "generate_static", fake_generate_static)
    items = task_eval.heldout_items(TASKS)[:2]
    for run in ("float32", "bfloat16"):
        seen.clear()
        task_eval.answer(live_model(CFG), items, 4, CPU, run)
        task_eval.sampled_accuracy(live_model(CFG), items, 4, CPU, run, samples=2, temperature=1.0, seed=0)
        assert seen == [run, run], (run, seen)


def test_sampled_accuracy_is_seeded(one_thread):
    model = live_model(CFG, scale=0.5)
    items = task_eval.heldout_items(TASKS)
    draw = lambda seed: task_eval.sampled_accuracy(model, items, TASKS.max_new_bytes, CPU, RUN, samples=4,
                                                   temperature=1.0, seed=seed)
    a = draw(0)
    assert a == draw(0)
    assert a["samples_per_item"] == 4 and a["temperature"] == 1.0 and 0 <= a["malformed"] <= 4 * len(items)


def test_a_sampled_rows_bytes_depend_on_its_seed_item_and_sample_only(monkeypatch, one_thread):
    """Sample s of item i draws from sample_seed(seed, i, s) through the per-row RNG: the same replies (so grades)
    whatever the chunks, however many samples are asked, and alone in a batch of one."""
    model = live_model(CFG, scale=0.5)
    items = task_eval.heldout_items(TASKS)
    replies = []
    grade = task_eval.grade
    monkeypatch.setattr(task_eval, "grade", lambda it, g: replies.append(g) or grade(it, g))

    def draw(samples, batch_items):
        replies.clear()
        r = task_eval.sampled_accuracy(model, items, TASKS.max_new_bytes, CPU, RUN, samples=samples,
                                       temperature=1.0, seed=5, batch_items=batch_items)
        return r, list(replies)

    (r, got), (r1, got1) = draw(3, None), draw(3, 1)
    assert got == got1 and r == r1 and len(got) == 3 * len(items)
    assert draw(3, 7)[1] == got
    assert len(set(got)) > len(items)  # samples differ: a row's seed is its own
    two = draw(2, 4)[1]
    assert two == [g for j, g in enumerate(got) if j % 3 < 2]
    i, s = 6, 2
    alone = generate_static(model, [chat.prompt_bytes(items[i].prompt)], TASKS.max_new_bytes, temperature=1.0,
                            seeds=[task_eval.sample_seed(5, i, s)], bf16=False)
    assert alone == [got[3 * i + s]]


def test_greedy_replies_through_chunks_are_generates(one_thread):
    """answer decodes through generate_static in chunks of rows: greedy, so eager generate's bytes, any chunking."""
    model = live_model(CFG, scale=0.5)
    items = task_eval.heldout_items(TASKS)
    prompts = [chat.prompt_bytes(it.prompt) for it in items]
    want = generate(model, prompts, TASKS.max_new_bytes, temperature=0.0, bf16=False)
    assert task_eval.answer(model, items, TASKS.max_new_bytes, CPU, RUN) == want
    assert task_eval.answer(model, items, TASKS.max_new_bytes, CPU, RUN, batch=3) == want
    assert task_eval.chunk_rows(model, CPU, RUN, 256) == 256
    assert 0 < task_eval.row_state_bytes(model, CPU, RUN) < 1 << 20


def test_dev_items_share_no_prompt_with_rl_training_or_the_held_out_set():
    params = TaskSettings(families=("add", "sort"), difficulties=(1, 2), heldout_items=16, max_new_bytes=8,
                          sampled_eval=SampledEval(samples=0, temperature=1.0, seed=0))
    dev = task_eval.dev_items(params, 16)
    assert all(it.split == "dev" for it in dev) and len({it.prompt for it in dev}) == len(dev)
    assert task_eval.cell_counts(dev) == {"add@1": 12, "add@2": 16, "sort@1": 16, "sort@2": 16}  # add@1 holds 12
    stream = task_eval.item_stream("rl", list(params.families), lambda fam, rng: rng.choice([1, 2]), 0)
    trained = {next(stream).prompt for _ in range(4000)}  # covers the rl share of add@1 many times over
    dev_prompts = {it.prompt for it in dev}
    assert not dev_prompts & trained
    assert not dev_prompts & {it.prompt for it in task_eval.heldout_items(params)}


def test_spread_streams_of_two_seeds_train_different_prompts_and_never_repeat_early():
    def cells(seed, spread):
        stream = task_eval.item_stream("rl", ["add"], lambda fam, rng: 2, seed, spread)
        return [next(stream).prompt for _ in range(200)]

    assert cells(0, False) == cells(1, False)  # without spread every seed walks one sequence (the old rl)
    a, b = cells(0, True), cells(1, True)
    assert a == cells(0, True) and sum(x == y for x, y in zip(a, b)) == 0  # seeded, and no longer in step
    assert len(set(a) & set(b)) < 40  # what two independent draws share of add@2's ~1 500 rl prompts (16 here)


def test_constant_baseline_is_the_best_fixed_reply_per_cell():
    def item(fam, d, ans):
        return tasks.Item(fam, d, 0, "p", ans)

    items = [item("count", 1, "1"), item("count", 1, "1"), item("count", 1, "2"),
             item("mul", 1, "0"), item("mul", 1, "6"), item("mul", 2, "12")]
    # count@1: "1" hits 2 of 3; mul@1: any one of 2 hits 1; mul@2: 1 of 1
    assert task_eval.constant_baseline(items) == round((2 + 1 + 1) / 6, 5)


def test_a_skipped_cell_never_comes_from_the_stream():
    """rl.skip_cells: the stream draws again, so no item of a skipped (family, difficulty) and the rest still come."""
    stream = task_eval.item_stream("rl", ["add", "sort"], lambda fam, rng: rng.choice([1, 2]), 0,
                                   skip=frozenset({("sort", 2)}))
    cells = Counter((it.family, it.difficulty) for it in (next(stream) for _ in range(400)))
    assert ("sort", 2) not in cells and {("add", 1), ("add", 2), ("sort", 1)} <= set(cells)
    with pytest.raises(RuntimeError, match="no cell open"):
        next(task_eval.item_stream("rl", ["add"], lambda fam, rng: 1, 0, skip=frozenset({("add", 1)})))


def test_skip_cells_must_name_cells_rl_trains_and_leave_one():
    from dormouse.core.config import ConfigError
    from dormouse.planner.registry import rl_skip_cells

    tp = {"families": ["add", "sort"], "difficulties": [1, 2]}
    cur = {"start": 1, "max": None}
    assert rl_skip_cells({"curriculum": cur, "skip_cells": ["sort@2"]}, tp) == {("sort", 2)}
    with pytest.raises(ConfigError, match="'mul@1' is no cell rl trains"):
        rl_skip_cells({"curriculum": cur, "skip_cells": ["mul@1"]}, tp)
    with pytest.raises(ConfigError, match="leaves rl no cell"):
        rl_skip_cells({"curriculum": cur, "skip_cells": ["add@1", "add@2", "sort@1", "sort@2"]}, tp)
    # under the curriculum a family's lower cell cannot go while a higher one stays: it would never be promoted past it
    with pytest.raises(ConfigError, match="add@1 lies below add@2"):
        rl_skip_cells({"curriculum": cur, "skip_cells": ["add@1"]}, tp)
    assert rl_skip_cells({"curriculum": cur, "skip_cells": ["add@1", "add@2"]}, tp) == {("add", 1), ("add", 2)}
    assert rl_skip_cells({"curriculum": cur, "prompts": "pass_rate", "skip_cells": ["add@1"]}, tp) == {("add", 1)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's kernels)")
def test_held_out_replies_through_graphed_chunks_are_eager_generates_on_cuda(monkeypatch):
    """bench's held-out decode on the GPU: greedy replies through generate_static's CUDA graphs, in one chunk or in
    chunks of 24 rows through one step (the last padded), are eager generate's on most rows (the kernels' batch
    shapes differ, which may break a near-tie), fp32 and bf16; sampled replies at a vanishing temperature grade as
    the greedy ones."""
    from test_decode import CONFIGS
    from test_decode import live_model as decode_model

    from dormouse.train.runtime import autocast, uses_bf16

    cuda = torch.device("cuda")
    model = decode_model(CONFIGS["all_on_conv4"], scale=0.5).cuda()
    task_set = TaskSettings(families=("add", "reverse", "count"), difficulties=(1, 2), heldout_items=10,
                            max_new_bytes=12, sampled_eval=SampledEval(samples=0, temperature=1.0, seed=0))
    items = task_eval.heldout_items(task_set)
    prompts = [chat.prompt_bytes(it.prompt) for it in items]
    assert len(items) > 48  # three chunks of 24 rows below, the last padded
    for dtype in ("float32", "bfloat16"):
        with autocast(cuda, dtype):
            want = generate(model, prompts, 12, temperature=0.0, bf16=uses_bf16(dtype))
        got = task_eval.answer(model, items, 12, cuda, dtype)
        assert sum(g == w for g, w in zip(got, want, strict=True)) >= 0.9 * len(items), dtype
        one_row = task_eval.row_state_bytes(model, cuda, dtype)
        assert task_eval.chunk_rows(model, cuda, dtype, 256) == task_eval.DECODE_STATE_BUDGET // one_row
        with monkeypatch.context() as m:
            m.setattr(task_eval, "DECODE_STATE_BUDGET", 24 * one_row)
            assert task_eval.chunk_rows(model, cuda, dtype, 256) == 24
            chunked = task_eval.answer(model, items, 12, cuda, dtype)
        assert sum(c == g for c, g in zip(chunked, got, strict=True)) >= 0.9 * len(items), dtype
    greedy = task_eval.accuracy(model, items, 12, cuda, "float32")
    cold = task_eval.sampled_accuracy(model, items, 12, cuda, "float32", samples=2, temperature=1e-6, seed=0)
    assert cold["accuracy"] == pytest.approx(greedy["accuracy"], abs=0.1) and cold["samples_per_item"] == 2
