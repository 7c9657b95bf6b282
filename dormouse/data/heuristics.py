"""Gopher and C4 style document heuristics: each check returns None (keep) or a drop reason.

Words are whitespace-split (datatrove tokenizes with spaCy; whitespace keeps this ~50x faster and
changes word counts only at punctuation). A threshold of None disables its rule; a group of None
disables the group. Thresholds are the papers' defaults unless the preset says otherwise.
"""

from __future__ import annotations

import re
from collections import Counter

STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))  # Gopher's list
BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "*", "-", "–", "‣")
_ALPHA_WORD = re.compile(r"\S*[^\W\d_]\S*")
_PARA_SPLIT = re.compile(r"\n{2,}")
_LORE = re.compile(r"lorem ipsum", re.IGNORECASE)
_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~…–—"


def gopher_quality(text: str, cfg: dict) -> str | None:
    """Rae et al. 2021 (Gopher), appendix A.1.1 quality filters."""
    words = text.split()
    content = [w for w in words if w.strip(_PUNCT)]  # words that are not only punctuation
    n = len(content)
    if cfg.get("min_words") is not None and n < cfg["min_words"]:
        return "gopher_too_few_words"
    if cfg.get("max_words") is not None and n > cfg["max_words"]:
        return "gopher_too_many_words"
    if n == 0:
        return "gopher_too_few_words"
    mean_len = sum(map(len, content)) / n
    if cfg.get("min_mean_word_length") is not None and mean_len < cfg["min_mean_word_length"]:
        return "gopher_short_words"
    if cfg.get("max_mean_word_length") is not None and mean_len > cfg["max_mean_word_length"]:
        return "gopher_long_words"
    if cfg.get("max_symbol_word_ratio") is not None:
        symbols = text.count("#") + text.count("...") + text.count("…")
        if symbols / n > cfg["max_symbol_word_ratio"]:
            return "gopher_symbol_word_ratio"
    lines = text.splitlines() or [""]
    if cfg.get("max_bullet_lines_ratio") is not None:
        bullets = sum(1 for ln in lines if ln.lstrip().startswith(BULLETS))
        if bullets / len(lines) > cfg["max_bullet_lines_ratio"]:
            return "gopher_bullet_lines"
    if cfg.get("max_ellipsis_lines_ratio") is not None:
        ell = sum(1 for ln in lines if ln.rstrip().endswith(("...", "…")))
        if ell / len(lines) > cfg["max_ellipsis_lines_ratio"]:
            return "gopher_ellipsis_lines"
    if cfg.get("max_non_alpha_words_ratio") is not None:
        # Gopher: at least 80% of words contain an alphabetic character.
        if len(_ALPHA_WORD.findall(text)) / len(words) < cfg["max_non_alpha_words_ratio"]:
            return "gopher_non_alpha_words"
    if cfg.get("min_stop_words") is not None:
        stops = sum(1 for w in text.lower().split() if w in STOP_WORDS)
        if stops < cfg["min_stop_words"]:
            return "gopher_few_stop_words"
    return None


def _dup_stats(units: list[str]) -> tuple[float, float]:
    """(fraction of units that repeat an earlier one, fraction of characters in those repeats)."""
    seen: set[str] = set()
    dup_n = dup_chars = 0
    for u in units:
        if u in seen:
            dup_n += 1
            dup_chars += len(u)
        else:
            seen.add(u)
    total = sum(map(len, units)) or 1
    return dup_n / max(len(units), 1), dup_chars / total


def _top_ngram_char_frac(words: list[str], n: int) -> float:
    if len(words) < n:
        return 0.0
    grams = Counter(zip(*(words[i:] for i in range(n)), strict=False))
    gram, count = grams.most_common(1)[0]
    return count * sum(map(len, gram)) / max(sum(map(len, words)), 1)


def gopher_repetition(text: str, cfg: dict) -> str | None:
    """Rae et al. 2021 (Gopher), table A1: duplicate lines/paragraphs and dominant n-grams."""
    paras = [p for p in _PARA_SPLIT.split(text.strip()) if p.strip()]
    frac, char_frac = _dup_stats(paras)
    if cfg.get("max_dup_para_frac") is not None and frac > cfg["max_dup_para_frac"]:
        return "gopher_dup_paragraphs"
    if cfg.get("max_dup_para_char_frac") is not None and char_frac > cfg["max_dup_para_char_frac"]:
        return "gopher_dup_paragraph_chars"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    frac, char_frac = _dup_stats(lines)
    if cfg.get("max_dup_line_frac") is not None and frac > cfg["max_dup_line_frac"]:
        return "gopher_dup_lines"
    if cfg.get("max_dup_line_char_frac") is not None and char_frac > cfg["max_dup_line_char_frac"]:
        return "gopher_dup_line_chars"
    words = text.split()
    for n in (2, 3, 4):
        limit = cfg.get(f"max_top_{n}gram_char_frac")
        if limit is not None and _top_ngram_char_frac(words, n) > limit:
            return f"gopher_top_{n}gram"
    return None


def c4(text: str, cfg: dict) -> str | None:
    """Raffel et al. 2020 (C4) document rules, plus a long-line rule for minified code and blobs."""
    if cfg.get("drop_lorem_ipsum", True) and _LORE.search(text):
        return "c4_lorem_ipsum"
    lines = text.splitlines()
    if cfg.get("max_line_bytes") is not None and any(len(ln.encode("utf-8")) > cfg["max_line_bytes"] for ln in lines):
        return "c4_long_line"
    ratio = cfg.get("min_terminal_punct_lines_ratio")
    if ratio is not None:
        nonempty = [ln.rstrip() for ln in lines if ln.strip()]
        ends = sum(1 for ln in nonempty if ln.endswith((".", "!", "?", '"', "'")))
        if not nonempty or ends / len(nonempty) < ratio:
            return "c4_terminal_punct"
    return None


def heuristic_drop_reason(text: str, heuristics: dict) -> str | None:
    """The first rule a document fails, checked cheapest group first; None = keep."""
    for name, check in (("c4", c4), ("gopher_repetition", gopher_repetition), ("gopher_quality", gopher_quality)):
        cfg = heuristics.get(name)
        if cfg is not None:
            reason = check(text, cfg)
            if reason:
                return reason
    return None
