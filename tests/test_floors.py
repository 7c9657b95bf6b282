"""The package's floors (README's layout): a module imports only from its own floor or a lower one, so the core never
reaches the planner and no library reaches a stage. Every import is read, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"core": 1, "model": 2, "data": 2, "train": 3, "posttrain": 4, "planner": 5, "tools": 5, "stages": 6,
          "serve": 6, "cli": 7}


def floor_of(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if parts[0] == "dormouse" and len(parts) > 1 else None


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


def crossings(root: Path) -> list[str]:
    bad = []
    for path in sorted((root / "dormouse").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        own = floor_of(module)
        for line, target in imports_of(path):
            to = floor_of(target)
            if own is not None and to is not None and to > own:
                bad.append(f"{path.relative_to(root)}:{line} imports {target} (floor {to} above its own {own})")
    return bad


def test_every_package_has_a_floor():
    packages = {p.name for p in (ROOT / "dormouse").iterdir() if (p / "__init__.py").exists()} | {"cli"}
    assert packages == set(FLOORS), f"packages without a floor or floors without a package: {packages ^ set(FLOORS)}"


def test_no_import_reaches_a_higher_floor():
    assert crossings(ROOT) == []


def test_the_check_fails_on_an_upward_import(tmp_path):
    (tmp_path / "dormouse" / "core").mkdir(parents=True)
    (tmp_path / "dormouse" / "core" / "x.py").write_text("def f():\n    from dormouse.planner import plan\n")
    assert crossings(tmp_path) == ["dormouse/core/x.py:2 imports dormouse.planner (floor 5 above its own 1)"]


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
