"""Verifiable task families: seeded generators with exact verifiers, for SFT, RL and the benchmark.

Each family has a difficulty knob 1..5 (digit count, list length or string length), one canonical
answer format that its prompt states, a well-formedness check (so RL counts malformed answers apart
from wrong ones) and plausible distractors for a multiple-choice view.

Answer formats (the verifier strips surrounding ASCII whitespace, then compares exactly):
  add, sub, mul, count  a decimal integer, no leading zeros, "-" only on a negative (never "-0")
  sort                  the sorted integers separated by single spaces ("3 7 7 42")
  reverse               the reversed lowercase string

Splits are disjoint by construction, on prompt text. A prompt belongs to the split chosen by the
sha256 of its text; an item made from a seed in split S redraws until its prompt belongs to S.
Disjoint seed ranges alone would not do: 1-digit addition has only 100 prompts, so every large
sample of any two ranges shares some. The price is that each split sees only its share of a small
prompt space (SFT never trains on the 1-digit sums the benchmark asks). The dev split (rl's model
selection) is a quarter of rl's prompts, by a second slice of the same hash, so rl neither trains on
the prompts it selects its checkpoint by nor ever sees the benchmark's.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass

DIFFICULTIES = range(1, 6)
SPLITS = {"sft": range(0, 10**6), "rl": range(10**6, 2 * 10**6), "bench": range(2 * 10**6, 3 * 10**6),
          "dev": range(3 * 10**6, 4 * 10**6)}
# A prompt's owner: its sha256 picks one of these slots (sft gets half of every prompt space); a second
# slice of the hash gives a quarter of the rl slot to dev.
PROMPT_SLOTS = ("sft", "sft", "rl", "bench")
# Redraws before giving up on landing in a split; a slot holds 1/4 of prompts, so 0.75**1000 ~ 1e-125.
_MAX_DRAWS = 1000

_WHITESPACE = string.whitespace  # ASCII only: str.strip() would also eat Unicode spaces
_INT = r"(?:0|-?[1-9][0-9]*)"


@dataclass(frozen=True)
class Item:
    family: str
    difficulty: int
    seed: int
    prompt: str
    answer: str  # canonical: verify() accepts exactly this, up to surrounding whitespace

    @property
    def split(self) -> str:
        return split_of_seed(self.seed)


@dataclass(frozen=True)
class Family:
    name: str
    generate: Callable[[random.Random, int], tuple[str, str]]  # (rng, difficulty) -> (prompt, answer)
    answer_pattern: str  # regex a well-formed answer fully matches
    distractors: Callable[[Item, random.Random], Iterator[str]]  # plausible first, then endless fallbacks


# ---- generators ---------------------------------------------------------------------------------

def _number(rng: random.Random, digits: int) -> int:
    """A number with exactly `digits` digits (one digit includes 0)."""
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


_INT_REPLY = "Reply with the result as a decimal integer only."


def _gen_add(rng: random.Random, difficulty: int) -> tuple[str, str]:
    a, b = _number(rng, difficulty), _number(rng, difficulty)
    return f"Compute {a} + {b}\n{_INT_REPLY}", str(a + b)


def _gen_sub(rng: random.Random, difficulty: int) -> tuple[str, str]:
    a, b = _number(rng, difficulty), _number(rng, difficulty)
    return (f"Compute {a} - {b}\nReply with the result as a decimal integer only, "
            "with a leading - if it is negative."), str(a - b)


# "Small" multiplication: digits of (a, b) per difficulty, so the product has at most 6 digits.
_MUL_DIGITS = {1: (1, 1), 2: (2, 1), 3: (2, 2), 4: (3, 2), 5: (3, 3)}


def _gen_mul(rng: random.Random, difficulty: int) -> tuple[str, str]:
    da, db = _MUL_DIGITS[difficulty]
    a, b = _number(rng, da), _number(rng, db)
    return f"Compute {a} * {b}\n{_INT_REPLY}", str(a * b)


def _gen_sort(rng: random.Random, difficulty: int) -> tuple[str, str]:
    values = [rng.randrange(100) for _ in range(difficulty + 2)]  # 3..7 values in 0..99
    return (f"Sort these integers in ascending order: {' '.join(map(str, values))}\n"
            "Reply with the sorted integers separated by single spaces."), " ".join(map(str, sorted(values)))


def _gen_reverse(rng: random.Random, difficulty: int) -> tuple[str, str]:
    text = "".join(rng.choice(string.ascii_lowercase) for _ in range(2 * difficulty + 1))  # 3..11 letters
    return f"Reverse this string: {text}\nReply with the reversed string only.", text[::-1]


_COUNT_LETTERS = "abcde"  # a small alphabet so counts above 1 are common


def _gen_count(rng: random.Random, difficulty: int) -> tuple[str, str]:
    text = "".join(rng.choice(_COUNT_LETTERS) for _ in range(5 * difficulty))  # 5..25 letters
    letter = rng.choice(_COUNT_LETTERS)
    return (f"Count how many times the letter {letter} occurs in: {text}\n"
            "Reply with the count as a decimal integer only."), str(text.count(letter))


# ---- distractors --------------------------------------------------------------------------------

def _int_distractors(answer: str, rng: random.Random, signed: bool) -> Iterator[str]:
    n = int(answer)
    digits = list(str(abs(n)))
    plausible = [n + 1, n - 1, n + 10, n - 10]
    if len(digits) >= 2:  # swap two adjacent digits
        i = rng.randrange(len(digits) - 1)
        swapped = digits[:i] + [digits[i + 1], digits[i]] + digits[i + 2:]
        plausible.append(int("".join(swapped)) * (-1 if n < 0 else 1))
    i = rng.randrange(len(digits))  # change one digit
    changed = digits[:i] + [rng.choice([d for d in "0123456789" if d != digits[i]])] + digits[i + 1:]
    plausible.append(int("".join(changed)) * (-1 if n < 0 else 1))
    if signed:
        plausible.append(-n)  # the sign slip
    rng.shuffle(plausible)
    for m in plausible:
        if signed or m >= 0:
            yield str(m)
    for step in range(2, 10**9):
        yield str(n + step)


def _sort_distractors(item: Item, rng: random.Random) -> Iterator[str]:
    values = [int(v) for v in item.answer.split()]
    unsorted = item.prompt.split(": ", 1)[1].split("\n", 1)[0]
    i = rng.randrange(len(values) - 1)
    swapped = values[:i] + [values[i + 1], values[i]] + values[i + 2:]
    j = rng.randrange(len(values))
    bumped = values[:j] + [values[j] + (1 if values[j] == 0 else rng.choice((-1, 1)))] + values[j + 1:]
    plausible = [" ".join(map(str, swapped)), " ".join(map(str, values[::-1])), unsorted,
                 " ".join(map(str, bumped))]
    rng.shuffle(plausible)
    yield from plausible
    for step in range(1, 10**9):
        for j in range(len(values)):
            yield " ".join(map(str, values[:j] + [values[j] + step] + values[j + 1:]))


def _reverse_distractors(item: Item, rng: random.Random) -> Iterator[str]:
    answer = item.answer
    i = rng.randrange(len(answer) - 1)
    swapped = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]
    j = rng.randrange(len(answer))
    changed = answer[:j] + rng.choice([c for c in string.ascii_lowercase if c != answer[j]]) + answer[j + 1:]
    plausible = [answer[::-1], swapped, changed, answer[1:] + answer[0]]  # unreversed, slips, rotation
    rng.shuffle(plausible)
    yield from plausible
    for j in range(len(answer)):
        for c in string.ascii_lowercase:
            yield answer[:j] + c + answer[j + 1:]


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("add", _gen_add, _INT, lambda item, rng: _int_distractors(item.answer, rng, signed=False)),
    Family("sub", _gen_sub, _INT, lambda item, rng: _int_distractors(item.answer, rng, signed=True)),
    Family("mul", _gen_mul, _INT, lambda item, rng: _int_distractors(item.answer, rng, signed=False)),
    Family("sort", _gen_sort, rf"{_INT}(?: {_INT})*", _sort_distractors),
    Family("reverse", _gen_reverse, r"[a-z]+", _reverse_distractors),
    Family("count", _gen_count, _INT, lambda item, rng: _int_distractors(item.answer, rng, signed=False)),
]}


# ---- splits, items, verification ----------------------------------------------------------------

def split_of_seed(seed: int) -> str:
    for name, seeds in SPLITS.items():
        if seed in seeds:
            return name
    raise ValueError(f"seed {seed} is in no split; splits: {SPLITS}")


def split_of_prompt(prompt: str) -> str:
    # sha256, not FNV-1a: FNV's low bits depend only on the input bytes' low bits, so "mod 4" would
    # split additions by the parity of their digits.
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    slot = PROMPT_SLOTS[int.from_bytes(digest[:8], "big") % len(PROMPT_SLOTS)]
    if slot == "rl" and int.from_bytes(digest[8:16], "big") % 4 == 0:
        return "dev"
    return slot


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def make_item(family: str, difficulty: int, seed: int) -> Item:
    """The item for (family, difficulty, seed): the same on every machine and Python version."""
    fam = _family(family)
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty {difficulty} outside {DIFFICULTIES.start}..{DIFFICULTIES.stop - 1}")
    split = split_of_seed(seed)
    rng = random.Random(f"{family}:{difficulty}:{seed}")  # str seeds go through sha512: stable, no hash()
    for _ in range(_MAX_DRAWS):
        prompt, answer = fam.generate(rng, difficulty)
        if split_of_prompt(prompt) == split:
            return Item(family, difficulty, seed, prompt, answer)
    raise RuntimeError(f"no {split} prompt for {family} difficulty {difficulty} seed {seed} in {_MAX_DRAWS} draws")


def items(split: str, family: str, difficulty: int, n: int, start: int = 0) -> Iterator[Item]:
    """n items whose seeds are the split's seeds start, start+1, ..."""
    seeds = SPLITS[split]
    if start < 0 or start + n > len(seeds):
        raise ValueError(f"seeds {start}..{start + n - 1} outside the {len(seeds)} seeds of split {split!r}")
    for offset in range(start, start + n):
        yield make_item(family, difficulty, seeds[offset])


# Seeds in a row that add no new prompt before a cell is taken as exhausted: the smallest cells hold 7-27 prompts of
# a split (sub@1 dev, mul@1 bench), and missing one of 25 equally likely prompts 400 times in a row has p ~ 1e-7.
DISTINCT_PATIENCE = 400


def distinct_items(split: str, family: str, difficulty: int, n: int) -> list[Item]:
    """Up to n items of distinct prompts: the split's seeds in order, an item whose prompt came already passed over.
    A cell whose share of the prompt space is smaller than n (1-digit sums: ~25 bench prompts) gives each of its
    prompts once, and stops after DISTINCT_PATIENCE seeds in a row brought none new. An evaluation set counts
    each prompt once: greedy decoding answers a repeat alike, so a repeated item adds weight, not evidence."""
    seeds = SPLITS[split]
    out: list[Item] = []
    seen: set[str] = set()
    dry = 0
    for seed in seeds:
        if len(out) == n or dry == DISTINCT_PATIENCE:
            break
        item = make_item(family, difficulty, seed)
        if item.prompt in seen:
            dry += 1
            continue
        seen.add(item.prompt)
        out.append(item)
        dry = 0
    return out


def is_well_formed(family: str, response: str) -> bool:
    """Whether the response has the family's answer format (right or wrong)."""
    return re.fullmatch(_family(family).answer_pattern, response.strip(_WHITESPACE)) is not None


def verify(item: Item, response: str) -> bool:
    return response.strip(_WHITESPACE) == item.answer


def choices(item: Item, k: int = 4, seed: int = 0) -> tuple[list[str], int]:
    """k distinct well-formed options, the answer among them exactly once; (options, index of the answer)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    rng = random.Random(f"choices:{item.family}:{item.difficulty}:{item.seed}:{seed}")
    options = [item.answer]
    for candidate in _family(item.family).distractors(item, rng):
        if len(options) == k:
            break
        if candidate not in options and is_well_formed(item.family, candidate):
            options.append(candidate)
    rng.shuffle(options)
    return options, options.index(item.answer)
