"""Typed settings (dormouse/train/settings.py): built from every preset and from a job's digested params, strict on
names both ways, and every attribute the training library reads off them exists, so a misspelt setting in a
GPU-only branch fails here, on the CPU."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from dormouse.core.config import load_preset
from dormouse.planner.registry import stage_params
from dormouse.train.settings import OptimSettings, QATFinish, TrainSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", ["tiny", "small", "medium", "b1"])
def test_every_preset_and_its_job_params_give_the_same_settings(preset):
    resolved = load_preset(preset, ROOT)
    from_preset = TrainSettings.of(resolved["train"])
    from_params = TrainSettings.of(stage_params("pretrain", resolved)["train"])  # later defaults left out there
    assert from_preset == from_params and from_preset.steps == resolved["train"]["steps"]
    assert from_preset.optim == OptimSettings.of(resolved["train"])


def test_a_missing_or_unknown_key_is_named():
    train = load_preset("tiny", ROOT)["train"]
    with pytest.raises(KeyError, match="no lr"):
        TrainSettings.of({k: v for k, v in train.items() if k != "lr"})
    with pytest.raises(KeyError, match=r"unknown keys \['lr_typo'\]"):
        TrainSettings.of({**train, "lr_typo": 1.0})
    qat = TrainSettings.of({**train, "qat": {"rung": "ternary", "fraction": 0.2}, "ptq_rungs": ["int8"]})
    assert qat.qat == QATFinish(rung="ternary", fraction=0.2) and qat.ptq_rungs == ("int8",)


def attribute_reads(path: Path, names: tuple[str, ...]) -> set[str]:
    """Every attribute read off an expression spelled as one of `names` (`train`, `self.train`, ...) in the code, and
    every subscript or .get() of one as "[...]" (a settings object is read by attribute only), f-strings included."""
    reads = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in names:
            reads.add(node.attr)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) in names:
            reads.add(f"[{ast.unparse(node.slice)}]")
    return reads


def test_every_setting_the_library_reads_exists():
    train_fields = {f.name for f in fields(TrainSettings)} | {"optim"}
    opt_fields = {f.name for f in fields(OptimSettings)}
    readers = {p: ("self.train", "loop.train") for p in (ROOT / "dormouse" / "train").glob("*.py")}
    readers[ROOT / "dormouse" / "stages" / "pretrain.py"] = ("train", "loop.train")
    for p in ("finish.py", "loop.py", "trainer.py", "arms.py"):
        readers[ROOT / "dormouse" / "train" / p] = ("train", "self.train")
    unknown = {f"{p.relative_to(ROOT)}: {name}" for p, names in readers.items()
               for name in attribute_reads(p, names) - train_fields}
    unknown |= {f"dormouse/train/optim.py: settings.{n}" for n in attribute_reads(
        ROOT / "dormouse" / "train" / "optim.py", ("settings",)) - opt_fields}
    assert not unknown, sorted(unknown)


def test_the_check_sees_a_misspelt_setting(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f(train):\n    return train.max_bad_step, f\"{train['steps']}\"\n")
    assert attribute_reads(bad, ("train",)) - {f.name for f in fields(TrainSettings)} == {"max_bad_step", "['steps']"}


def test_every_posttrain_setting_read_exists():
    """The same check for the post-training settings: each name a library file reads them by, and their fields."""
    from dormouse.posttrain.grpo import GRPOSettings
    from dormouse.posttrain.settings import (CurriculumSettings, PassRateSettings, Plateau, SampledEval, SelectSettings,
                                             TaskSettings)

    post, stages = ROOT / "dormouse" / "posttrain", ROOT / "dormouse" / "stages"
    checks = [(post / "task_eval.py", ("task_set",), TaskSettings), (post / "task_eval.py", ("s",), SampledEval),
              (post / "selection.py", ("self.select", "select"), SelectSettings),
              (post / "selection.py", ("plateau",), Plateau), (post / "grpo.py", ("s", "self.s"), GRPOSettings),
              (post / "grpo.py", ("cur", "self.cur"), CurriculumSettings),
              (post / "grpo.py", ("settings", "self.settings"), PassRateSettings),
              (stages / "rl.py", ("task_set",), TaskSettings), (stages / "rl.py", ("select_set",), SelectSettings),
              (stages / "rl.py", ("s",), GRPOSettings), (stages / "sft.py", ("task_set",), TaskSettings),
              (stages / "bench.py", ("task_set",), TaskSettings)]
    unknown = [f"{path.name}: {names[0]}.{name}" for path, names, cls in checks
               for name in attribute_reads(path, names) - {f.name for f in fields(cls)}]
    assert unknown == []
