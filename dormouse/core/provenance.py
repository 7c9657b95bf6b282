"""What code and which environment made an artifact (recorded in manifests, never digested)."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import dormouse

PACKAGE_ROOT = Path(dormouse.__file__).resolve().parent


def _module_path(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, AttributeError):  # `pkg.module.name` where name is not a module
        return None
    return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None


def _dormouse_imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "dormouse"}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            if base and base.split(".")[0] == "dormouse":
                found.add(base)
                # `from dormouse import store` imports a submodule, not a name.
                found |= {f"{base}.{a.name}" for a in node.names if _module_path(f"{base}.{a.name}")}
    return found


@lru_cache(maxsize=None)
def source_closure(module: str) -> tuple[tuple[str, str], ...]:
    """(relative path, sha256) of `module` and every dormouse module it imports, transitively."""
    seen: dict[str, str] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = _module_path(name)
        if path is None:
            continue
        rel = path.relative_to(PACKAGE_ROOT.parent).as_posix()
        if rel in seen:
            continue
        seen[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        todo.extend(_dormouse_imports(path, name))
    return tuple(sorted(seen.items()))


@lru_cache(maxsize=1)
def git_state() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"git_commit": None, "git_dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def code_version(stage: str) -> dict:
    closure = source_closure(f"dormouse.stages.{stage}")
    digest = hashlib.sha256("".join(f"{p}:{h}\n" for p, h in closure).encode()).hexdigest()
    return {
        "package_version": dormouse.__version__,
        **git_state(),
        "source_digest": digest,
        "source_files": [p for p, _ in closure],
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {d: _version(d) for d in ("numpy", "pyarrow", "fasttext", "zstandard", "torch", "snakemake")},
        "device": "cpu",
    }
    torch = sys.modules.get("torch")  # report the device only if the stage used torch; never import it here
    if torch is not None and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return env
