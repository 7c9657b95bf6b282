"""Which enabled model arms left no trace in a run's counters (torch-free: the verdict reads it too)."""

from __future__ import annotations


def inert_arms(model: dict, counters: dict, prefix: str = "") -> list[str]:
    """Problems for a model config (ModelConfig fields) and counters (keys under `prefix`)."""
    def total(start: str) -> int:
        return sum(v for k, v in counters.items() if k.startswith(prefix + start))

    problems = []
    if not total("kda_path."):
        problems.append("no KDA call counted")
    if model.get("engram") and not total("engram.rows_read"):
        problems.append("engram enabled but no rows read")
    if model.get("moe") and not total("moe.tokens."):
        problems.append("moe enabled but no tokens routed")
    if not total("loop.iterations"):
        problems.append("no loop iterations counted")
    return problems
