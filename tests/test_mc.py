"""dormouse.posttrain.mc: the positions a choice is scored at (against a hand computation on a model whose logits
we set), acc vs acc_bytes, ties, dropping (never truncating) items that do not fit, the jsonl loader's
errors, and cloze items built only from real text."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from model_util import live_model
from torch import nn

from dormouse.model.config import ModelConfig
from dormouse.posttrain import mc

torch.set_num_threads(1)
TASK = Path(__file__).parent / "data" / "bench_tiny_task.jsonl"
TINY = dict(d_model=32, n_heads=2, head_dim=16, ffn_hidden=48, n_core=2, kda_chunk_size=16)


class TableLM(nn.Module):
    """logits[b, t] = byte_table[idx[b, t]] + pos_table[t]: depends on the byte AND the position, so a
    score read one position off cannot match the hand computation. Records every input it sees."""

    def __init__(self, seed: int = 0, T: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.byte_table = torch.randn(256, 256, generator=g) * 3
        self.pos_table = torch.randn(T, 256, generator=g) * 3
        self.inputs: list[torch.Tensor] = []

    def forward(self, idx, targets=None):
        self.inputs.append(idx.clone())
        return self.byte_table[idx] + self.pos_table[: idx.shape[1]][None], None

    def hand_logprob(self, seq: bytes, t: int, target: int) -> float:
        """log p(target | seq[: t + 1]) from the logits at position t, in float64 Python."""
        row = [float(a + b) for a, b in zip(self.byte_table[seq[t]], self.pos_table[t])]
        m = max(row)
        return row[target] - (m + math.log(sum(math.exp(r - m) for r in row)))


class FixedLM(nn.Module):
    """The same next-byte distribution everywhere: log p(byte) = logp[byte]."""

    def __init__(self, logp: dict[int, float]):
        super().__init__()
        rest = (1 - sum(math.exp(v) for v in logp.values())) / (256 - len(logp))
        self.row = torch.full((256,), math.log(rest))
        for b, v in logp.items():
            self.row[b] = v
        self.calls = 0

    def forward(self, idx, targets=None):
        self.calls += 1
        return self.row.expand(*idx.shape, 256).clone(), None


# ---- positions ----------------------------------------------------------------------------------
def test_score_matches_hand_computation_position_by_position():
    model = TableLM()
    context, choices = b"The cat", [b" sat", b" ran off", b"!"]
    got = mc.score_choices(model, context, choices, window=32, device="cpu")
    for (lp, nb), c in zip(got, choices):
        seq = context + c
        # c[0] is predicted by the logits at the LAST CONTEXT position (len(context) - 1), c[j] at +j
        want = sum(model.hand_logprob(seq, len(context) - 1 + j, c[j]) for j in range(len(c)))
        assert nb == len(c)
        assert lp == pytest.approx(want, abs=1e-4)
    assert len(model.inputs) == 1, "the choices of one item share one forward"
    x = model.inputs[0]
    assert x.shape == (3, len(context) + len(b" ran off") - 1)  # the last choice byte is never an input
    assert bytes(x[0].tolist()) == context + b" ran of"  # rows longest first, right-padded with 0x00
    assert bytes(x[2].tolist()) == context + b"\x00" * 7  # "!": the context alone predicts it


def test_a_suite_is_scored_in_few_forwards_and_as_item_by_item():
    """evaluate_mc packs every item's choices into right-padded forwards of at most max_tokens: the same scores as
    one forward per item on a live ByteLM (float noise aside), in a handful of forwards."""
    model = live_model(ModelConfig(**TINY))
    items = [mc.McItem(bytes(f"Item {i}: " + "q" * (i % 7), "ascii"), [b" yes", b" no" * (1 + i % 3), b"!"], i % 3,
                       f"t:{i}") for i in range(40)]
    one_by_one = [mc.score_choices(model, it.context, it.choices, 64, "cpu") for it in items]
    packed = mc.score_many(model, [(it.context, it.choices) for it in items], 64, "cpu", max_tokens=512)
    for want, got in zip(one_by_one, packed, strict=True):
        assert [nb for _, nb in want] == [s.n_bytes for s in got]
        assert [lp for lp, _ in want] == pytest.approx([s.logprob for s in got], abs=1e-4)
    calls = []
    model.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    r = mc.evaluate_mc(model, items, 64, "cpu", Counter())
    # 120 rows of <= 23 bytes, longest first, under the CPU's cap of 2048 tokens a forward: 89 rows of 23, then 31
    assert r["n_scored"] == 40 and [tuple(s) for s in calls] == [(89, 23), (31, 12)]
    assert mc.pack_tokens("cpu") == 2048 and mc.pack_tokens(torch.device("cuda")) == 1 << 16
    want_acc = sum(max(range(3), key=lambda k: sc[k][0]) == it.answer for it, sc in zip(items, one_by_one)) / 40
    assert r["acc"] == want_acc


def test_empty_context_is_the_zero_byte_prefix():
    model = TableLM(seed=1)
    (lp, nb), = mc.score_choices(model, b"", [b"hi"], window=8, device="cpu")
    want = model.hand_logprob(b"\x00hi", 0, ord("h")) + model.hand_logprob(b"\x00hi", 1, ord("i"))
    assert (nb, lp) == (2, pytest.approx(want, abs=1e-4))
    assert mc.score_choices(model, b"\x00", [b"hi"], 8, "cpu") == [(lp, nb)]
    assert not mc.fits(b"", b"12345678", 8)  # the prefix byte counts toward the window
    assert mc.fits(b"", b"1234567", 8)


def test_greedy_flag():
    model = FixedLM({ord("a"): -0.1})
    s = mc.score_continuations(model, b"x", [b"aaa", b"ab"], 8, "cpu")
    assert [x.is_greedy for x in s] == [True, False]
    assert s[0].logprob == pytest.approx(-0.3, abs=1e-5)


def test_batched_forward_equals_one_forward_per_choice_on_a_live_bytelm():
    """Right-padding is harmless for the causal ByteLM: batched scores equal unbatched ones."""
    model = live_model(ModelConfig(**TINY))
    context = b"Once upon a time, "
    choices = [b"there", b"a dormouse slept through", b"x"]
    batched = mc.score_choices(model, context, choices, 64, "cpu")
    for c, (lp, nb) in zip(choices, batched):
        (lp1, nb1), = mc.score_choices(model, context, [c], 64, "cpu")
        assert nb == nb1 and lp == pytest.approx(lp1, abs=1e-4)
    # and the batch composition changes nothing beyond float noise
    reordered = mc.score_choices(model, context, choices[::-1], 64, "cpu")[::-1]
    assert [lp for lp, _ in reordered] == pytest.approx([lp for lp, _ in batched], abs=1e-4)


# ---- metrics ------------------------------------------------------------------------------------
def test_acc_and_acc_bytes_differ_on_a_constructed_case():
    # "a" costs 2.0 nats (sum -2.0, -2.0/byte); "bb" costs 1.5 a byte (sum -3.0, -1.5/byte)
    model = FixedLM({ord("a"): -2.0, ord("b"): -1.5})
    item = mc.McItem(b"q", [b"a", b"bb"], answer=1, source="t")
    c = Counter()
    r = mc.evaluate_mc(model, [item], window=16, device="cpu", counters=c)
    assert r == {"acc": 0.0, "acc_bytes": 1.0, "n_scored": 1, "n_dropped_too_long": 0}
    r = mc.evaluate_mc(model, [mc.McItem(b"q", [b"a", b"bb"], 0, "t")], 16, "cpu", c)
    assert (r["acc"], r["acc_bytes"]) == (1.0, 0.0)


def test_ties_go_to_the_lowest_index():
    model = FixedLM({ord("a"): -1.0})
    first = mc.evaluate_mc(model, [mc.McItem(b"q", [b"a", b"a"], 0, "t")], 16, "cpu", Counter())
    second = mc.evaluate_mc(model, [mc.McItem(b"q", [b"a", b"a"], 1, "t")], 16, "cpu", Counter())
    assert (first["acc"], first["acc_bytes"]) == (1.0, 1.0)
    assert (second["acc"], second["acc_bytes"]) == (0.0, 0.0)


def test_too_long_items_are_dropped_and_counted_never_truncated():
    model = TableLM()
    with pytest.raises(mc.ItemTooLong):
        mc.score_choices(model, b"12345", [b"abc", b"abcd"], window=8, device="cpu")
    assert model.inputs == [], "nothing is scored for an item that does not fit"
    fits = mc.McItem(b"12345", [b"abc", b"xyz"], 0, "fits")  # 5 + 3 == 8: exactly the window
    long = mc.McItem(b"12345", [b"abc", b"abcd"], 0, "long")
    empty = mc.McItem(b"", [b"12345678", b"1"], 0, "empty")  # 0x00 + 8 > 8
    c = Counter()
    r = mc.evaluate_mc(model, [long, fits, empty], window=8, device="cpu", counters=c)
    assert r["n_scored"] == 1 and r["n_dropped_too_long"] == 2
    assert c == Counter({"mc.items_read": 3, "mc.scored": 1, "mc.dropped_too_long": 2})
    (x,) = model.inputs  # only the item that fits ran, with its whole context
    assert bytes(x[0].tolist()) == b"12345ab"


def test_empty_result_when_nothing_fits():
    r = mc.evaluate_mc(TableLM(), [mc.McItem(b"123456789", [b"a", b"b"], 0, "t")], 8, "cpu", Counter())
    assert r == {"acc": None, "acc_bytes": None, "n_scored": 0, "n_dropped_too_long": 1}


def test_mc_item_validates():
    with pytest.raises(ValueError, match="at least 2"):
        mc.McItem(b"q", [b"a"], 0, "t")
    with pytest.raises(ValueError, match="out of range"):
        mc.McItem(b"q", [b"a", b"b"], 2, "t")
    with pytest.raises(ValueError, match="non-empty"):
        mc.McItem(b"q", [b"a", b""], 0, "t")


# ---- jsonl tasks --------------------------------------------------------------------------------
def test_load_jsonl_task_applies_the_delimiter_rule():
    items = mc.load_jsonl_task(TASK)
    assert len(items) == 5
    first = items[0]
    assert first.context == b"The capital of France is"
    assert first.choices == [b" Paris", b" London", b" a small dormouse"] and first.answer == 0
    assert first.source == "bench_tiny_task.jsonl:1"
    assert items[3].context == "Der Bär schläft im".encode() and items[3].choices[2] == " Frühling".encode()
    assert items[4].context == b""


@pytest.mark.parametrize("record, message", [
    ('{"question": "q", "choices": ["a", "b"], "answer": 0', "invalid JSON"),
    ('{"question": "q", "choices": ["a", "b"]}', "missing key"),
    ('{"question": "q", "choices": ["a", "b"], "answer": 2}', "out of range"),
    ('{"question": "q", "choices": ["a", "b"], "answer": -1}', "out of range"),
    ('{"question": "q", "choices": ["a"], "answer": 0}', "need at least 2"),
    ('{"question": "q", "choices": ["a", "b"], "answer": true}', "integer index"),
    ('{"question": "q", "choices": "ab", "answer": 0}', "list of strings"),
    ('{"question": 3, "choices": ["a", "b"], "answer": 0}', "question must be a string"),
    ('["q"]', "JSON object"),
])
def test_load_jsonl_task_errors_name_file_and_line(tmp_path, record, message):
    p = tmp_path / "task.jsonl"
    good = '{"question": "q", "choices": ["a", "b"], "answer": 1}'
    p.write_text(f"{good}\n\n{record}\n{good}\n")  # the blank line 2 is skipped but still counted
    with pytest.raises(mc.TaskFormatError, match=message) as e:
        mc.load_jsonl_task(p)
    assert f"{p}:3:" in str(e.value)


# ---- cloze --------------------------------------------------------------------------------------
def eval_tail() -> bytes:
    from pydoc_data.topics import topics
    return "\n".join(topics[k] for k in sorted(topics)[:20]).encode()


def test_cloze_items_are_real_spans_of_the_tail():
    tail = eval_tail()
    items = mc.cloze_items(tail, n=50, context_bytes=40, span_bytes=12, k=4, seed=7)
    assert len(items) == 50
    positions = [int(it.source.split("@")[1]) for it in items]
    assert positions == sorted(positions) and len(set(positions)) == 50
    for it, p in zip(items, positions):
        assert len(it.choices) == 4 and all(len(c) == 12 for c in it.choices)
        assert it.context == tail[p - 40 : p]
        assert it.choices[it.answer] == tail[p : p + 12]  # the true continuation
        assert len(set(it.choices)) == 4  # distractors differ from the answer and from each other
        for c in it.choices:
            assert c in tail  # nothing invented
    assert len({it.answer for it in items}) == 4  # the answer's index is shuffled


def test_cloze_items_are_deterministic():
    tail = eval_tail()
    a = mc.cloze_items(tail, 20, 32, 8, 3, seed=1)
    assert a == mc.cloze_items(tail, 20, 32, 8, 3, seed=1)
    assert a != mc.cloze_items(tail, 20, 32, 8, 3, seed=2)


def test_cloze_items_refuse_what_the_tail_cannot_supply():
    with pytest.raises(ValueError, match="cloze positions"):
        mc.cloze_items(b"x" * 30, n=5, context_bytes=20, span_bytes=8, k=2, seed=0)
    with pytest.raises(ValueError, match="distinct distractor"):
        mc.cloze_items(b"ab" * 200, n=1, context_bytes=10, span_bytes=4, k=4, seed=0)  # only 2 distinct spans


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FLA's chunk kernel)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_scores_are_one_forward_per_items_on_cuda(dtype):
    """bench's suites on the GPU: every item's rows packed into a forward or two (pack_tokens' CUDA cap) score what
    one forward per item scores, float noise aside (bf16 autocast or fp32 as bench runs): log-probs within 1e-2
    relative, the same argmax choice on most items."""
    from test_decode import CONFIGS
    from test_decode import live_model as decode_model

    from dormouse.posttrain import task_eval
    from dormouse.posttrain.settings import SampledEval, TaskSettings
    from dormouse.train.runtime import autocast

    cuda = torch.device("cuda")
    model = decode_model(CONFIGS["all_on_conv4"], scale=0.5).cuda()
    task_set = TaskSettings(families=("add", "reverse", "count"), difficulties=(1, 2), heldout_items=8,
                            max_new_bytes=8, sampled_eval=SampledEval(samples=0, temperature=1.0, seed=0))
    items = task_eval.mc_items(task_eval.heldout_items(task_set), 4) + [
        mc.McItem(bytes(f"Item {i}: " + "q" * (i % 37), "ascii"), [b" yes", b" no" * (1 + i % 5), b"!"], i % 3,
                  f"t:{i}") for i in range(40)]
    reqs = [(it.context, it.choices) for it in items]
    calls = []
    hook = model.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    with autocast(cuda, dtype):
        packed = mc.score_many(model, reqs, 256, cuda)
        n_packed = len(calls)
        single = [mc.score_continuations(model, c, choices, 256, cuda) for c, choices in reqs]
        r = mc.evaluate_mc(model, items, 256, cuda, Counter())
    hook.remove()
    assert n_packed <= 2 and len(calls) == 2 * n_packed + len(reqs), calls  # evaluate_mc packs as score_many
    assert [s.n_bytes for sc in packed for s in sc] == [s.n_bytes for sc in single for s in sc]
    got = torch.tensor([s.logprob for sc in packed for s in sc])
    want = torch.tensor([s.logprob for sc in single for s in sc])
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    agree = sum(mc.argmax_first([s.logprob for s in p]) == mc.argmax_first([s.logprob for s in q])
                for p, q in zip(packed, single, strict=True))
    assert agree >= 0.9 * len(items), (agree, len(items))
    assert r["n_scored"] == len(items)
