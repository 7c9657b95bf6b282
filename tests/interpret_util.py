"""Scripts run under Triton's interpreter, for the tests that check our GPU paths' kernels on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(script: str, timeout: int = 300) -> dict:
    """`script` in a fresh Python from the repo root under TRITON_INTERPRET=1 (read when FLA decorates its kernels,
    so never in this process); returns the JSON object its last line prints, or fails with its stderr."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
