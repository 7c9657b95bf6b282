"""What a torch benchmark's rows carry and where they go: the versions and device columns, and a TSV that gets
its header once and each row as soon as it is measured."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from benchmarks.bench_env import cpu_model, git_rev


def versions() -> str:
    parts = [f"py {platform.python_version()}", f"torch {torch.__version__}"]
    if torch.version.cuda:
        parts.append(f"cuda {torch.version.cuda}")
    for mod in ("triton", "fla", "transformers"):
        try:
            m = __import__(mod)
            parts.append(f"{mod} {getattr(m, '__version__', '?')}")
        except Exception:  # noqa: BLE001 - absent or broken: say so
            parts.append(f"{mod} -")
    parts.append(f"dormouse {git_rev() or '?'}")
    return " ".join(parts)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
    return f"CPU {cpu_model()} ({torch.get_num_threads()} threads)"


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace("\t", " ").replace("\n", " ")


class TsvWriter:
    """Rows appended to `path` under `columns`; a file with other columns is left alone and the rows go to
    <stem>.v2<suffix> beside it."""

    def __init__(self, path: Path, columns: list[str]):
        self.columns = columns
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > 0:
            head = path.read_text(encoding="utf-8").split("\n", 1)[0].split("\t")
            if head != columns:
                alt = path.with_name(path.stem + ".v2" + path.suffix)
                print(f"WARNING: {path} has other columns; writing to {alt}", flush=True)
                path = alt
        self.path = path

    def write(self, row: dict) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a", encoding="utf-8") as f:
            if new:
                f.write("\t".join(self.columns) + "\n")
            f.write("\t".join(fmt(row.get(c)) for c in self.columns) + "\n")
