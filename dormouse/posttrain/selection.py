"""rl's checkpoint choice: pure functions of per-item dev correctness, and the stage's `Selection` that feeds them.
Three rules, each holding the false-ship rate (a checkpoint shipped when none is better than step 0, the SFT model)
to `alpha` or below whatever the number of checkpoints; benchmarks/rl_selection_sim.py simulates them through `decide`.

final: one test, planned before the run: the last checkpoint (the model rl ends with: at rl.steps, or where the
plateau stopped it) ships if the exact one-sided sign test against step 0 on all the dev prompts gives p <= alpha,
else step 0. The checks before it draw the dev curve and test nothing, so nothing is spent on them: a gain that builds
up to the end passes at alpha, where bonferroni asks alpha / the planned checkpoints (+10 points in one 96-prompt
cell with 4 prompts lost elsewhere: p 0.015, shipped by final, not by bonferroni over 6 checks). A peak mid-run that
fades is not shipped.

bonferroni (the default): each checkpoint is tested against step 0 on all the dev prompts by the exact one-sided sign
test (each distinct prompt once: P(at least `gained` of the gained + lost discordant prompts under a fair coin)), at
p <= alpha / m, m being the checkpoints the run planned (rl.steps and select.every: stopping early tests a prefix of
them, which keeps the union bound); the most accurate checkpoint that passes ships (the earliest on a tie), else
step 0. Exact, not the normal z: with few discordant prompts the normal tail undershoots (11 discordant at m = 15:
the exact tail is 1.8x alpha / m). On the simulated small arms it had the same null
rate as select_then_confirm and more power in every gain scenario: it tests on all the prompts, not half.

select_then_confirm: the dev items are cut in two by their prompt text (sha256 bytes 16..24, a slice
tasks.split_of_prompt does not read), so the halves share no prompt and every repeat of a prompt lands in the same
half. The candidate is the checkpoint (step > 0) most accurate on the select half (the earliest on a tie); it ships
only if the paired sign test against step 0 on the confirm half gives z >= min_z, else step 0 ships. Under the null
the confirm half never took part in the choice, so the chance of shipping is that of one test, P(z >= min_z).

Testing each checkpoint against step 0 on all the items at z >= 2 and shipping the best that passed (rl format 10
and before) compounded ten chances: ~17 % under the null.

The stage's `Selection` (below: the dev checks, the copies of step 0 and the candidate) and the simulation both call
`candidate` and `decide`, so the simulated rates are the stage's."""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache

from dormouse.core import progress
from dormouse.posttrain import task_eval
from dormouse.posttrain.decode import DecodeStep
from dormouse.posttrain.settings import SelectSettings
from dormouse.posttrain.task_eval import paired_sign

RULES = ("bonferroni", "select_then_confirm", "final")


@lru_cache(maxsize=1 << 16)
def half_of_prompt(prompt: str) -> str:
    """'select' or 'confirm', by sha256 bytes 16..24 of the prompt (split_of_prompt reads bytes 0..16)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return "confirm" if int.from_bytes(digest[16:24], "big") % 2 else "select"


def distinct_units(prompts: list[str]) -> list[int]:
    """The index of the first item of each distinct prompt, in order: what a test counts (a repeat answers alike)."""
    first: dict[str, int] = {}
    for i, p in enumerate(prompts):
        first.setdefault(p, i)
    return sorted(first.values())


def halves(prompts: list[str]) -> tuple[list[int], list[int]]:
    """distinct_units split into the select half and the confirm half."""
    sel, conf = [], []
    for i in distinct_units(prompts):
        (conf if half_of_prompt(prompts[i]) == "confirm" else sel).append(i)
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


def plateaued(accuracies: list[float], checkpoints: int, min_rise: float) -> bool:
    """accuracies[0] is step 0's, the rest each check's in order: True once the best of the last `checkpoints` checks
    is below the best of everything before them + min_rise (rl stops there; its cap is rl.steps)."""
    if len(accuracies) <= checkpoints:
        return False
    return max(accuracies[-checkpoints:]) < max(accuracies[:-checkpoints]) + min_rise - 1e-12


def sign_p(gained: int, lost: int) -> float:
    """The exact one-sided sign-test p-value: P(X >= gained) for X ~ Binomial(gained + lost, 1/2); 1 with no
    discordant prompt."""
    n = gained + lost
    return 1.0 if n == 0 else sum(math.comb(n, k) for k in range(gained, n + 1)) / 2**n


def p_crit(alpha: float, planned: int) -> float:
    """What a checkpoint's sign_p must not exceed under bonferroni: alpha spread over `planned` tests."""
    if not 0 < alpha < 1 or planned < 1:
        raise ValueError(f"bonferroni needs 0 < alpha < 1 and at least one planned checkpoint, got {alpha}, {planned}")
    return alpha / planned


def _tests(steps: list[int], correct: list[list[bool]], prompts: list[str]) -> list[dict]:
    """Every checkpoint's paired sign test against step 0 on all the prompts (each distinct prompt once)."""
    out = []
    for s, right in zip(steps[1:], correct[1:], strict=True):
        t = paired_sign(correct[0], right, prompts)
        out.append({"step": s, **t, "p": sign_p(t["gained"], t["lost"])})
    return out




def candidate(rule: str, steps: list[int], correct: list[list[bool]], prompts: list[str], *, alpha: float = 0.05,
              planned: int = 1) -> int:
    """The step the rule would ship or test from these rows (0: none yet): select_then_confirm's best on the select
    half; bonferroni's most accurate checkpoint passing p_crit on all the prompts. Either is the earliest on a tie and
    either stays put or moves to the newest step as rows are added, so the stage keeps one copy."""
    if rule == "select_then_confirm":
        return candidate_of(steps, correct, halves(prompts)[0])
    if rule == "final":  # the newest checkpoint is the one tested; the stage keeps no copy (it ends holding it)
        return steps[-1] if len(steps) > 1 else 0
    if rule != "bonferroni":
        raise ValueError(f"unknown selection rule {rule!r}; known: {RULES}")
    crit, units = p_crit(alpha, planned), distinct_units(prompts)
    best, best_step = -1, 0
    for t, right in zip(_tests(steps, correct, prompts), correct[1:], strict=True):
        n = sum(right[i] for i in units)
        if t["p"] <= crit and n > best:
            best, best_step = n, t["step"]
    return best_step


def decide(steps: list[int], correct: list[list[bool]], prompts: list[str], min_z: float = 1.7, *,
           rule: str = "bonferroni", alpha: float = 0.05, planned: int | None = None) -> dict:
    """steps[0] is 0 (the SFT model), the rest the checkpoints in order; correct[k][i] whether step k answered dev
    item i (prompt prompts[i]) right. Returns the rule's name, the candidate and the selected step, and the rule's
    evidence: bonferroni's alpha, planned checkpoints, p_crit and every checkpoint's test on all the prompts;
    select_then_confirm's halves (distinct item counts, each step's accuracy on either half) and confirm test."""
    if not steps or steps[0] != 0 or len(steps) != len(correct):
        raise ValueError(f"steps {steps} with {len(correct)} rows: step 0 first, one row per step")
    if rule == "bonferroni":
        planned = planned if planned is not None else len(steps) - 1
        if planned < len(steps) - 1:
            raise ValueError(f"bonferroni: {len(steps) - 1} checkpoints tested, {planned} planned")
        crit = p_crit(alpha, max(planned, 1))
        tests = [{**t, "z": round(t["z"], 3), "p": float(f"{t['p']:.4g}")} for t in _tests(steps, correct, prompts)]
        cand = candidate(rule, steps, correct, prompts, alpha=alpha, planned=max(planned, 1))
        return {"rule": rule, "alpha": alpha, "planned_checkpoints": planned, "p_crit": float(f"{crit:.4g}"),
                "units": len(distinct_units(prompts)), "tests": tests, "candidate_step": cand, "selected_step": cand}
    if rule == "final":
        tests = [{**t, "z": round(t["z"], 3), "p": float(f"{t['p']:.4g}")} for t in _tests(steps, correct, prompts)]
        last = tests[-1] if tests else None
        ships = last is not None and sign_p(last["gained"], last["lost"]) <= alpha
        return {"rule": rule, "alpha": alpha, "units": len(distinct_units(prompts)), "tests": tests,
                "candidate_step": steps[-1] if tests else 0, "selected_step": steps[-1] if ships else 0}
    if rule != "select_then_confirm":
        raise ValueError(f"unknown selection rule {rule!r}; known: {RULES}")
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
    return {"rule": rule, "candidate_step": cand, "select_items": len(sel), "confirm_items": len(conf),
            "confirm": {**test, "z": round(test["z"], 3)}, "halves": curve, "min_z": min_z,
            "selected_step": cand if ships else 0}


class Selection:
    """Greedy dev correctness per item at step 0 (the SFT model) and every `select.every` steps; `restore` then ships
    what decide picks under `select.rule` (bonferroni by default: the most accurate checkpoint that beats
    step 0 on all the dev prompts at p <= alpha / the planned checkpoints), else step 0. Two CPU copies are kept:
    step 0's and the rule's candidate so far (selection.candidate stays put or moves to the newest step). Testing each
    of ten checkpoints at z >= 2 and shipping the best that passed (format 10) shipped noise ~17 % of the time under
    the null (benchmarks/rl_selection_sim.py). `stop` says when dev accuracy has reached its plateau
    (select.plateau). With `every` 0 it does nothing and the last step's model is kept."""

    def __init__(self, model, dev: list, max_new_bytes: int, device, dtype: str, select: SelectSettings, steps: int,
                 decoder: DecodeStep | None = None):
        self.model, self.dev, self.device, self.select = model, dev, device, select
        self.decoder = decoder  # every check through it (step 0 too): checks compare with each other only
        self.max_new, self.dtype = max_new_bytes, dtype
        self.prompts = [it.prompt for it in dev]
        every = select.every
        self.planned = len(set(range(every, steps + 1, every)) | {steps}) if every else 0  # as `due` checks
        self.rule_args = {"rule": select.rule, "alpha": select.alpha, "planned": max(self.planned, 1)}
        self.curve: list[tuple[int, float]] = []
        self.cell_curve: list[dict] = []  # per check: accuracy per family.difficulty (which cells rl moves)
        self.units = distinct_units(self.prompts)
        self.paired: list[dict] = []
        self.steps: list[int] = []
        self.rows: list[list[bool]] = []
        self.base_state = self.cand_state = None
        self.cand_step = 0
        self.decision: dict | None = None
        if dev:
            self.check(0)

    def due(self, step: int, steps: int) -> bool:
        return bool(self.dev) and (step % self.select.every == 0 or step == steps)

    def _copy(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def check(self, step: int) -> float:
        right = task_eval.correct(self.model, self.dev, self.max_new, self.device, self.dtype, step=self.decoder)
        acc = round(sum(right[i] for i in self.units) / len(self.units), 5)  # each distinct prompt once, as the tests count
        self.curve.append((step, acc))
        by_cell: dict[str, list[bool]] = {}
        for i in self.units:
            by_cell.setdefault(f"{self.dev[i].family}.{self.dev[i].difficulty}", []).append(right[i])
        cells = {k: round(sum(v) / len(v), 4) for k, v in sorted(by_cell.items())}
        self.cell_curve.append({"step": step, **cells})
        progress.note(f"[rl] dev@{step}: accuracy {acc} over {len(self.units)} distinct prompts; per cell "
                      + " ".join(f"{k} {v}" for k, v in cells.items()))
        self.steps.append(step)
        self.rows.append(right)
        if step == 0:
            self.base_state = self._copy()
        else:  # all the dev prompts against step 0 (bonferroni's test; descriptive under select_then_confirm)
            paired = task_eval.paired_sign(self.rows[0], right, self.prompts)
            self.paired.append({"step": step, **paired, "z": round(paired["z"], 3)})
            cand = candidate(steps=self.steps, correct=self.rows, prompts=self.prompts, **self.rule_args)
            if self.select.rule == "final":  # the model rl ends with is the one tested: no copy
                self.cand_step = cand
            elif cand == step and cand != self.cand_step:
                self.cand_step = cand
                self.cand_state = None  # the old copy goes before the new one is made
                self.cand_state = self._copy()
        return acc

    def stop(self) -> bool:
        """Whether dev accuracy has reached its plateau: the best of the last `checkpoints` checks is below the best
        before them + min_rise (select.plateau; None: never)."""
        plateau = self.select.plateau
        return bool(self.dev) and plateau is not None and plateaued(
            [a for _, a in self.curve], plateau.checkpoints, plateau.min_rise)

    def decide(self) -> dict:
        self.decision = decide(self.steps, self.rows, self.prompts, self.select.min_z, **self.rule_args)
        if self.decision["candidate_step"] != self.cand_step:
            raise RuntimeError(f"selection kept step {self.cand_step}, the rule's candidate is "
                               f"{self.decision['candidate_step']}")
        return self.decision

    def restore(self) -> None:
        self.decoder = None  # its graphs and buffers go before the held-out decode
        if self.dev:
            selected = self.decide()["selected_step"]
            if not (selected and self.select.rule == "final"):  # final ships the weights rl ends with, as they are
                self.model.load_state_dict(self.cand_state if selected else self.base_state)
            self.base_state = self.cand_state = None

    def report(self) -> dict:
        """The rule and its evidence (selection.decide), each step's accuracy on the distinct dev prompts (`curve`),
        its accuracy per family.difficulty cell (`cell_curve`: which cells rl moves), each checkpoint's test against step
        0 on all of them (`vs_step0`) and the selected step (None with
        selection off)."""
        if not self.dev:
            return {"rule": self.select.rule, "dev_items": 0, "curve": [], "vs_step0": [],
                    "min_z": self.select.min_z, "selected_step": None}
        return {"dev_items": len(self.dev), "curve": self.curve, "cell_curve": self.cell_curve, "vs_step0": self.paired,
                "min_z": self.select.min_z, **(self.decision or self.decide())}


def selection_line(r: dict) -> str:
    """The selection's evidence in one line."""
    if r["rule"] == "final":
        t = r["tests"][-1] if r["tests"] else None
        return (f"final: the last checkpoint against step 0, p <= {r['alpha']}; "
                + (f"step {t['step']} gained {t['gained']} lost {t['lost']} p {t['p']}" if t else "no checkpoint"))
    if r["rule"] == "bonferroni":
        best = min(r["tests"], key=lambda t: t["p"], default=None)
        return (f"bonferroni: p <= {r['p_crit']} (alpha {r['alpha']} over {r['planned_checkpoints']} planned "
                f"checkpoints); the least p {best['p'] if best else None} at step {best['step'] if best else None}")
    return (f"candidate {r['candidate_step']}, best on the select half; on the confirm half vs step 0: gained "
            f"{r['confirm']['gained']} lost {r['confirm']['lost']} z {r['confirm']['z']}, min_z {r['min_z']}")
