"""rl's checkpoint choice as a pure function of per-item dev correctness: select on one half, confirm on the other.

The dev items are cut in two by their prompt text (sha256 bytes 16..24, a slice tasks.split_of_prompt does not
read), so the halves share no prompt and every repeat of a prompt lands in the same half. The candidate is the
checkpoint (step > 0) most accurate on the select half (the earliest on a tie); it ships only if the paired sign
test against step 0 on the confirm half gives z >= min_z, else step 0 ships. Under the null (no checkpoint better
than step 0) the confirm half never took part in the choice, so the chance of shipping is that of one test,
P(z >= min_z), however many checkpoints were compared: testing each checkpoint against step 0 on all the items
and shipping the best that passed (rl format 10 and before) compounded ten chances.

The stage (dormouse/stages/rl.py, Selection) and the simulation (benchmarks/rl_selection_sim.py) both call
`decide`, so the simulated rates are the stage's.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from dormouse.posttrain.task_eval import paired_sign

RULE = "select_then_confirm"


@lru_cache(maxsize=1 << 16)
def half_of_prompt(prompt: str) -> str:
    """'select' or 'confirm', by sha256 bytes 16..24 of the prompt (split_of_prompt reads bytes 0..16)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return "confirm" if int.from_bytes(digest[16:24], "big") % 2 else "select"


def halves(prompts: list[str]) -> tuple[list[int], list[int]]:
    """Indices of the first item of each distinct prompt, in order, in the select half and the confirm half."""
    first: dict[str, int] = {}
    for i, p in enumerate(prompts):
        first.setdefault(p, i)
    sel, conf = [], []
    for p, i in first.items():
        (conf if half_of_prompt(p) == "confirm" else sel).append(i)
    return sel, conf


def _accuracy(right: list[bool], units: list[int]) -> float | None:
    return round(sum(right[i] for i in units) / len(units), 5) if units else None


def candidate_of(steps: list[int], correct: list[list[bool]], select_units: list[int]) -> int:
    """The step > 0 most accurate on the select half, the earliest on a tie; 0 when there is none."""
    best, best_step = -1, 0
    for step, right in zip(steps, correct, strict=True):
        if step > 0:
            n = sum(right[i] for i in select_units)
            if n > best:
                best, best_step = n, step
    return best_step


def decide(steps: list[int], correct: list[list[bool]], prompts: list[str], min_z: float) -> dict:
    """steps[0] is 0 (the SFT model), the rest the checkpoints in order; correct[k][i] whether step k answered dev
    item i (prompt prompts[i]) right. Returns the rule's name, the candidate, the halves' distinct item counts, the
    confirm test (gained, lost, z, units), each step's accuracy on either half, min_z and the selected step."""
    if not steps or steps[0] != 0 or len(steps) != len(correct):
        raise ValueError(f"steps {steps} with {len(correct)} rows: step 0 first, one row per step")
    sel, conf = halves(prompts)
    cand = candidate_of(steps, correct, sel)
    if cand:
        base, new = correct[0], correct[steps.index(cand)]
        test = paired_sign([base[i] for i in conf], [new[i] for i in conf], [prompts[i] for i in conf])
    else:
        test = {"gained": 0, "lost": 0, "z": 0.0, "units": len(conf)}
    ships = bool(cand) and test["z"] >= min_z
    curve = [{"step": s, "select": _accuracy(r, sel), "confirm": _accuracy(r, conf)}
             for s, r in zip(steps, correct, strict=True)]
    return {"rule": RULE, "candidate_step": cand, "select_items": len(sel), "confirm_items": len(conf),
            "confirm": {**test, "z": round(test["z"], 3)}, "halves": curve, "min_z": min_z,
            "selected_step": cand if ships else 0}
