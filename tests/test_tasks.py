import itertools
import re

import pytest

from dormouse.data.chat import prompt_bytes
from dormouse.posttrain.tasks import (
    DIFFICULTIES,
    FAMILIES,
    SPLITS,
    Item,
    choices,
    distinct_items,
    is_well_formed,
    items,
    make_item,
    split_of_prompt,
    verify,
)

CASES = list(itertools.product(sorted(FAMILIES), DIFFICULTIES))


def _item(family, prompt, answer):
    return Item(family, 1, 0, prompt, answer)


def test_families_are_the_issue_list():
    assert sorted(FAMILIES) == ["add", "count", "mul", "reverse", "sort", "sub"]


@pytest.mark.parametrize("family,difficulty", CASES)
def test_make_item_is_deterministic_and_seed_dependent(family, difficulty):
    a = [make_item(family, difficulty, seed) for seed in range(20)]
    assert a == [make_item(family, difficulty, seed) for seed in range(20)]
    assert len({item.prompt for item in a}) > 5


def test_items_are_stable_across_releases():
    # Pinned: a change to the generators or the seeding changes every split and every benchmark.
    assert make_item("add", 3, 5).prompt == "Compute 898 + 477\nReply with the result as a decimal integer only."
    assert make_item("reverse", 3, 5).answer == "bslflzl"


@pytest.mark.parametrize("family,difficulty", CASES)
def test_answers_are_correct_well_formed_and_verified(family, difficulty):
    for item in items("sft", family, difficulty, 50):
        operands = re.search(r"(?:Compute|order:|string:|letter) (.*)", item.prompt).group(1)
        if family in ("add", "sub", "mul"):
            a, op, b = operands.split()
            assert item.answer == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
        elif family == "sort":
            assert item.answer == " ".join(map(str, sorted(map(int, operands.split()))))
        elif family == "reverse":
            assert item.answer == operands[::-1]
        else:
            letter, text = re.fullmatch(r"(\w) occurs in: (\w+)", operands).groups()
            assert item.answer == str(text.count(letter))
        assert is_well_formed(family, item.answer)
        assert verify(item, item.answer)
        assert verify(item, f" \n{item.answer}\t\n")


def test_verifier_on_known_items():
    add = _item("add", "Compute 123 + 456", "579")
    assert verify(add, "579") and verify(add, " 579\n")
    for wrong in ["578", "580", "0579", "+579", "579.0", "5 79", "579.", "'579'", "", "\u00a0579"]:
        assert not verify(add, wrong), wrong
    sub = _item("sub", "Compute 3 - 10", "-7")
    assert verify(sub, "-7") and not verify(sub, "7") and not verify(sub, "- 7")
    sort = _item("sort", "Sort these integers in ascending order: 9 2 9", "2 9 9")
    assert verify(sort, "2 9 9")
    for wrong in ["2 9", "2,9,9", "2  9 9", "9 9 2", "2 9 9 9"]:
        assert not verify(sort, wrong), wrong
    rev = _item("reverse", "Reverse this string: abc", "cba")
    assert verify(rev, "cba") and not verify(rev, "CBA") and not verify(rev, "abc")


def test_well_formedness_separates_malformed_from_wrong():
    for family in ("add", "sub", "mul", "count"):
        for good in ["0", "7", "-7", "1200"]:
            assert is_well_formed(family, good), (family, good)
        for bad in ["", "-0", "007", "+7", "7.0", "1,200", "seven", "7 8"]:
            assert not is_well_formed(family, bad), (family, bad)
    assert is_well_formed("sort", "1 2 30") and is_well_formed("sort", "5")
    for bad in ["1,2,3", "1  2", "01 2", "1 a", "1 -0", "[1, 2]"]:
        assert not is_well_formed("sort", bad), bad
    assert is_well_formed("reverse", " abc\n")
    assert not is_well_formed("reverse", "ab c") and not is_well_formed("reverse", "ABC")


def test_unknown_family_and_difficulty_are_errors():
    with pytest.raises(ValueError, match="unknown task family 'div'"):
        make_item("div", 1, 0)
    with pytest.raises(ValueError, match="difficulty 6"):
        make_item("add", 6, 0)
    with pytest.raises(ValueError, match="in no split"):
        make_item("add", 1, 4 * 10**6)
    with pytest.raises(ValueError, match="outside"):
        list(items("bench", "add", 1, 2, start=10**6 - 1))


def _size(item):
    """The knob's quantity: digits of the operands, list length or string length."""
    line = item.prompt.split("\n")[0]
    if item.family == "sort":
        return len(item.answer.split())
    if item.family in ("reverse", "count"):
        return len(line.split()[-1])
    return sum(len(tok) for tok in line.split() if tok.isdigit())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_difficulty_grows_the_problem(family):
    sizes = [max(_size(it) for it in items("rl", family, d, 30)) for d in DIFFICULTIES]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), sizes


def test_difficulty_exact_sizes():
    assert all(len(tok) == 4 for it in items("sft", "add", 4, 30) for tok in it.prompt.split()[1:4:2])
    assert all(len(it.answer.split()) == 6 for it in items("sft", "sort", 4, 30))
    assert all(len(it.answer) == 9 for it in items("sft", "reverse", 4, 30))


@pytest.mark.parametrize("family,difficulty", CASES)
def test_prompts_are_ascii_without_template_bytes(family, difficulty):
    for split in SPLITS:
        for item in items(split, family, difficulty, 30):
            assert item.prompt.isascii() and item.answer.isascii()
            assert not set(item.prompt.encode()) & {1, 2, 3}
            prompt_bytes(item.prompt)  # raises on a template byte


@pytest.mark.parametrize("difficulty", [1, 3])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_splits_share_no_prompt(family, difficulty):
    # Difficulty 1 is the hard case: add/sub/mul have 100 prompts, so 2000 draws per split cover them.
    prompts = {}
    for split, seeds in SPLITS.items():
        sample = list(items(split, family, difficulty, 2000))
        assert all(seeds.start <= it.seed < seeds.stop and it.split == split for it in sample)
        assert all(split_of_prompt(it.prompt) == split for it in sample)
        prompts[split] = {it.prompt for it in sample}
    for a, b in itertools.combinations(SPLITS, 2):
        assert not prompts[a] & prompts[b], (a, b)


def test_small_prompt_spaces_are_shared_out_without_bias():
    # 1-digit addition: the 100 prompts are divided among the splits, and each split gets odd and
    # even sums (a weak hash could split by digit parity).
    prompts = {s: {it.prompt: int(it.answer) for it in items(s, "add", 1, 2000)} for s in SPLITS}
    assert sum(len(p) for p in prompts.values()) == 100
    for split, answers in prompts.items():
        assert len(answers) >= (4 if split == "dev" else 10), (split, len(answers))  # dev: 1/16 of the space
        assert {a % 2 for a in answers.values()} == {0, 1}, split


@pytest.mark.parametrize("family,difficulty", CASES)
def test_choices_hold_the_answer_once_at_the_index(family, difficulty):
    for item in items("bench", family, difficulty, 40):
        options, index = choices(item, k=4, seed=7)
        assert len(options) == 4 and len(set(options)) == 4
        assert options[index] == item.answer and options.count(item.answer) == 1
        assert sum(verify(item, o) for o in options) == 1
        assert all(is_well_formed(family, o) for o in options)
        assert choices(item, k=4, seed=7) == (options, index)


def test_choices_vary_with_seed_and_place_the_answer_everywhere():
    item = make_item("add", 3, 2 * 10**6)
    positions = {choices(item, seed=s)[1] for s in range(40)}
    assert positions == {0, 1, 2, 3}
    assert choices(item, k=1) == ([item.answer], 0)
    assert len(choices(item, k=8)[0]) == 8


def test_choices_on_degenerate_items_still_find_distinct_distractors():
    # An all-equal list and a one-letter string: most plausible slips equal the answer.
    for item in [_item("sort", "Sort these integers in ascending order: 0 0 0\nReply.", "0 0 0"),
                 _item("reverse", "Reverse this string: aaa\nReply.", "aaa"),
                 _item("count", "Count ...", "0")]:
        options, index = choices(item, k=6)
        assert len(set(options)) == 6 and options[index] == item.answer


def test_distinct_items_count_each_prompt_once_and_a_small_cell_gives_what_it_holds():
    """An evaluation set of distinct prompts: add@1's bench share is 25 of its 100 sums, so 82 asked give those 25,
    each once (the seeds in order gave repeats: 32 seeds asked ~17 distinct sums); a large cell gives all it is
    asked; the draw is the same each time and a prefix of a larger one."""
    small = distinct_items("bench", "add", 1, 82)
    assert len(small) == len({it.prompt for it in small}) == 25
    assert len(list(items("bench", "add", 1, 32))) > len({it.prompt for it in items("bench", "add", 1, 32)})
    every_sum = {f"{a}+{b}" for a in range(10) for b in range(10)}
    bench_share = {make_item("add", 1, s).prompt for s in SPLITS["bench"][:3000]}
    assert {it.prompt for it in small} == bench_share and len(bench_share) < len(every_sum)
    large = distinct_items("bench", "sort", 2, 50)
    assert len({it.prompt for it in large}) == 50 and all(it.split == "bench" for it in large)
    assert distinct_items("bench", "sort", 2, 20) == large[:20] == distinct_items("bench", "sort", 2, 50)[:20]
