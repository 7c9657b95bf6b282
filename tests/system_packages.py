"""Debian packages a system test needs (slurm-wlm, chromium): found on PATH, or installed with apt-get when the
test runs as root, else the reason they are not there, for the test's skip message."""

from __future__ import annotations

import os
import shutil
import subprocess

SBIN = ("/usr/sbin", "/sbin")


def which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def find_or_install(binaries: tuple[str, ...], packages: tuple[str, ...], timeout_s: int = 600) -> str | None:
    """None when every binary is here (installing `packages` with apt-get when root); else why not."""
    missing = [b for b in binaries if not which(b)]
    if not missing:
        return None
    names = " ".join(packages)
    if os.geteuid() != 0:
        return f"not root, so cannot apt-get install {names} (missing: {' '.join(missing)})"
    if not shutil.which("apt-get"):
        return f"no apt-get to install {names} (missing: {' '.join(missing)})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    for cmd in (install, ["apt-get", "update", "-q"], install):  # the lists may be stale: update once
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode == 0 and cmd is install and all(which(b) for b in binaries):
            return None
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return f"apt-get install {names} failed (rc {proc.returncode}): {' | '.join(tail)}"
