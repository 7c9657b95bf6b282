"""A compile cache that travels with a run: torch.compiler's cache artifacts (inductor's compiled graphs,
AOTAutograd's, their Triton kernels) in one file, loaded before the first compile and written once this process
has compiled something new. A fresh node or a restarted SLURM job then starts from cache hits: b1's first optimizer
step on the H200 came 140 s after the start with inductor's cache cold, ~16 s with it warm on the same machine
(benchmarks/records/2026-12-05-b1-scale-h200); inductor's own cache lives under /tmp by default, which a cluster
node does not keep.

    DORMOUSE_COMPILE_CACHE=/shared/project/.compile_cache snakemake ...   # unset: off

The files are <dir>/<torch>-<triton>-<device>/<sha256>.bin, one per save holding the artifacts made (compiled, or
read from inductor's local cache) since the previous save; artifacts for other graphs are simply not hit, so every
preset and stage shares one folder per software and device. Not digested: it changes how long a compile takes, not
what it computes. A file that does not load, or a save that fails (a full or read-only disk), is skipped and counted
(compile_cache.load_failed / save_failed), never fatal: the run is worth more than its cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

import torch

ENV = "DORMOUSE_COMPILE_CACHE"


def cache_dir(device: torch.device) -> Path | None:
    root = os.environ.get(ENV)
    if not root:
        return None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Path(root) / re.sub(r"[^A-Za-z0-9.+_-]+", "_", f"torch{torch.__version__}-triton{triton_version}-{name}")


def load(device: torch.device, counters: Counter, say=print) -> None:
    """Load every file's artifacts into this process's compile caches (before anything compiles)."""
    folder = cache_dir(device)
    files = sorted(folder.glob("*.bin")) if folder is not None and folder.is_dir() else []
    if folder is not None and not files:
        counters["compile_cache.absent"] += 1
    for path in files:
        try:
            info = torch.compiler.load_cache_artifacts(path.read_bytes())
        except Exception as e:  # noqa: BLE001 - a stale or corrupt cache costs a compile, never the run
            info, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "torch refused it (its warning above says why)"
        if info is None:
            counters["compile_cache.load_failed"] += 1
            say(f"[compile_cache] {path}: not loaded ({why}); its graphs compile from scratch", flush=True)
            continue
        counters["compile_cache.files_loaded"] += 1
        counters["compile_cache.loaded_artifacts"] += sum(len(v) for v in info.artifacts.values())
    if counters["compile_cache.files_loaded"]:
        say(f"[compile_cache] loaded {counters['compile_cache.files_loaded']} files from {folder}", flush=True)


def compiled_here() -> int:
    """Graphs this process compiled itself (inductor's FX-graph cache misses), not taken from a cache."""
    from torch._dynamo.utils import counters as dynamo_counters

    return dynamo_counters["inductor"]["fxgraph_cache_miss"]


def save(device: torch.device, counters: Counter, say=print) -> None:
    """Write the artifacts made since this process's last save: when it compiled something new, or on its first save
    when it loaded nothing (its graphs then came from inductor's local cache, which the folder does not hold yet)."""
    folder = cache_dir(device)
    missed = compiled_here()
    first_fill = not counters["compile_cache.files_loaded"] and not counters["compile_cache.saved_files"]
    if folder is None or (missed <= counters["compile_cache.compiled_graphs_saved"] and not first_fill):
        return
    try:
        art = torch.compiler.save_cache_artifacts()
        if not art:
            return
        # torch's serializer keeps every earlier save's bytes and its loader keeps one group per kind of artifact
        # (torch 2.13: a dict of the groups), so a file holding two saves loads only the second: start afresh
        CacheArtifactManager = getattr(torch.compiler._cache, "CacheArtifactManager", None)
        if CacheArtifactManager is not None and hasattr(CacheArtifactManager, "_serializer"):
            CacheArtifactManager._serializer.clear()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{hashlib.sha256(art[0]).hexdigest()[:20]}.bin"
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")  # unique across nodes sharing the folder
        with os.fdopen(fd, "wb") as f:
            f.write(art[0])
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs the next start a compile, not this run
        counters["compile_cache.save_failed"] += 1
        say(f"[compile_cache] {folder}: not saved ({type(e).__name__}: {e}); the run goes on", flush=True)
        return
    counters["compile_cache.compiled_graphs_saved"] = missed
    counters["compile_cache.saved_files"] += 1
    counters["compile_cache.saved_bytes"] += len(art[0])
    say(f"[compile_cache] saved {path} ({len(art[0]):,} bytes; {missed} graphs compiled here so far)", flush=True)
