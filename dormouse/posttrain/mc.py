"""Byte-level multiple-choice scoring: the one definition of a continuation's log-likelihood.

A choice c after a context x scores
    score(c) = sum_j log p(c[j] | x + c[:j])          (nats; fp32 log_softmax of the fp32 logits)
from ONE forward over (x + c)[:-1]: the log-prob of c[0] is read from the logits at the LAST
CONTEXT position, that of c[j] from position len(x) - 1 + j. Rows (one per choice, of every item of a
suite) are packed into right-padded forwards (safe for a causal model: the padding comes after every
scored position; the batch changes a score by float noise only).

Conventions (the lm-eval adapter, dormouse.tools.lm_eval_adapter, uses the same ones):
- Empty context: the first byte of a continuation must be predicted from something, so an empty
  context is replaced by the one byte EMPTY_CONTEXT_PREFIX = 0x00 (the role of lm-eval's BOS/EOS
  prefix token). 0x00 is rare in text but NOT reserved (the chat template reserves 0x01-0x03 and the
  filter drops those; nothing drops 0x00), so the model was never taught it as "start of stream": the
  first byte's score is only roughly unconditional. Same for every model, so comparisons stay fair.
- Window: the bytes one forward touches, context (with the 0x00 prefix if any) + continuation, must fit
  in `window` bytes. An item one of whose choices does not fit is DROPPED (ItemTooLong; counted as
  `mc.dropped_too_long`), never truncated: a truncated context is a different question.
- jsonl tasks: context = the question's UTF-8 bytes, choice = (CHOICE_DELIMITER + choice) in UTF-8,
  CHOICE_DELIMITER = " " (lm-eval's default target_delimiter, so the adapter sees the same bytes).
- Cloze items (from the eval tail): no delimiter; the continuation is the bytes that follow.
- acc: argmax of the raw sum; acc_bytes: argmax of sum / byte count (lm-eval's acc_norm with bytes as
  the unit, which byte-level scoring makes exact). Ties go to the LOWEST index (Python's max keeps the
  first maximum), so a tie with the answer counts as correct only when the answer comes first.
  NB lm-eval's own acc_bytes divides by the choice's bytes WITHOUT the " " delimiter; ours divides by
  the bytes actually scored (delimiter included), so the two can differ on close calls.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from dormouse.train.runtime import pad_width

EMPTY_CONTEXT_PREFIX = b"\x00"
CHOICE_DELIMITER = " "


class ItemTooLong(ValueError):
    """context + a continuation does not fit in the window; the caller drops the item."""


class Scored(NamedTuple):
    logprob: float  # sum over the continuation's bytes, nats
    n_bytes: int
    is_greedy: bool  # every continuation byte is the argmax of its position's logits


@dataclass(frozen=True)
class McItem:
    context: bytes
    choices: list[bytes]
    answer: int  # index into choices
    source: str  # where it came from ("file.jsonl:12", "cloze@4096")

    def __post_init__(self):
        if len(self.choices) < 2:
            raise ValueError(f"{self.source}: {len(self.choices)} choices; need at least 2")
        if not all(isinstance(c, bytes) and c for c in self.choices):
            raise ValueError(f"{self.source}: every choice must be non-empty bytes")
        if not 0 <= self.answer < len(self.choices):
            raise ValueError(f"{self.source}: answer {self.answer} out of range for {len(self.choices)} choices")


# -------------------------------------------------------------------------------------------------
# Scoring
# -------------------------------------------------------------------------------------------------
def effective_context(context: bytes) -> bytes:
    """The bytes a forward conditions on: the context, or the 0x00 prefix when it is empty."""
    return context if context else EMPTY_CONTEXT_PREFIX


def fits(context: bytes, continuation: bytes, window: int) -> bool:
    return len(effective_context(context)) + len(continuation) <= window


def score_continuations(model, context: bytes, continuations: list[bytes], window: int, device) -> list[Scored]:
    """Score each continuation after `context` (see the module docstring); one padded forward for all.

    Raises ItemTooLong if any context + continuation exceeds `window` bytes (nothing is truncated).
    An empty continuation scores (0.0, 0, True).
    """
    return score_many(model, [(context, continuations)], window, device)[0]


def pack_tokens(device) -> int:
    """`score_many`'s default cap on a forward's tokens: a GPU forward is launch-bound (pack all a suite can), a CPU
    one compute-bound (on 2 cores bigger packs measured no faster, the biggest slower)."""
    return 1 << 16 if torch.device(device).type == "cuda" else 1 << 11


@torch.no_grad()
def score_many(model, requests: list[tuple[bytes, list[bytes]]], window: int, device,
               max_tokens: int | None = None) -> list[list[Scored]]:
    """`score_continuations` for many (context, continuations) requests at once: every request's rows, longest
    first, packed into right-padded forwards of at most `max_tokens` (rows x the padded longest row; default
    `pack_tokens(device)`) each, so a suite costs a few forwards instead of one per item (on a GPU each forward is
    launch-bound). Raises ItemTooLong, before any forward, for a request that does not fit; callers that drop such
    items check `fits` first."""
    max_tokens = pack_tokens(device) if max_tokens is None else max_tokens
    out, rows = [], []  # rows: (request, continuation index, forward input, context length)
    for r, (context, continuations) in enumerate(requests):
        ctx = effective_context(context)
        too_long = [len(c) for c in continuations if len(ctx) + len(c) > window]
        if too_long:
            raise ItemTooLong(f"context {len(ctx)} B + continuation {max(too_long)} B > window {window} B")
        out.append([Scored(0.0, 0, True)] * len(continuations))
        rows += [(r, i, ctx + c[:-1], len(ctx)) for i, c in enumerate(continuations) if c]  # the last byte: a target
    rows.sort(key=lambda row: -len(row[2]))
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        start = 0
        while start < len(rows):
            T = pad_width(len(rows[start][2]), device)  # a few kernel shapes on CUDA (Triton autotunes per shape)
            chunk = rows[start : start + max(1, max_tokens // T)]
            start += len(chunk)
            for (r, i, _, _), got in zip(chunk, _score_rows(model, chunk, requests, T, device), strict=True):
                out[r][i] = got
    finally:
        model.train(was_training)
    return out


def _score_rows(model, chunk: list[tuple], requests, T: int, device) -> list[Scored]:
    """One right-padded forward (0x00 padding, never scored) over `chunk`'s rows; position L-1+j predicts c[j]."""
    x = torch.zeros(len(chunk), T, dtype=torch.long)
    target = torch.zeros(len(chunk), T, dtype=torch.long)
    scored = torch.zeros(len(chunk), T, dtype=torch.bool)
    for b, (r, i, row, L) in enumerate(chunk):
        c = requests[r][1][i]
        x[b, : len(row)] = torch.frombuffer(bytearray(row), dtype=torch.uint8).long()
        target[b, L - 1 : L - 1 + len(c)] = torch.frombuffer(bytearray(c), dtype=torch.uint8).long()
        scored[b, L - 1 : L - 1 + len(c)] = True
    logits, _ = model(x.to(device))  # (B, T, V)
    logp = F.log_softmax(logits.float(), dim=-1)
    target, scored = target.to(logp.device), scored.to(logp.device)
    lp = torch.where(scored, logp.gather(2, target[..., None]).squeeze(-1), 0.0).sum(dim=1)
    greedy = ((logp.argmax(dim=-1) == target) | ~scored).all(dim=1)
    n_bytes = scored.sum(dim=1).tolist()
    return [Scored(v, int(n), g) for v, n, g in zip(lp.tolist(), n_bytes, greedy.tolist(), strict=True)]


def score_choices(model, context: bytes, choices: list[bytes], window: int, device) -> list[tuple[float, int]]:
    """[(sum log p in nats, byte count)] per choice; raises ItemTooLong (drop the item, never truncate)."""
    return [(s.logprob, s.n_bytes) for s in score_continuations(model, context, choices, window, device)]


def argmax_first(values: list[float]) -> int:
    """Index of the maximum; ties go to the lowest index."""
    return max(range(len(values)), key=values.__getitem__)


def evaluate_mc(model, items: Iterable[McItem], window: int, device, counters: Counter) -> dict:
    """acc (argmax of the sum) and acc_bytes (argmax of sum / bytes) over the items that fit, scored together
    (`score_many`).

    Counters: mc.items_read = mc.scored + mc.dropped_too_long. acc/acc_bytes are None when nothing
    was scored.
    """
    kept, dropped = [], 0
    for item in items:
        counters["mc.items_read"] += 1
        if all(fits(item.context, c, window) for c in item.choices):
            kept.append(item)
        else:
            counters["mc.dropped_too_long"] += 1
            dropped += 1
    scores = score_many(model, [(it.context, it.choices) for it in kept], window, device)
    counters["mc.scored"] += len(kept)
    correct = sum(argmax_first([s.logprob for s in sc]) == it.answer for it, sc in zip(kept, scores, strict=True))
    correct_bytes = sum(argmax_first([s.logprob / s.n_bytes for s in sc]) == it.answer
                        for it, sc in zip(kept, scores, strict=True))
    n = len(kept)
    return {
        "acc": correct / n if n else None,
        "acc_bytes": correct_bytes / n if n else None,
        "n_scored": n,
        "n_dropped_too_long": dropped,
    }


# -------------------------------------------------------------------------------------------------
# Tasks
# -------------------------------------------------------------------------------------------------
class TaskFormatError(ValueError):
    pass


def load_jsonl_task(path: str | Path) -> list[McItem]:
    """lm-eval-style records {"question": str, "choices": [str, ...], "answer": int}, one per line.

    context = question (UTF-8), choice i = " " + choices[i] (UTF-8). Blank lines are skipped; any bad
    record fails with `file:line` and what is wrong.
    """
    path = Path(path)
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise TaskFormatError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
        missing = [k for k in ("question", "choices", "answer") if k not in rec]
        if missing:
            raise TaskFormatError(f"{where}: missing key(s) {missing}")
        q, choices, answer = rec["question"], rec["choices"], rec["answer"]
        if not isinstance(q, str):
            raise TaskFormatError(f"{where}: question must be a string")
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise TaskFormatError(f"{where}: choices must be a list of strings")
        if len(choices) < 2:
            raise TaskFormatError(f"{where}: {len(choices)} choice(s); need at least 2")
        if isinstance(answer, bool) or not isinstance(answer, int):
            raise TaskFormatError(f"{where}: answer must be an integer index, got {answer!r}")
        if not 0 <= answer < len(choices):
            raise TaskFormatError(f"{where}: answer {answer} out of range for {len(choices)} choices")
        items.append(McItem(q.encode("utf-8"), [(CHOICE_DELIMITER + c).encode("utf-8") for c in choices],
                            answer, f"{path.name}:{lineno}"))
    return items


# Distractor draws per item before giving up (a tail of few distinct spans cannot supply k-1).
_MAX_DISTRACTOR_DRAWS = 1000


def cloze_items(eval_tail: bytes, n: int, context_bytes: int, span_bytes: int, k: int, seed: int) -> list[McItem]:
    """n cloze items from the eval tail, all choices real text from it.

    Item at position p (n distinct positions drawn with numpy's default_rng(seed), then sorted):
    context = tail[p - context_bytes : p], answer = tail[p : p + span_bytes], and k-1 distractors =
    spans of span_bytes at other positions q whose span lies outside the item's own
    [p - context_bytes, p + span_bytes) and differs from the answer and from each other. The answer's
    index is drawn from the same generator. Same arguments, same items. Spans are byte spans: they
    may cut a UTF-8 sequence (the model is byte-level).
    """
    if min(n, context_bytes, span_bytes) < 1 or k < 2:
        raise ValueError(f"need n, context_bytes, span_bytes >= 1 and k >= 2 (got {n}, {context_bytes}, "
                         f"{span_bytes}, {k})")
    starts = len(eval_tail) - span_bytes - context_bytes + 1  # number of valid p (p - context_bytes >= 0)
    if starts < n:
        raise ValueError(f"eval tail of {len(eval_tail)} B has {max(starts, 0)} cloze positions for "
                         f"context {context_bytes} + span {span_bytes}; {n} asked")
    rng = np.random.default_rng(seed)
    positions = sorted(int(p) + context_bytes for p in rng.choice(starts, size=n, replace=False))
    n_spans = len(eval_tail) - span_bytes + 1  # any q in [0, n_spans) is a span of the tail
    items = []
    for p in positions:
        answer = eval_tail[p : p + span_bytes]
        lo, hi = p - context_bytes, p + span_bytes
        distractors: list[bytes] = []
        for _ in range(_MAX_DISTRACTOR_DRAWS):
            if len(distractors) == k - 1:
                break
            q = int(rng.integers(n_spans))
            if q + span_bytes > lo and q < hi:  # overlaps the item's own context or answer
                continue
            span = eval_tail[q : q + span_bytes]
            if span != answer and span not in distractors:
                distractors.append(span)
        if len(distractors) < k - 1:
            raise ValueError(f"cloze@{p}: found {len(distractors)} distinct distractor spans of "
                             f"{span_bytes} B in {_MAX_DISTRACTOR_DRAWS} draws; {k - 1} needed")
        ans = int(rng.integers(k))
        choices = distractors[:ans] + [answer] + distractors[ans:]
        items.append(McItem(eval_tail[lo:p], choices, ans, f"cloze@{p}"))
    return items
