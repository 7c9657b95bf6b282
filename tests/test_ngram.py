"""Tests for dormouse.data.ngram (anchor ladder): exactness, normalisation, and independent references.

The references below are written from the formulas, with Python dicts over byte strings, and
share no code with the numpy implementation.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dormouse.data import ngram

GPL = Path("/usr/share/common-licenses/GPL-3")


def _text() -> bytes:
    if GPL.exists():
        return GPL.read_bytes()
    # Fallback so the suite still runs off Debian: any real English prose will do.
    return Path(ngram.__file__).read_bytes()


TEXT = _text()
PARAS = [p.strip() for p in TEXT.split(b"\n\n") if p.strip()]
# Small corpus: a few KB, several documents, some shorter than every order tested (< 2 bytes,
# < 5 bytes). Eval has a document made of bytes never seen in training, an empty document and
# a 1-byte one, so every backoff path and every document-start model gets exercised.
SMALL_TRAIN = PARAS[4:12] + [b"x", b"GNU", b"ab"]
SMALL_EVAL = PARAS[12:16] + [b"", b"q", b"the", bytes([0, 255, 200, 7]) + b"the lic\xc3\xa9nse"]


# --------------------------------------------------------------------------------------------
# Brute-force reference: dicts keyed by byte strings.
class RefModel:
    def __init__(self, docs: list[bytes], max_order: int):
        self.c: Counter[bytes] = Counter()
        for d in docs:
            for i in range(len(d)):
                for n in range(1, min(i + 1, max_order) + 1):
                    self.c[d[i - n + 1 : i + 1]] += 1
        # N1+(. w): distinct bytes seen immediately left of w (inside a document)
        self.cont: Counter[bytes] = Counter(g[1:] for g in self.c if len(g) >= 2)
        self.tot = {"raw": Counter(), "cont": Counter()}
        self.typ = {"raw": Counter(), "cont": Counter()}
        for kind, table in (("raw", self.c), ("cont", self.cont)):
            for g, v in table.items():
                self.tot[kind][g[:-1]] += v
                self.typ[kind][g[:-1]] += 1

    def disc(self, kind: str, n: int) -> float:
        table = self.c if kind == "raw" else self.cont
        vals = [v for g, v in table.items() if len(g) == n]
        n1, n2 = vals.count(1), vals.count(2)
        return min(max(n1 / (n1 + 2 * n2), 0.1), 1.0)

    def kn(self, ctx: bytes, x: int, discount=None, top: bool = True) -> float:
        n = len(ctx) + 1
        kind = "raw" if top else "cont"
        d = self.disc(kind, n) if discount is None else discount[n - 1]
        lower = 1 / 256 if n == 1 else self.kn(ctx[1:], x, discount, top=False)
        tot = self.tot[kind][ctx]
        if tot == 0:
            return lower
        cnt = (self.c if top else self.cont)[ctx + bytes([x])]
        return (max(cnt - d, 0) + d * self.typ[kind][ctx] * lower) / tot

    def backoff(self, ctx: bytes, x: int, alpha: float) -> float:
        for j in range(len(ctx), -1, -1):
            h = ctx[len(ctx) - j :]
            if self.tot["raw"][h] > 0 or j == 0:
                return (self.c[h + bytes([x])] + alpha) / (self.tot["raw"][h] + 256 * alpha)
        raise AssertionError

    def bits(self, docs: list[bytes], k: int, prob) -> float:
        return -sum(
            math.log2(prob(d[max(0, i - k + 1) : i], d[i])) for d in docs for i in range(len(d))
        )


@pytest.fixture(scope="module")
def small():
    return ngram.count_ngrams(SMALL_TRAIN, 5), RefModel(SMALL_TRAIN, 5)


def test_uniform_is_exactly_8():
    r = ngram.uniform_bits(SMALL_EVAL)
    assert r.bpb == 8.0 and r.bits == 8.0 * sum(map(len, SMALL_EVAL))
    assert ngram.uniform_bits(ngram.prepare_eval(SMALL_EVAL, 3)).bits == r.bits


def test_counts_match_reference_and_chunking(small):
    counts, ref = small
    for n in range(1, 6):
        got = {
            int(k).to_bytes(n, "big"): int(v)
            for k, v in zip(counts.keys[n - 1], counts.counts[n - 1])
        }
        assert got == {g: v for g, v in ref.c.items() if len(g) == n}
    # tiny chunks force many binary-counter merges; result must be identical
    chunked = ngram.count_ngrams(iter(SMALL_TRAIN), 5, chunk_bytes=300)
    for a, b in zip(counts.keys + counts.counts, chunked.keys + chunked.counts):
        np.testing.assert_array_equal(a, b)
    assert (chunked.n_docs, chunked.n_bytes) == (len(SMALL_TRAIN), sum(map(len, SMALL_TRAIN)))


@pytest.mark.parametrize("alpha", [ngram.DEFAULT_ALPHA, 1.0])
def test_unigram_and_backoff_match_reference(small, alpha):
    counts, ref = small
    got = ngram.unigram_bits(counts, SMALL_EVAL, alpha=alpha).bits
    want = ref.bits(SMALL_EVAL, 1, lambda h, x: ref.backoff(b"", x, alpha))
    assert got == pytest.approx(want, rel=1e-9)
    for k in range(2, 6):
        got = ngram.backoff_bits(counts, SMALL_EVAL, k, alpha=alpha).bits
        want = ref.bits(SMALL_EVAL, k, lambda h, x: ref.backoff(h, x, alpha))
        assert got == pytest.approx(want, rel=1e-9), k


@pytest.mark.parametrize("discount", [None, 0.7, (0.3, 0.5, 0.6, 0.8, 0.9)])
def test_kneser_ney_matches_reference(small, discount):
    counts, ref = small
    for k in range(2, 6):
        got = ngram.kneser_ney_bits(counts, SMALL_EVAL, k, discount=discount).bits
        d = [discount] * 5 if isinstance(discount, float) else discount
        want = ref.bits(SMALL_EVAL, k, lambda h, x, d=d: ref.kn(h, x, d))
        assert got == pytest.approx(want, rel=1e-9), k


def test_ladder_reuses_eval_set_consistently(small):
    counts, _ = small
    rows = ngram.anchor_ladder(counts, SMALL_EVAL, 4)
    assert [(r["name"], r["order"]) for r in rows] == [("uniform", 0), ("unigram", 1)] + [
        (name, k) for k in (2, 3, 4) for name in ("backoff", "kneser_ney")
    ]
    fn = {"backoff": ngram.backoff_bits, "kneser_ney": ngram.kneser_ney_bits}
    for r in rows[2:]:
        alone = fn[r["name"]](counts, SMALL_EVAL, r["order"]).bits
        assert r["bits"] == pytest.approx(alone, rel=1e-12)
        assert r["bytes"] == sum(map(len, SMALL_EVAL)) and r["bpb"] == r["bits"] / r["bytes"]
    # training from raw documents gives the same ladder
    assert ngram.anchor_ladder(SMALL_TRAIN, SMALL_EVAL, 4) == rows


def _sample_contexts() -> list[bytes]:
    ctxs = [b"", b"t", b"th", b"the", b" the", b"ense", b"zq", b"\x00\x01\x02\x03", b"\xff"]
    ctxs += [SMALL_EVAL[0][i : i + 4] for i in range(0, 200, 37)]  # seen and unseen
    return ctxs


@pytest.mark.parametrize("rung", ["uniform", "unigram", "backoff", "kneser_ney"])
def test_distributions_sum_to_one_and_are_positive(small, rung):
    counts, _ = small
    for k in range(2, 6):
        for ctx in _sample_contexts():
            p = ngram.prob_vector(counts, ctx, rung, k)
            assert p.shape == (256,) and (p > 0).all(), (rung, k, ctx)
            assert p.sum() == pytest.approx(1.0, abs=1e-12), (rung, k, ctx)
            if rung == "kneser_ney":  # also with a fixed discount
                q = ngram.prob_vector(counts, ctx, rung, k, discount=0.9)
                assert q.sum() == pytest.approx(1.0, abs=1e-12) and (q > 0).all()


@pytest.mark.parametrize("rung", ["backoff", "kneser_ney"])
def test_prob_vector_agrees_with_bulk_scoring(small, rung):
    counts, _ = small
    fn = {"backoff": ngram.backoff_bits, "kneser_ney": ngram.kneser_ney_bits}[rung]
    k = 4
    want = fn(counts, SMALL_EVAL, k).bits
    got = -sum(
        math.log2(ngram.prob_vector(counts, d[max(0, i - k + 1) : i], rung, k)[d[i]])
        for d in SMALL_EVAL
        for i in range(len(d))
    )
    assert got == pytest.approx(want, rel=1e-9)



@pytest.mark.parametrize("rung", ["backoff", "kneser_ney"])
def test_a_scored_range_counts_only_its_bytes_with_their_document_context(small, rung):
    """prepare_eval(scored=(a, b)) scores the bytes a..b-1 of the documents' concatenation (a model's eval window),
    each with its in-document history: the same bits as scoring those positions one by one."""
    counts, _ = small
    k, docs = 4, [d for d in SMALL_EVAL if d]
    flat = [(d, i) for d in docs for i in range(len(d))]  # (document, position) of each concatenated byte
    a, b = 3, len(flat) - 40  # starts inside the first document, ends inside a later one
    want = -sum(math.log2(ngram.prob_vector(counts, d[max(0, i - k + 1) : i], rung, k)[d[i]]) for d, i in flat[a:b])
    fn = {"backoff": ngram.backoff_bits, "kneser_ney": ngram.kneser_ney_bits}[rung]
    got = fn(counts, ngram.prepare_eval(SMALL_EVAL, k, scored=(a, b)), k)
    assert got.n_bytes == b - a and got.bits == pytest.approx(want, rel=1e-9)
    whole = ngram.prepare_eval(SMALL_EVAL, k, scored=(0, len(flat)))
    assert fn(counts, whole, k).bits == pytest.approx(fn(counts, SMALL_EVAL, k).bits, rel=1e-12)
    with pytest.raises(ValueError, match="outside"):
        ngram.prepare_eval(SMALL_EVAL, k, scored=(0, len(flat) + 1))

# --------------------------------------------------------------------------------------------
# NLTK (nltk.lm) where its conventions can be matched.
#
# Matching setup: no padding (everygrams of each document, so counts are exactly ours, never
# across documents), and a Vocabulary of exactly 256 symbols: bytes 1..255 as chr(b) plus
# byte 0 as the unk label (NLTK always adds the unk label to len(vocab), so naming it after a
# real byte is the only way to get |V| = 256 for Lidstone's denominator).
#
# What matches exactly, and is compared below:
#  * Laplace/Lidstone unigram == our add-alpha unigram.
#  * Lidstone order k at a context seen in training == our backoff rung (which uses the full
#    context when it was seen). For an unseen context NLTK's Lidstone returns the uniform
#    1/256 (0 + g) / (0 + 256 g) while our backoff falls back to a shorter context, so
#    unseen contexts are only checked to be uniform in NLTK.
#  * KneserNeyInterpolated with one fixed discount D, for full-length contexts (k-1 bytes),
#    when our discounts are (0, D, D, ...):
#      - NLTK's lowest order is N1+(. x) / N1+(. .) with no discount and no uniform floor;
#        ours discounts it and interpolates with 1/256. Order-1 discount 0 makes ours equal.
#      - NLTK's lower-order gamma counts distinct followers with *raw* counts, c(h x) > 0,
#        where Chen & Goodman (and we) use continuation counts, N1+(. h x) > 0. These differ
#        only for an n-gram (2 <= n <= k-1) that occurs solely at document starts (no left
#        neighbour); then NLTK's distribution does not sum to 1 (and with no other
#        continuation it divides by zero). The corpus below is built so this never happens,
#        and the test asserts that precondition.
#      - For a context shorter than k-1, NLTK uses the continuation (lower-order)
#        distribution; our document-start convention uses the shorter model's top level (raw
#        counts). NLTK never sees this case in its own use (it pads), so it is not compared.
# Every document starts with "the", and "t", "th", "the" also occur inside documents, so no
# n-gram of order 2..3 is confined to document starts.
NLTK_TRAIN = [b"the" + part for part in TEXT[1500:4500].split(b" the")]
NLTK_CONTEXTS = [b"the", b" th", b"ens", b"se ", b"ou ", b"zzz", b"\x00ab", b"q t", b"or "]


@pytest.fixture(scope="module")
def nltk_lm():
    return pytest.importorskip("nltk.lm")  # skips only the NLTK tests when nltk is missing


def _vocab(nltk_lm):
    vocab = nltk_lm.Vocabulary([chr(b) for b in range(1, 256)], unk_label=chr(0))
    assert len(vocab) == 256 and all(vocab.lookup(chr(b)) == chr(b) for b in range(256))
    return vocab


def _fit(model, k: int):
    from nltk.util import everygrams

    model.fit([list(everygrams([chr(b) for b in d], max_len=k)) for d in NLTK_TRAIN])
    return model


def test_nltk_corpus_precondition():
    k = 4
    for n in range(2, k):
        everywhere = {d[i - n + 1 : i + 1] for d in NLTK_TRAIN for i in range(n - 1, len(d))}
        with_left = {d[i - n + 1 : i + 1] for d in NLTK_TRAIN for i in range(n, len(d))}
        assert everywhere == with_left, n


def test_nltk_laplace_and_lidstone(nltk_lm):
    counts = ngram.count_ngrams(NLTK_TRAIN, 3)
    lap = _fit(nltk_lm.Laplace(1, vocabulary=_vocab(nltk_lm)), 1)
    ours = ngram.prob_vector(counts, b"", "unigram", 1, alpha=1.0)
    np.testing.assert_allclose(ours, [lap.score(chr(x)) for x in range(256)], rtol=1e-12)
    gamma, k = 0.05, 3
    lid = _fit(nltk_lm.Lidstone(gamma, k, vocabulary=_vocab(nltk_lm)), k)
    seen = 0
    for ctx in NLTK_CONTEXTS + [b"he", b"e ", b"\x00\x01"]:
        h = ctx[-(k - 1) :]
        theirs = np.array([lid.score(chr(x), [chr(b) for b in h]) for x in range(256)])
        if lid.counts[[chr(b) for b in h]].N() > 0:
            seen += 1
            ours = ngram.prob_vector(counts, h, "backoff", k, alpha=gamma)
            np.testing.assert_allclose(ours, theirs, rtol=1e-12)
        else:
            np.testing.assert_allclose(theirs, 1 / 256, rtol=1e-12)
    assert seen >= 5


@pytest.mark.parametrize("k", [3, 4])
def test_nltk_kneser_ney_interpolated(nltk_lm, k):
    d = 0.6
    counts = ngram.count_ngrams(NLTK_TRAIN, k)
    kn = _fit(nltk_lm.KneserNeyInterpolated(k, discount=d, vocabulary=_vocab(nltk_lm)), k)
    discounts = [0.0] + [d] * (k - 1)
    n_seen = 0
    for ctx in NLTK_CONTEXTS:
        h = ctx[-(k - 1) :]
        n_seen += kn.counts[[chr(b) for b in h]].N() > 0
        theirs = np.array([kn.score(chr(x), [chr(b) for b in h]) for x in range(256)])
        ours = ngram.prob_vector(counts, h, "kneser_ney", k, discount=discounts)
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-15)
    assert 3 <= n_seen < len(NLTK_CONTEXTS)  # both seen and unseen top contexts compared


# --------------------------------------------------------------------------------------------
def test_ladder_is_monotone_on_real_text():
    docs = PARAS[: len(PARAS) // 2 * 2]
    counts = ngram.count_ngrams(docs[0::2], 5)
    es = ngram.prepare_eval(docs[1::2], 5)
    kn5 = ngram.kneser_ney_bits(counts, es, 5).bpb
    kn2 = ngram.kneser_ney_bits(counts, es, 2).bpb
    uni = ngram.unigram_bits(counts, es).bpb
    assert kn5 < kn2 < uni < 8.0, (kn5, kn2, uni)


def test_rejects_orders_out_of_range(small):
    counts, _ = small
    with pytest.raises(ValueError):
        ngram.count_ngrams(SMALL_TRAIN, 9)
    with pytest.raises(ValueError):
        ngram.kneser_ney_bits(counts, SMALL_EVAL, 6)  # counts only go to order 5
    with pytest.raises(ValueError):
        ngram.kneser_ney_bits(counts, SMALL_EVAL, 3, discount=1.5)
    with pytest.raises(ValueError):
        ngram.backoff_bits(counts, ngram.prepare_eval(SMALL_EVAL, 2), 3)  # EvalSet too short
