"""Every preset's and experiment's stage digests, pinned: a refactor that changes none of them rebuilds nothing.

A digest covers a stage's params slice, format version, input digests and retractions, so an unintended
change to any of those (a moved default, a renamed key, a params slice that lost a field) shows here.
An intended change updates the pins in its own commit, saying why:

    DORMOUSE_PIN_DIGESTS=1 .venv/bin/python -m pytest -q tests/test_digests_pinned.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dormouse.core.config import load_yaml
from dormouse.planner.plan import build_plan

ROOT = Path(__file__).resolve().parents[1]
PINS = Path(__file__).with_name("data") / "pinned_digests.json"


def current_digests() -> dict:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        plan = build_plan(load_yaml(ROOT / "config" / "config.yaml"))
    finally:
        os.chdir(cwd)
    return {name: dict(stages) for name, stages in sorted(plan.chain.items())}


def test_digests_pinned():
    now = current_digests()
    if os.environ.get("DORMOUSE_PIN_DIGESTS") == "1":
        PINS.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(PINS.read_text())
    changed = [f"{name}/{stage}: {pinned[name].get(stage)} -> {digest}"
               for name, stages in now.items() if name in pinned
               for stage, digest in stages.items() if pinned[name].get(stage) != digest]
    assert not changed, "stage digests moved (an unintended change rebuilds these):\n" + "\n".join(changed)
    assert sorted(now) == sorted(pinned), f"planned chains differ: now {sorted(now)}, pinned {sorted(pinned)}"
