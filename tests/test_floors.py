"""The package's floors (docs/architecture.md): import-linter's contracts in pyproject.toml ([tool.importlinter]: a
module imports only from its own floor or a lower one, siblings of a floor nothing of each other, no stage another
stage), run here as `make lint` runs them, and failing once on a planted upward import; beside them, what
import-linter does not read: tests and benchmarks reach no stage, stage files and functions stay short."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every dormouse import in `path` (`from dormouse.x import y` names dormouse.x.y when y is a
    module: `from dormouse import stages` is an import of the stages floor)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("dormouse.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dormouse"):
            out += [(node.lineno, f"{node.module}.{a.name}" if node.module == "dormouse" else node.module)
                    for a in node.names]
    return out


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the repository's contracts over the dormouse package under `root`."""
    if not LINT_IMPORTS.exists():
        pytest.skip("import-linter is not installed (requirements-test.txt; `make test` installs it)")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_every_package_sits_on_a_floor():
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {m.strip().removeprefix("dormouse.") for layer in layers for m in layer.split("|")}
    packages = {p.name for p in (ROOT / "dormouse").iterdir() if (p / "__init__.py").exists()} | {"cli"}
    assert packages == named, f"packages without a floor or floors without a package: {packages ^ named}"


def test_the_floors_hold_and_a_planted_upward_import_breaks_them(tmp_path):
    kept = lint_imports(ROOT)
    assert kept.returncode == 0 and "0 broken" in kept.stdout, kept.stdout[-2000:]
    shutil.copytree(ROOT / "dormouse", tmp_path / "dormouse", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "dormouse" / "core" / "store.py", "a") as f:
        f.write("\n\ndef planted():\n    from ..planner import plan  # relative, inside a function\n    return plan\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0 and "dormouse.core.store -> dormouse.planner.plan" in broken.stdout, broken.stdout[-2000:]


@pytest.mark.parametrize("where", ["tests", "benchmarks"])
def test_only_the_cli_reaches_the_stages(where):
    """Tests and benchmarks import the layers; a stage runs through `dormouse <stage>` (the CLI's dispatch)."""
    hits = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / where).rglob("*.py"))
            for line, target in imports_of(p) if target.startswith("dormouse.stages")]
    assert hits == []


def test_stage_files_are_entry_points_and_functions_stay_short():
    """Each stage file under 200 lines; no function in dormouse/ over 80 (library code lives in the layers)."""
    long_stages = [f"{p.name}: {n}" for p in sorted((ROOT / "dormouse" / "stages").glob("*.py"))
                   if (n := len(p.read_text().splitlines())) >= 200]
    long_functions = [f"{p.relative_to(ROOT)}:{node.name} {node.end_lineno - node.lineno + 1} lines"
                      for p in sorted((ROOT / "dormouse").rglob("*.py")) for node in ast.walk(ast.parse(p.read_text()))
                      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80]
    assert long_stages == [] and long_functions == []


def test_no_settings_section_travels_as_a_dict_and_benchmarks_edit_no_sys_path():
    """Below the planner and the stages, no parameter is annotated as a settings section's dict (`train: dict`, ...:
    the library takes the typed settings); no benchmark edits sys.path (they run as `python -m benchmarks.<name>`)."""
    sections = {"train", "rl", "sft", "tasks", "task_params", "eval", "model"}
    below = [p for p in sorted((ROOT / "dormouse").rglob("*.py"))
             if p.relative_to(ROOT / "dormouse").parts[0] not in ("planner", "stages")]
    dicts = [f"{p.relative_to(ROOT)}:{a.lineno} {a.arg}: dict" for p in below for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
             for a in node.args.args + node.args.kwonlyargs
             if a.arg in sections and a.annotation is not None and ast.unparse(a.annotation) == "dict"]
    edits = [f"{p.relative_to(ROOT)}" for p in sorted((ROOT / "benchmarks").glob("*.py")) if "sys.path." in p.read_text()]
    assert dicts == [] and edits == []
