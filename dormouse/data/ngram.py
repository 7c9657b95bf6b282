"""Anchor ladder: bits per byte (BPB) of simple byte n-gram models on held-out text.

These are the numbers a trained byte-level LM has to beat. Vocabulary = the 256 byte values.
Rungs, each reported as total bits over the eval bytes (BPB = bits / bytes):

* ``uniform``     exactly 8 bits per byte.
* ``unigram``     add-alpha smoothed byte frequencies.
* ``backoff``     order k: add-alpha at the longest context (<= k-1 bytes) seen in training,
                  falling back to the unigram. Each distribution sums to 1 on its own; there is
                  no backoff weight, so this is deliberately simple, not Katz.
* ``kneser_ney``  order k: interpolated Kneser-Ney (Chen & Goodman 1998): raw counts at the top
                  order, continuation counts N1+(. h x) below, one absolute discount per order
                  and the lowest order interpolated with uniform 1/256, so every byte has P > 0.
                  A context unseen at some order gives interpolation weight 1 to the order below.

Document-boundary convention
----------------------------
N-grams never cross documents. At position i (0-based) of a document the available context is
the min(i, k-1) preceding bytes of that document. A model of order k at a position with only
m < k-1 bytes of history is evaluated as the order-(m+1) model with full context: the first
byte of every document is predicted by the order-1 model (the add-alpha unigram for
``backoff``; for ``kneser_ney`` the top-order formula applied to raw unigram counts, i.e.
absolute discounting interpolated with uniform). Training follows the same rule: an n-gram is
counted at every position i >= n-1 of a document, so the context total c(h) = sum_x c(h x)
counts occurrences of h that are followed by a byte of the same document, and continuation
counts N1+(. h x) only see left neighbours inside the document.

Implementation: an n-gram is a uint64 key with the oldest byte in the high bits (order <= 8),
so the context is ``key >> 8`` and the (n-1)-byte suffix is ``key & mask``. Counts are sorted
unique key arrays. Evaluation groups the eval positions into sorted unique n-grams once per
order; all lookups are then ``np.searchsorted`` with *sorted* queries (random-order queries
into multi-million-key arrays are an order of magnitude slower) and each model is computed
once per unique n-gram instead of once per byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

VOCAB = 256
MAX_SUPPORTED_ORDER = 8  # 8 bytes per uint64 key
# Add-alpha pseudo-count, shared by the unigram and backoff rungs: 256 * alpha = 1, i.e. one
# pseudo-observation per context spread evenly over the bytes (Perks prior). Laplace (alpha = 1)
# adds 256 pseudo-counts per context, which swamps sparse high-order byte contexts: with 20 MB
# of train text backoff-5 scored 3.17 BPB vs 2.55 here and was worse than backoff-4 (2.97).
# The unigram does not care (5.3532 vs 5.3537 BPB). Any alpha > 0 keeps unseen bytes possible.
DEFAULT_ALPHA = 1.0 / 256
_DISCOUNT_CLIP = (0.1, 1.0)  # keeps uniform mass alive when count-of-counts are degenerate
_CHUNK_BYTES = 1 << 24  # train bytes per counting chunk (~1 GB peak temporaries at order 5)


def _check_order(order: int, max_order: int = MAX_SUPPORTED_ORDER) -> None:
    if not 1 <= order <= max_order:
        raise ValueError(f"order must be in 1..{max_order}, got {order}")


def _concat(docs: Iterable[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """All bytes as one uint8 array plus each byte's position within its own document."""
    docs = [d for d in docs if len(d)]
    if not docs:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64)
    data = np.frombuffer(b"".join(docs), np.uint8)
    lens = np.fromiter(map(len, docs), np.int64, len(docs))
    pos = np.arange(len(data), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return data, pos


def _gram_keys(data: np.ndarray, max_order: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (n, keys), keys[i] = the n bytes ending at i. Where the n bytes would cross a
    document start the key is garbage; callers keep only positions with pos >= n-1."""
    keys = data.astype(np.uint64)
    yield 1, keys
    for n in range(2, max_order + 1):
        nxt = np.zeros_like(keys)
        nxt[1:] = (keys[:-1] << np.uint64(8)) | data[1:]
        keys = nxt
        yield n, keys


def _unique_counts(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(keys, return_counts=True) as (uint64 keys, int64 counts); a dense bincount
    is cheaper when the key space is small (orders 1 and 2)."""
    if n <= 2:
        dense = np.bincount(keys.astype(np.intp), minlength=1 << (8 * n))
        uniq = np.flatnonzero(dense)
        return uniq.astype(np.uint64), dense[uniq].astype(np.int64)
    uniq, cnt = np.unique(keys, return_counts=True)
    return uniq, cnt.astype(np.int64)


def _merge(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    keys = np.concatenate([a[0], b[0]])
    keys.sort()  # np.union1d would go through np.unique's hash path, ~5x slower here
    keys = keys[np.r_[True, keys[1:] != keys[:-1]]]
    counts = np.zeros(len(keys), np.int64)
    counts[np.searchsorted(keys, a[0])] += a[1]  # keys unique within a, so no lost updates
    counts[np.searchsorted(keys, b[0])] += b[1]
    return keys, counts


@dataclass(frozen=True, eq=False)  # eq=False: identity eq/hash, arrays can't be compared
class ByteNgramCounts:
    """In-document n-gram counts for orders 1..max_order.

    ``keys[n-1]`` holds the sorted unique uint64 keys of the n-grams (oldest byte in the high
    bits), ``counts[n-1]`` their int64 occurrence counts.
    """

    max_order: int
    keys: tuple[np.ndarray, ...]
    counts: tuple[np.ndarray, ...]
    n_docs: int
    n_bytes: int

    @cached_property
    def _stats(self) -> _Stats:
        return _Stats(self)


def count_ngrams(
    docs: Iterable[bytes], max_order: int, chunk_bytes: int = _CHUNK_BYTES
) -> ByteNgramCounts:
    """Count n-grams (orders 1..max_order) within documents, streaming over ``docs``.

    Chunks of ~``chunk_bytes`` are counted with ``np.unique`` and merged like a binary counter
    (equal-sized runs merge), so total merge work is O(N log(#chunks)), not quadratic.
    """
    _check_order(max_order)
    stack: list[tuple[int, list[tuple[np.ndarray, np.ndarray]]]] = []  # (weight, per-order runs)
    n_docs = n_bytes = 0

    def flush(batch: list[bytes]) -> None:
        data, pos = _concat(batch)
        run = []
        for n, keys in _gram_keys(data, max_order):
            run.append(_unique_counts(keys[pos >= n - 1], n))
        stack.append((1, run))
        while len(stack) > 1 and stack[-1][0] >= stack[-2][0]:
            (wb, b), (wa, a) = stack.pop(), stack.pop()
            stack.append((wa + wb, [_merge(x, y) for x, y in zip(a, b, strict=False)]))

    batch: list[bytes] = []
    size = 0
    for doc in docs:
        n_docs += 1
        n_bytes += len(doc)
        batch.append(doc)
        size += len(doc)
        if size >= chunk_bytes:
            flush(batch)
            batch, size = [], 0
    if batch or not stack:
        flush(batch)
    while len(stack) > 1:
        (_, b), (wa, a) = stack.pop(), stack.pop()
        stack.append((wa, [_merge(x, y) for x, y in zip(a, b)]))
    run = stack[0][1]
    return ByteNgramCounts(
        max_order, tuple(k for k, _ in run), tuple(c for _, c in run), n_docs, n_bytes
    )


def _find(keys: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each query in sorted ``keys`` and whether it is there (sorted queries: fast)."""
    if len(keys) == 0:
        return np.zeros(len(queries), np.intp), np.zeros(len(queries), bool)
    idx = np.searchsorted(keys, queries)
    idx[idx == len(keys)] = 0
    return idx, keys[idx] == queries


def _count_of_counts_discount(values: np.ndarray) -> float:
    n1 = int(np.count_nonzero(values == 1))
    n2 = int(np.count_nonzero(values == 2))
    d = n1 / (n1 + 2 * n2) if n1 + 2 * n2 else _DISCOUNT_CLIP[1]
    return float(np.clip(d, *_DISCOUNT_CLIP))


class _Stats:
    """Per-order tables derived from counts, aligned with the key arrays.

    Index 0 is the empty context (one key, 0). For order n (1..max_order):
      val[kind][n]  aligned with keys[n]:   c(h x) ("raw") or N1+(. h x) ("cont")
      tot[kind][n]  aligned with keys[n-1]: sum_x val(h x)       (context total)
      typ[kind][n]  aligned with keys[n-1]: #{x : val(h x) > 0}  (distinct followers)
    "cont" exists for n < max_order (it is read off the (n+1)-grams).
    """

    def __init__(self, counts: ByteNgramCounts):
        m = counts.max_order
        self.keys = (np.zeros(1, np.uint64),) + counts.keys
        self.val = {"raw": {n: counts.counts[n - 1] for n in range(1, m + 1)}, "cont": {}}
        for n in range(1, m):
            mask = np.uint64((1 << (8 * n)) - 1)
            suffix, num = np.unique(self.keys[n + 1] & mask, return_counts=True)
            cont = np.zeros(len(self.keys[n]), np.int64)
            cont[np.searchsorted(self.keys[n], suffix)] = num  # every suffix is itself a key
            self.val["cont"][n] = cont
        self.tot: dict[str, dict[int, np.ndarray]] = {"raw": {}, "cont": {}}
        self.typ: dict[str, dict[int, np.ndarray]] = {"raw": {}, "cont": {}}
        self.discount: dict[str, dict[int, float]] = {"raw": {}, "cont": {}}
        for kind, vals in self.val.items():
            for n, v in vals.items():
                self.tot[kind][n], self.typ[kind][n] = self._ctx_stats(n, v)
                self.discount[kind][n] = _count_of_counts_discount(v)

    def _ctx_stats(self, n: int, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        prev, keys = self.keys[n - 1], self.keys[n]
        tot = np.zeros(len(prev), np.int64)
        typ = np.zeros(len(prev), np.int64)
        if len(keys):
            ctx = keys >> np.uint64(8)  # sorted, because keys are
            starts = np.flatnonzero(np.r_[True, ctx[1:] != ctx[:-1]])
            j = np.searchsorted(prev, ctx[starts])  # every context is itself a key
            tot[j] = np.add.reduceat(v, starts)
            typ[j] = np.add.reduceat((v > 0).astype(np.int64), starts)
        return tot, typ

    def level(self, kind: str, n: int, grams: np.ndarray) -> tuple[np.ndarray, ...]:
        """(c, T, Y) for sorted n-gram keys: val(h x), tot(h), typ(h), zeros where unseen."""
        i, hit = _find(self.keys[n], grams)
        c = np.where(hit, self.val[kind][n][i], 0).astype(np.float64)
        j, hit = _find(self.keys[n - 1], grams >> np.uint64(8))
        tot = np.where(hit, self.tot[kind][n][j], 0).astype(np.float64)
        typ = np.where(hit, self.typ[kind][n][j], 0).astype(np.float64)
        return c, tot, typ


@dataclass(frozen=True, eq=False)
class EvalSet:
    """Eval documents grouped by n-gram, orders 1..max_order (index 0: empty context).

    grams[n]:  sorted unique n-grams ending at positions with >= n-1 bytes of history
    suffix[n]: index in grams[n-1] of each n-gram's (n-1)-byte suffix
    weight[n]: number of positions with >= n-1 bytes of history having that n-gram
    start[n]:  number of positions with exactly n-1 bytes of history having that n-gram
    """

    max_order: int
    n_bytes: int
    grams: tuple[np.ndarray, ...]
    suffix: tuple[np.ndarray, ...]
    weight: tuple[np.ndarray, ...]
    start: tuple[np.ndarray, ...]


def prepare_eval(docs: Iterable[bytes], max_order: int, scored: tuple[int, int] | None = None) -> EvalSet:
    """Group eval documents for scoring models of order <= max_order (reusable across rungs).

    scored: only the bytes at [start, stop) of the documents' concatenation are scored (a model's eval window);
    their contexts still reach back into their documents. None: every byte."""
    _check_order(max_order)
    data, pos = _concat(docs)
    keep = np.ones(len(data), bool)
    if scored is not None:
        a, b = scored
        if not 0 <= a <= b <= len(data):
            raise ValueError(f"scored bytes [{a}, {b}) outside the documents' {len(data)} bytes")
        keep[:a] = keep[b:] = False
    grams, suffix = [np.zeros(1, np.uint64)], [np.zeros(1, np.intp)]
    weight, start = [np.array([int(keep.sum())])], [np.zeros(1, np.int64)]
    for n, keys in _gram_keys(data, max_order):
        uniq, cnt = _unique_counts(keys[(pos >= n - 1) & keep], n)
        grams.append(uniq)
        weight.append(cnt)
        # grams[n-1] is small next to the train tables, so unsorted queries are cheap here
        mask = np.uint64((1 << (8 * (n - 1))) - 1)
        suffix.append(np.searchsorted(grams[n - 1], uniq & mask))
        first, num = _unique_counts(keys[(pos == n - 1) & keep], n)  # one n-gram per document at most
        start.append(np.zeros(len(uniq), np.int64))
        start[n][np.searchsorted(uniq, first)] = num
    return EvalSet(max_order, int(keep.sum()), tuple(grams), tuple(suffix), tuple(weight), tuple(start))


def _as_eval(eval_docs: Iterable[bytes] | EvalSet, order: int) -> EvalSet:
    if isinstance(eval_docs, EvalSet):
        if eval_docs.max_order < order:
            raise ValueError(f"EvalSet prepared for order {eval_docs.max_order} < {order}")
        return eval_docs
    return prepare_eval(eval_docs, order)


def _discount(stats: _Stats, kind: str, n: int, discount: float | Sequence[float] | None):
    if discount is None:
        return stats.discount[kind][n]
    d = float(discount) if isinstance(discount, (int, float)) else float(discount[n - 1])
    if not 0.0 <= d <= 1.0:  # above 1, max(c - D, 0) clips and the distribution exceeds 1
        raise ValueError(f"discount must be in [0, 1], got {d}")
    return d


def _model_probs(
    counts: ByteNgramCounts,
    es: EvalSet,
    rung: str,
    order: int,
    alpha: float = DEFAULT_ALPHA,
    discount: float | Sequence[float] | None = None,
) -> list[np.ndarray]:
    """probs[n] = P(x | h) of the order-n model (full context) for every grams[n], n=1..order.

    The order-n model does not depend on the order of the rung it is part of (top level: raw
    counts with the raw discount; lower levels: continuation counts), so one list serves every
    rung up to ``order``, including the shorter models used at document starts."""
    _check_order(order, counts.max_order)
    st = counts._stats
    probs: list[np.ndarray] = [np.full(1, 1.0 / VOCAB)]
    if rung == "backoff":
        for n in range(1, order + 1):
            c, tot, _ = st.level("raw", n, es.grams[n])
            p = (c + alpha) / (tot + VOCAB * alpha)
            probs.append(p if n == 1 else np.where(tot > 0, p, probs[n - 1][es.suffix[n]]))
        return probs
    if rung != "kneser_ney":
        raise ValueError(f"unknown rung {rung!r}")

    def interp(kind: str, n: int, lower: np.ndarray) -> np.ndarray:
        c, tot, typ = st.level(kind, n, es.grams[n])
        d = _discount(st, kind, n, discount)
        safe = np.maximum(tot, 1.0)
        lower = lower[es.suffix[n]]
        return np.where(tot > 0, (np.maximum(c - d, 0.0) + d * typ * lower) / safe, lower)

    cont = [probs[0]]  # lower-order (continuation) distributions, shared by all top orders
    for n in range(1, order):
        cont.append(interp("cont", n, cont[n - 1]))
    return probs + [interp("raw", n, cont[n - 1]) for n in range(1, order + 1)]


def _rung_bits(es: EvalSet, probs: list[np.ndarray], order: int) -> float:
    """Full-context positions use the order-`order` model; the first order-1 bytes of each
    document use the model whose order matches their history (docstring convention)."""
    bits = -np.dot(es.weight[order], np.log2(probs[order]))
    for n in range(1, order):
        bits -= np.dot(es.start[n], np.log2(probs[n]))
    return float(bits)


@dataclass(frozen=True)
class RungResult:
    name: str
    order: int
    bits: float
    n_bytes: int

    @property
    def bpb(self) -> float:
        return self.bits / self.n_bytes if self.n_bytes else float("nan")

    def as_dict(self) -> dict:
        return {"name": self.name, "order": self.order, "bits": self.bits,
                "bytes": self.n_bytes, "bpb": self.bpb}


def uniform_bits(eval_docs: Iterable[bytes] | EvalSet) -> RungResult:
    n = eval_docs.n_bytes if isinstance(eval_docs, EvalSet) else sum(map(len, eval_docs))
    return RungResult("uniform", 0, 8.0 * n, n)


def unigram_bits(
    counts: ByteNgramCounts, eval_docs: Iterable[bytes] | EvalSet, alpha: float = DEFAULT_ALPHA
) -> RungResult:
    es = _as_eval(eval_docs, 1)
    probs = _model_probs(counts, es, "backoff", 1, alpha=alpha)
    return RungResult("unigram", 1, _rung_bits(es, probs, 1), es.n_bytes)


def backoff_bits(
    counts: ByteNgramCounts,
    eval_docs: Iterable[bytes] | EvalSet,
    order: int,
    alpha: float = DEFAULT_ALPHA,
) -> RungResult:
    es = _as_eval(eval_docs, order)
    probs = _model_probs(counts, es, "backoff", order, alpha=alpha)
    return RungResult("backoff", order, _rung_bits(es, probs, order), es.n_bytes)


def kneser_ney_bits(
    counts: ByteNgramCounts,
    eval_docs: Iterable[bytes] | EvalSet,
    order: int,
    discount: float | Sequence[float] | None = None,
) -> RungResult:
    """``discount``: None = per order n1/(n1+2 n2) from the count-of-counts of the counts that
    order discounts (raw at the top, continuation below), clipped to [0.1, 1]; a float = that
    discount at every order; a sequence = discount[n-1] for order n (0 at order 1 disables the
    uniform floor, for comparisons only)."""
    es = _as_eval(eval_docs, order)
    probs = _model_probs(counts, es, "kneser_ney", order, discount=discount)
    return RungResult("kneser_ney", order, _rung_bits(es, probs, order), es.n_bytes)


def prob_vector(
    counts: ByteNgramCounts,
    context: bytes,
    rung: str,
    order: int,
    alpha: float = DEFAULT_ALPHA,
    discount: float | Sequence[float] | None = None,
) -> np.ndarray:
    """P(x | context) for all 256 bytes x. ``context`` is the in-document history; only its
    last order-1 bytes matter, and a shorter one selects the shorter model (docstring)."""
    if rung == "uniform":
        return np.full(VOCAB, 1.0 / VOCAB)
    if rung == "unigram":
        rung, order = "backoff", 1
    ctx = bytes(context)[max(0, len(context) - (order - 1)) :] if order > 1 else b""
    m = len(ctx) + 1
    x = np.arange(VOCAB, dtype=np.uint64)
    grams, suffix = [np.zeros(1, np.uint64)], [np.zeros(1, np.intp)]
    for n in range(1, m + 1):
        h = int.from_bytes(ctx[len(ctx) - (n - 1) :], "big") if n > 1 else 0
        grams.append((np.uint64(h) << np.uint64(8)) | x)  # fixed context: already sorted
        suffix.append(np.zeros(VOCAB, np.intp) if n == 1 else np.arange(VOCAB))
    es = EvalSet(m, 0, tuple(grams), tuple(suffix), (), ())
    return _model_probs(counts, es, rung, m, alpha=alpha, discount=discount)[m]


def anchor_ladder(
    train_docs: Iterable[bytes] | ByteNgramCounts,
    eval_docs: Iterable[bytes] | EvalSet,
    max_order: int,
    alpha: float = DEFAULT_ALPHA,
) -> list[dict]:
    """All rungs: uniform, unigram, then backoff and kneser_ney for k = 2..max_order."""
    counts = (
        train_docs
        if isinstance(train_docs, ByteNgramCounts)
        else count_ngrams(train_docs, max_order)
    )
    es = _as_eval(eval_docs, max_order)
    rows = [uniform_bits(es), unigram_bits(counts, es, alpha=alpha)]
    if max_order >= 2:
        bo = _model_probs(counts, es, "backoff", max_order, alpha=alpha)
        kn = _model_probs(counts, es, "kneser_ney", max_order)
        for k in range(2, max_order + 1):
            rows.append(RungResult("backoff", k, _rung_bits(es, bo, k), es.n_bytes))
            rows.append(RungResult("kneser_ney", k, _rung_bits(es, kn, k), es.n_bytes))
    return [r.as_dict() for r in rows]
