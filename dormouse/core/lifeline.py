"""A dormouse process started by Snakemake dies with that Snakemake.

`kill -9` of Snakemake (or a lost login shell) leaves its jobs running: bash, `dormouse gpu-run` and the stage
are re-parented to init and keep writing. A rerun after `snakemake --unlock` then races the orphan for the same
artifact. So every `dormouse` command (dormouse/cli.py) looks up the nearest ancestor process that is a
Snakemake and, if there is one, watches it from a daemon thread (a pidfd where the kernel has them, else its
start time in /proc): when it is gone the command stops itself with SIGTERM, then SIGKILL. Under SLURM the
ancestor is the Snakemake job step inside the allocation, so a cancelled job ends its stage too. `gpu-run`
also gives its child a parent-death signal (PR_SET_PDEATHSIG), so the stage ends with gpu-run whatever the
cause. Without a Snakemake ancestor (a stage run by hand, the tests) nothing is watched.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0
KILL_AFTER_S = 10.0  # from SIGTERM to SIGKILL, for a stage that handles SIGTERM slowly


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return int(fields[1]), int(fields[19])


def _is_snakemake(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:4]
    except OSError:
        return False
    names = [os.path.basename(a.decode(errors="replace")) for a in argv]
    return "snakemake" in names[:2] or any(a == "-m" and b == "snakemake" for a, b in zip(names, names[1:], strict=False))


def snakemake_ancestor(pid: int | None = None) -> tuple[int, int] | None:
    """(pid, start time) of the nearest ancestor that is a Snakemake process, or None."""
    st = _stat(os.getpid() if pid is None else pid)
    while st is not None and st[0] > 1:
        parent = st[0]
        st = _stat(parent)
        if st is not None and _is_snakemake(parent):
            return parent, st[1]
    return None


def _gone(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is None or st[1] != start


def _stop(reason: str) -> None:
    print(f"[dormouse] {reason}: stopping (pid {os.getpid()})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(KILL_AFTER_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(pid: int, start: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None and _gone(pid, start):  # it died (and the pid was reused) before the fd was opened
        os.close(fd)
        fd = None
        _stop(f"Snakemake (pid {pid}) is gone")
    while True:
        if fd is not None:
            select.select([fd], [], [])  # readable when the process exits
        else:
            time.sleep(POLL_S)
        if fd is not None or _gone(pid, start):
            _stop(f"Snakemake (pid {pid}) that started this job is gone")
            return


def tie_to_snakemake() -> int | None:
    """Watch the Snakemake ancestor, if any; returns its pid. Off with DORMOUSE_NO_LIFELINE=1."""
    if os.environ.get("DORMOUSE_NO_LIFELINE") or not Path("/proc/self/stat").exists():
        return None
    found = snakemake_ancestor()
    if found is None:
        return None
    threading.Thread(target=_watch, args=found, name="dormouse-lifeline", daemon=True).start()
    return found[0]


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """preexec_fn for a child that must not outlive its parent (Linux; a no-op elsewhere)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass
