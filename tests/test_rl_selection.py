"""rl's checkpoint selection (dormouse/posttrain/selection.py): select on one half of the dev prompts, confirm on
the other; and benchmarks/rl_selection_sim.py's null false-ship rate for it."""

import math

import pytest

import benchmarks.rl_selection_sim as sim
from dormouse.posttrain import selection

PROMPTS = [f"prompt {i}" for i in range(40)]
SEL, CONF = selection.halves(PROMPTS)


def row(right: set[int], n: int = len(PROMPTS)) -> list[bool]:
    return [i in right for i in range(n)]


def test_the_halves_split_distinct_prompts_by_a_hash_slice_the_splits_do_not_read():
    assert len(SEL) >= 10 and len(CONF) >= 10 and sorted(SEL + CONF) == list(range(40))
    assert {selection.half_of_prompt(PROMPTS[i]) for i in SEL} == {"select"}
    # a repeated prompt is one unit, in its first item's place
    s, c = selection.halves(PROMPTS + PROMPTS[:5])
    assert (s, c) == (SEL, CONF)


def test_ships_a_gain_on_both_halves():
    d = selection.decide([0, 10, 20], [row(set()), row(set(SEL[:6]) | set(CONF[:6])), row(set(SEL[:3]))], PROMPTS, 1.7, rule="select_then_confirm")
    assert d["rule"] == "select_then_confirm" and d["candidate_step"] == 10 and d["selected_step"] == 10
    assert d["confirm"] == {"gained": 6, "lost": 0, "z": 2.449, "units": len(CONF)}
    assert (d["select_items"], d["confirm_items"]) == (len(SEL), len(CONF))
    assert d["halves"][1] == {"step": 10, "select": round(6 / len(SEL), 5), "confirm": round(6 / len(CONF), 5)}


def test_refuses_a_gain_on_the_select_half_alone():
    d = selection.decide([0, 10], [row(set(CONF[:2])), row(set(SEL) | set(CONF[:2]))], PROMPTS, 1.7, rule="select_then_confirm")
    assert d["candidate_step"] == 10 and d["selected_step"] == 0
    assert d["confirm"] == {"gained": 0, "lost": 0, "z": 0.0, "units": len(CONF)}


def test_the_earliest_of_tied_candidates_and_the_confirm_half_does_not_choose():
    # 20 and 30 tie on the select half; 30 is far better on the confirm half, yet 20 is the candidate
    gain = set(SEL[:4])
    rows = [row(set()), row(set(SEL[:2])), row(gain | set(CONF[:5])), row(gain | set(CONF))]
    d = selection.decide([0, 10, 20, 30], rows, PROMPTS, 1.7, rule="select_then_confirm")
    assert d["candidate_step"] == 20 and d["selected_step"] == 20 and d["confirm"]["gained"] == 5


def test_step0_ships_without_checkpoints():
    d = selection.decide([0], [row(set(SEL))], PROMPTS, 1.7, rule="select_then_confirm")
    assert d["candidate_step"] == 0 and d["selected_step"] == 0 and d["confirm"]["z"] == 0.0
    with pytest.raises(ValueError):
        selection.decide([10], [row(set())], PROMPTS, 1.7, rule="select_then_confirm")


def test_repeated_prompts_count_once_in_the_confirm_test():
    prompts = PROMPTS + [PROMPTS[CONF[0]]] * 6  # the first confirm prompt asked 7 times
    base, new = row(set(), 46), row(set(SEL[:5]) | {CONF[0], *range(40, 46)}, 46)
    d = selection.decide([0, 10], [base, new], prompts, 0.5, rule="select_then_confirm")
    assert d["confirm"]["gained"] == 1 and d["confirm_items"] == len(CONF)


def test_the_simulated_null_false_ship_rate_is_one_tests():
    """No checkpoint better than step 0: the new rule ships about P(z >= min_z) of arms (<= 5 %); the old rule
    (best of ten by z >= 2 on all the items) ships several times that."""
    min_z = sim.default_min_z()
    null = [sim.BASE] * 10
    new = sim.simulate(384, null, arms=1000, seed=1, min_zs=[min_z], rules=("new",))[f"new z>={min_z}"]
    assert new["rate"] <= 0.05 + 0.02, new
    old = sim.simulate(384, null, arms=300, seed=1, min_zs=[], rules=("old",))["old"]
    assert old["rate"] > 0.08, old


def test_bonferronis_simulated_null_rate_is_at_most_alpha_and_it_ships_a_real_gain():
    """The stage's default rule: under the null it ships <= alpha (a union bound over the planned checkpoints); with
    +5 points at every checkpoint on 800 items it ships nearly always."""
    null = sim.simulate(384, [sim.BASE] * 10, arms=1000, seed=2, min_zs=[], rules=("bonferroni",))["bonferroni"]
    assert null["rate"] <= sim.ALPHA + 0.02, null
    gain = sim.simulate(800, [sim.BASE + 0.05] * 10, arms=100, seed=3, min_zs=[], rules=("bonferroni",))["bonferroni"]
    assert gain["rate"] >= 0.9, gain


def test_bonferroni_in_decide():
    """p_crit is alpha over the planned checkpoints, p the exact one-sided sign test's; the most accurate passing
    checkpoint ships, the earliest on a tie."""
    assert selection.p_crit(0.05, 10) == 0.005 and selection.sign_p(8, 0) == 1 / 256 and selection.sign_p(0, 0) == 1.0
    assert selection.sign_p(15, 5) == sum(math.comb(20, k) for k in range(15, 21)) / 2**20
    base = row(set(range(30, 40)))
    gain8, gain9 = row(set(range(30, 40)) | set(range(8))), row(set(range(30, 40)) | set(range(9)))
    d = selection.decide([0, 10, 20, 30], [base, gain8, gain9, gain9], PROMPTS, rule="bonferroni", planned=3)
    assert d["selected_step"] == 20 and d["candidate_step"] == 20 and d["p_crit"] == 0.01667
    assert [t["z"] for t in d["tests"]] == [2.828, 3.0, 3.0]
    d = selection.decide([0, 10], [base, gain8], PROMPTS, rule="bonferroni", planned=1000)
    assert d["selected_step"] == 0 and d["p_crit"] < 1 / 256
    with pytest.raises(ValueError, match="planned"):
        selection.decide([0, 10, 20], [base, gain8, gain9], PROMPTS, rule="bonferroni", planned=1)


def test_final_tests_the_last_checkpoint_alone_at_alpha():
    """final: one planned test, the last checkpoint against step 0 at p <= alpha; the checks before it only draw the
    curve (a mid-run peak that fades does not ship), and a gain bonferroni's divided alpha misses ships."""
    base = row(set(range(30, 40)))
    peak, flat = row(set(range(30, 40)) | set(range(9))), row(set(range(30, 40)) | {0})
    d = selection.decide([0, 10, 20], [base, peak, flat], PROMPTS, rule="final")
    assert d["candidate_step"] == 20 and d["selected_step"] == 0 and [t["step"] for t in d["tests"]] == [10, 20]
    six = row(set(range(30, 40)) | set(range(6)))  # 6 gained, none lost: p 1/64 = 0.0156
    d = selection.decide([0, 10, 20], [base, base, six], PROMPTS, rule="final", alpha=0.05)
    assert d["selected_step"] == 20 and d["tests"][-1]["p"] == 0.01562
    assert selection.decide([0, 10, 20], [base, base, six], PROMPTS, rule="bonferroni", planned=6)["selected_step"] == 0
    assert selection.decide([0], [base], PROMPTS, rule="final")["selected_step"] == 0


def test_finals_simulated_null_rate_is_at_most_alpha():
    null = sim.simulate(842, [sim.BASE] * 10, arms=600, seed=4, min_zs=[], rules=("final",))["final"]
    assert null["rate"] <= sim.ALPHA + 0.02, null
