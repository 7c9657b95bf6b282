"""Which enabled model arms left no trace in a run's counters, and what a QAT finish is made of: its first step and the
params it shares with a branch's trunk (torch-free: the verdict and the plan read it too)."""

from __future__ import annotations

from dormouse.model.config import ModelConfig  # torch-free
from dormouse.train.settings import TrainSettings


def finish_start(steps: int, fraction: float) -> int:
    """The first step of a quantization-aware finish over the last `fraction` of `steps` (steps from it on see the
    rung); torch-free, for the plan's experiments too."""
    return steps - round(fraction * steps)


def before_finish(params: dict, also: tuple[str, ...] = ()) -> dict:
    """Params (or a preset) without the train keys a branched finish may differ in from its trunk (its finish, the
    rungs it measures after training, the checkpoints it keeps) and `also`: what the two must share."""
    free = ("qat", "ptq_rungs", "keep_checkpoints", *also)
    return {**params, "train": {k: v for k, v in params["train"].items() if k not in free}}


def inert_arms(model: ModelConfig, counters: dict, prefix: str = "") -> list[str]:
    """Problems for a model config and counters (keys under `prefix`)."""
    def total(start: str) -> int:
        return sum(v for k, v in counters.items() if k.startswith(prefix + start))

    problems = []
    if not total("kda_path."):
        problems.append("no KDA call counted")
    if model.engram and not total("engram.rows_read"):
        problems.append("engram enabled but no rows read")
    if model.moe and not total("moe.tokens."):
        problems.append("moe enabled but no tokens routed")
    if not total("loop.iterations"):
        problems.append("no loop iterations counted")
    return problems


def inert_qat(train: TrainSettings, counters: dict) -> list[str]:
    """Problems of a pretrain whose train.qat (params.train) left no trace in its manifest counters: no step through the
    rung although the finish has some, or no eval through it (the final eval always runs through it)."""
    qat = train.qat
    problems = [f"train.ptq_rungs lists {r} but no eval ran through it" for r in train.ptq_rungs
                if not counters.get(f"eval.ptq.{r}.evals")]
    if not qat:
        return problems
    if finish_start(train.steps, qat.fraction) < train.steps and not counters.get("train.qat.steps"):
        problems.append(f"train.qat on but no step trained through {qat.rung}")
    if not counters.get("eval.qat.evals"):
        problems.append(f"train.qat on but no eval ran through {qat.rung}")
    return problems
