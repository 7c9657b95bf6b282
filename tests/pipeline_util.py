"""Test helpers: point a workflow copy at a fixture corpus and run stages through the plan."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from dormouse.cli import main as dormouse_main
from dormouse.planner.plan import build_plan

# workflow/profiles/slurm's executor is pyproject's [slurm] extra, not in requirements.txt (it slows every
# snakemake start where no SLURM controller answers); requirements-test.txt installs it for `make test`.
needs_slurm_plugin = pytest.mark.skipif(
    importlib.util.find_spec("snakemake_executor_plugin_slurm") is None,
    reason="snakemake-executor-plugin-slurm is not installed: pyproject's [slurm] extra (make env-slurm; make test has it)")


def configure(workdir: Path, corpus: Path, positive: Path, negative: Path, presets=("tiny",), **shard) -> dict:
    for name in presets:
        path = workdir / "config" / "presets" / f"{name}.yaml"
        preset = yaml.safe_load(path.read_text())
        q = preset["data"]["filter"]["quality"]
        q["positive"], q["negative"] = [str(positive)], [str(negative)]
        preset["data"]["shard"].update({"num_shards": 3, "eval_tail_bytes": 60_000, **shard})
        preset["anchors"]["max_order"] = 4
        path.write_text(yaml.safe_dump(preset, sort_keys=False))
    config = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    config.update(corpus=str(corpus), presets=list(presets), preset=presets[0])
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def plan_in(workdir: Path, config: dict):
    """build_plan as Snakemake would make it in `workdir` (its presets, corpus and store paths are relative)."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        return build_plan(config)
    finally:
        os.chdir(cwd)


def run_chain(workdir: Path, config: dict, preset: str = "tiny", stages=("filter", "shard", "anchors")):
    """Run stages in order as Snakemake would (same job JSON), in workdir; returns the plan."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        plan = build_plan(config)
        for stage in stages:
            digest = plan.chain[preset][stage]
            if not Path(plan.manifest_path(stage, digest)).exists():
                assert dormouse_main([stage, "--job", plan.job_json(stage, digest)]) == 0
        return plan
    finally:
        os.chdir(cwd)


def manifest(workdir: Path, plan, stage: str, preset: str = "tiny") -> dict:
    return json.loads((workdir / plan.manifest_path(stage, plan.chain[preset][stage])).read_text())
