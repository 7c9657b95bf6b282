"""Post-training settings as types: the `tasks` section and rl's sub-sections, built once in the stage from the job's
params (validated presets: every key present) and read as attributes below it (the dicts stay what is digested).
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from dormouse.train.settings import build_settings


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledEval:
    samples: int  # 0: greedy only
    temperature: float
    seed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSettings:
    """tasks: the families and difficulties every post-training stage and bench ask, the held-out set's size per
    cell, the answer budget and the sampled eval."""

    families: tuple[str, ...]
    difficulties: tuple[int, ...]
    heldout_items: int
    max_new_bytes: int
    sampled_eval: SampledEval

    @classmethod
    def of(cls, section: dict) -> TaskSettings:
        return build_settings(cls, section, "tasks", families=tuple(section["families"]),
                      difficulties=tuple(section["difficulties"]),
                      sampled_eval=build_settings(SampledEval, section["sampled_eval"], "tasks.sampled_eval"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Plateau:
    checkpoints: int
    min_rise: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SelectSettings:
    """rl.select: the dev checks (every `every` steps, `items_per_cell` distinct prompts a cell) and the rule that
    ships a checkpoint (posttrain/selection.py)."""

    every: int
    items_per_cell: int
    rule: str
    alpha: float
    min_z: float
    plateau: Plateau | None

    @classmethod
    def of(cls, section: dict) -> SelectSettings:
        p = section.get("plateau")
        return build_settings(cls, {**section, "plateau": p}, "rl.select",
                      plateau=None if p is None else build_settings(Plateau, p, "rl.select.plateau"))


@dataclass(frozen=True, slots=True, kw_only=True)
class CurriculumSettings:
    start: int
    max: int | None
    window: int
    promote_at: float

    @classmethod
    def of(cls, section: dict) -> CurriculumSettings:
        return build_settings(cls, section, "rl.curriculum")


@dataclass(frozen=True, slots=True, kw_only=True)
class PassRateSettings:
    window: int
    floor: float
    prior: float

    @classmethod
    def of(cls, section: dict) -> PassRateSettings:
        return build_settings(cls, section, "rl.pass_rate")
