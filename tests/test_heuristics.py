from conftest import real_docs

from dormouse.data.heuristics import c4, gopher_quality, gopher_repetition, heuristic_drop_reason

PROSE = dict(real_docs()["prose"])["assignment"]
GOPHER = {"min_words": 50, "max_words": 100000, "min_mean_word_length": 3, "max_mean_word_length": 10,
          "max_symbol_word_ratio": 0.1, "max_bullet_lines_ratio": 0.9, "max_ellipsis_lines_ratio": 0.3,
          "max_non_alpha_words_ratio": 0.8, "min_stop_words": 2}
REPETITION = {"max_dup_line_frac": 0.3, "max_dup_line_char_frac": 0.2, "max_dup_para_frac": 0.3,
              "max_dup_para_char_frac": 0.2, "max_top_2gram_char_frac": 0.2, "max_top_3gram_char_frac": 0.18,
              "max_top_4gram_char_frac": 0.16}


def test_real_prose_passes_every_rule():
    assert heuristic_drop_reason(PROSE, {"c4": {}, "gopher_repetition": REPETITION, "gopher_quality": GOPHER}) is None


def test_each_gopher_quality_rule_fires_on_its_defect():
    assert gopher_quality("the cat and the dog", GOPHER) == "gopher_too_few_words"
    assert gopher_quality(" ".join(["a", "of"] * 100), GOPHER) == "gopher_short_words"
    assert gopher_quality(" ".join(["the", "supercalifragilistic"] * 100), GOPHER) == "gopher_long_words"
    assert gopher_quality(PROSE + " #tag" * 2000, GOPHER) == "gopher_symbol_word_ratio"
    assert gopher_quality("\n".join(f"- item number {i} of the list" for i in range(100)), GOPHER) == "gopher_bullet_lines"
    ellipses = "\n".join(f"and then the story went on {i}..." for i in range(100))
    assert gopher_quality(ellipses, {**GOPHER, "max_symbol_word_ratio": None}) == "gopher_ellipsis_lines"
    assert gopher_quality(" ".join(["1234", "5678", "the", "of"] * 50), GOPHER) == "gopher_non_alpha_words"
    assert gopher_quality(" ".join(["house", "river", "stone"] * 50), GOPHER) == "gopher_few_stop_words"


def test_none_disables_a_rule():
    assert gopher_quality(" ".join(["house", "river", "stone"] * 50), {**GOPHER, "min_stop_words": None}) is None


def test_repetition_rules():
    paras = "\n\n".join(["the same paragraph again"] * 4 + ["a different one"])
    assert gopher_repetition(paras, REPETITION) == "gopher_dup_paragraphs"
    lines = "\n".join(["a repeated line of text"] * 5 + [f"unique line {i}" for i in range(5)])
    assert gopher_repetition(lines, {**REPETITION, "max_dup_para_frac": None, "max_dup_para_char_frac": None}) == "gopher_dup_lines"
    spam = " ".join(["buy cheap"] * 100)
    assert gopher_repetition(spam, {"max_top_2gram_char_frac": 0.2}) == "gopher_top_2gram"


def test_c4_rules():
    assert c4(PROSE + "\nLorem ipsum dolor sit amet", {}) == "c4_lorem_ipsum"
    assert c4("x" * 5000, {"max_line_bytes": 1000}) == "c4_long_line"
    assert c4("no punctuation\nat all here", {"min_terminal_punct_lines_ratio": 0.5}) == "c4_terminal_punct"
    assert c4(PROSE, {"max_line_bytes": 5000}) is None
