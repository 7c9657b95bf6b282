"""Print the rl arm whose checkpoint scored best on the dev split (rl's model selection, never the
held-out bench items); the first arm named wins a tie. Each arm is a directory of job JSONs
(.job/<arm>/small_rl.json) whose rl artifact is built.

    python3 benchmarks/pick_rl_arm.py va vb    # -> va
"""

import json
import sys
from pathlib import Path


def best_dev(arm: str) -> float:
    out = Path(json.loads(Path(f".job/{arm}/small_rl.json").read_text())["out"])
    sel = json.loads((out / "manifest.json").read_text())["final"]["selection"]
    print(f"{arm}: {out.name} dev curve {sel['curve']} selected step {sel['selected_step']}", file=sys.stderr)
    return max(acc for _, acc in sel["curve"])


if __name__ == "__main__":
    arms = sys.argv[1:]
    scores = {a: best_dev(a) for a in arms}
    print(max(arms, key=lambda a: (scores[a], -arms.index(a))))
