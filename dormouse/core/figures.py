"""A figure on matplotlib's Agg canvas (no display, no pyplot state) and its PNG: what every plot of the project is
drawn on (tools/plots.py's report, the planner's experiment curves, the benchmarks' figures)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 120


def new_figure(width: float, height: float, rows: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]


def save(fig: Figure, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
