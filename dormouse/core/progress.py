"""What a person watching a run sees: one progress line per interval, while the full record goes to the log.

A rule runs a stage as `dormouse <stage> --job @f --terminal-progress 2>&1 > log`: stdout is the log, and
stderr is the stream Snakemake (or SLURM's job output) shows. With --terminal-progress the stage keeps that
stream for progress lines only and points its own stderr at the log, so warnings and tracebacks are kept
there with everything else. Run by hand without the flag, progress goes to stderr: a tqdm bar on a terminal,
lines otherwise (tqdm's carriage returns would be noise in a file).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

_terminal: TextIO | None = None  # set by to_terminal(); None: progress goes to sys.stderr


def to_terminal() -> None:
    """Keep the current stderr for progress lines; send fd 2 (warnings, tracebacks, C libraries) to stdout."""
    global _terminal
    sys.stdout.flush()
    sys.stderr.flush()
    _terminal = os.fdopen(os.dup(2), "w", buffering=1)
    os.dup2(1, 2)


def _main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"  # torchrun: one rank speaks


def _stream() -> TextIO:
    return _terminal or sys.stderr


def note(line: str) -> None:
    """A line for the log and for the person watching (a stage's milestones: a rung scored, a model exported)."""
    print(line, flush=True)
    if _terminal is not None and _main_rank():
        _terminal.write(line + "\n")


def clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def rate(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.1f}"


class Meter:
    """Progress of one loop toward `total` (None: unknown) units. `update(done, **fields)` writes
    '[stage] label: what done/total  key value ...  rate  elapsed h:mm:ss  eta h:mm:ss' when `every_s` has
    passed since the last line (0: every call) or the loop is done. `start`: units already done before this
    process (a resumed run), left out of the rate."""

    def __init__(self, stage: str, what: str, total: int | None = None, start: int = 0, every_s: float = 0.0,
                 label: str = ""):
        self.what, self.total, self.start, self.every_s = what, total, start, every_s
        self.prefix = f"[{stage}] {label}: " if label else f"[{stage}] "
        self.t0 = self.t_last = time.monotonic()
        self.last_done: int | None = None

    def update(self, done: int, **fields) -> str | None:
        now = time.monotonic()
        finished = self.total is not None and done >= self.total
        if not finished and now - self.t_last < self.every_s:
            return None
        self.t_last, self.last_done = now, done
        elapsed = now - self.t0
        per_s = (done - self.start) / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.prefix}{self.what} {done:,}" + (f"/{self.total:,}" if self.total is not None else "")]
        parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items() if v is not None]
        parts.append(f"{rate(per_s)} {self.what}/s")
        parts.append(f"elapsed {clock(elapsed)}")
        if self.total is not None and per_s > 0:
            parts.append(f"eta {clock((self.total - done) / per_s)}")
        line = "  ".join(parts)
        if _main_rank():
            _stream().write(line + "\n")
            _stream().flush()
        return line


def track(items: Iterable, stage: str, what: str, total: int | None = None, every_s: float = 30.0,
          label: str = "") -> Iterator:
    """Iterate `items` with progress: a tqdm bar when run by hand on a terminal, else a Meter line every
    `every_s` seconds and one at the end."""
    if _terminal is None and sys.stderr.isatty():
        from tqdm import tqdm

        desc = f"[{stage}] {label}".rstrip()
        yield from tqdm(items, total=total, unit=what, desc=desc, mininterval=1, file=sys.stderr)
        return
    meter = Meter(stage, what, total, every_s=every_s, label=label)
    done = 0
    for done, item in enumerate(items, 1):
        yield item
        meter.update(done)
    if meter.last_done != done:
        meter.every_s = 0.0
        meter.update(done)
