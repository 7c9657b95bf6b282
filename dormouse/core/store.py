"""The artifact store: content digests, atomic artifact directories, manifests, verified reads.

An artifact is `results/store/<stage>/<digest>/` holding the stage's files and `manifest.json`.
The digest is computed from what can change the output (stage, format version, params, input
digests, matched retraction ids) — never from source code: a refactor must not rebuild a model;
a bug fix that changes results is declared as a retraction instead.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dormouse.core.provenance import code_version, environment

MANIFEST = "manifest.json"
# A hard link to manifest.json (same inode, same mtime) that Snakemake does not know about: Snakemake deletes a
# job's declared output (manifest.json) before rerunning the job and after a failed one, and this keeps the
# record of a finished artifact through both (`published`, below, puts manifest.json back).
MANIFEST_KEEP = ".manifest.json"
DIGEST_CHARS = 20  # 80 bits of sha256: collision-free for any store a lab will ever hold


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, or does not match its manifest."""


def canonical_json(obj: Any) -> str:
    """The one serialisation that digests are computed over (sorted keys, no whitespace)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def pins_digest(*parts: Any) -> str:
    """Digest of a pinned builder's recipe (sources, selection rules, output constants): dataclasses become
    their fields and functions their qualified names, so only what the recipe says is hashed, not its code."""
    def plain(obj):
        if dataclasses.is_dataclass(obj):
            return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, (list, tuple)):
            return [plain(x) for x in obj]
        if isinstance(obj, dict):
            return {str(k): plain(v) for k, v in obj.items()}
        return obj.__qualname__ if callable(obj) else obj
    return hashlib.sha256(canonical_json(plain(list(parts))).encode()).hexdigest()[:20]


def artifact_digest(
    stage: str, format_version: int, params: dict, inputs: dict[str, str], retractions: list[str]
) -> str:
    payload = {
        "stage": stage,
        "format_version": format_version,
        "params": params,
        "inputs": dict(sorted(inputs.items())),
        "retractions": sorted(retractions),
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:DIGEST_CHARS]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_problem(path: Path, meta: dict, hash_it: bool = True) -> str | None:
    """What is wrong with one listed file against its manifest entry ({"size", "sha256"}), None when nothing:
    the one check behind a consumer's reads (Artifact.file), its size pass (Artifact.check_sizes) and `dormouse
    verify`. hash_it=False stops at the size (a stat, no read)."""
    if not path.is_file():
        return "listed in the manifest, missing on disk"
    size = path.stat().st_size
    if size != meta["size"]:
        return f"altered (size {size} != manifest {meta['size']})"
    if hash_it and (actual := sha256_file(path)) != meta["sha256"]:
        return f"altered (sha256 {actual} != manifest {meta['sha256']})"
    return None


@dataclass
class ArtifactWriter:
    """Builds an artifact in a temporary sibling directory and renames it into place on success.

    A killed job leaves only `.<digest>.tmp-<pid>` (never a manifest), so nothing looks finished. One writer of a
    digest at a time, whoever runs it (two clones sharing a store hold two Snakemake locks, and a stage run by hand
    holds none): `.<digest>.lock` beside the artifact is flock'ed for the whole build, a second writer waits for it
    (counted `store.waited_for_writer`), and only then are the temp directories of dead writers removed. flock
    works across hosts on NFSv4 and on Lustre mounted with `flock`; the kernel drops a killed writer's lock.
    """

    out_dir: Path
    stage: str
    format_version: int
    params: dict
    inputs: dict[str, str]
    retractions: list[str]
    counters: Counter = field(default_factory=Counter)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.out_dir = Path(self.out_dir)
        expected = artifact_digest(self.stage, self.format_version, self.params, self.inputs, self.retractions)
        if self.out_dir.name != expected:
            raise ArtifactError(
                f"{self.out_dir}: directory name is not the digest of this stage's params and inputs "
                f"(expected {expected}); the plan and the stage disagree about what is being built"
            )
        self.digest = expected
        self.tmp = self.out_dir.parent / f".{self.digest}.tmp-{os.getpid()}"
        self._t0 = time.time()

    def __enter__(self) -> "ArtifactWriter":
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.out_dir.parent / f".{self.digest}.lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[store] {self.out_dir.name}: another writer is building this digest; waiting for it", flush=True)
            self.counters["store.waited_for_writer"] += 1
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        # Leftovers of killed runs of this same job (any pid, any host): with the lock held no live writer owns
        # one, so they are garbage; counted so a manifest shows the recovery.
        for stale in self.out_dir.parent.glob(f".{self.digest}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
            self.counters["store.stale_tmp_dirs_removed"] += 1
        self.tmp.mkdir(parents=True)
        return self

    @property
    def scratch(self) -> Path:
        """Resumable scratch space keyed by the digest, outside the declared output (Snakemake
        deletes outputs before a rerun; this survives). Kept on failure, removed on success."""
        path = scratch_dir(self.out_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def path(self, name: str) -> Path:
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def __exit__(self, exc_type, exc, tb):
        try:
            return self._finish(exc_type)
        finally:
            self._lock.close()  # releases the flock: the next writer of this digest goes on

    def _finish(self, exc_type) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        files = {}
        for p in sorted(self.tmp.rglob("*")):
            if p.is_file():
                rel = p.relative_to(self.tmp).as_posix()
                files[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
        manifest = {
            "stage": self.stage,
            "format_version": self.format_version,
            "digest": self.digest,
            "params": self.params,
            "inputs": self.inputs,
            "retractions": sorted(self.retractions),
            "files": files,
            "code": code_version(self.stage),
            "environment": environment(),
            "wall_time_s": round(time.time() - self._t0, 3),
            "created_unix": int(time.time()),
            "counters": dict(sorted(self.counters.items())),
            **self.extra,
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        _link_or_copy(self.tmp / MANIFEST, self.tmp / MANIFEST_KEEP)
        if _move_into_place(self.tmp, self.out_dir):
            self.counters["store.already_published"] += 1  # not in the manifest: that one was written by the other writer
            print(f"[store] {self.out_dir}: already published by another writer, with the same digest and verified files; "
                  f"left as it was", flush=True)
        shutil.rmtree(scratch_dir(self.out_dir), ignore_errors=True)
        return False


def scratch_dir(out_dir: Path) -> Path:
    """<store>/../scratch/<stage>/<digest> for the artifact <store>/<stage>/<digest>."""
    out_dir = Path(out_dir)
    return out_dir.parent.parent.parent / "scratch" / out_dir.parent.name / out_dir.name


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links: a copy with the same mtime
        shutil.copy2(src, dst)


def published(out_dir: Path) -> Artifact | None:
    """The finished artifact at out_dir, or None when there is none. A finished one (its manifest.json, or the
    copy MANIFEST_KEEP that survives Snakemake deleting manifest.json) must match its directory and every file
    its manifest lists, else ArtifactError: an altered artifact is never silently rebuilt over. When only the copy
    is left, manifest.json is linked back to it (the same inode: its mtime is the original one)."""
    out_dir = Path(out_dir)
    manifest, keep = out_dir / MANIFEST, out_dir / MANIFEST_KEEP
    if not manifest.exists() and not keep.exists():
        return None
    source = manifest if manifest.exists() else keep
    art = Artifact(out_dir, json.loads(source.read_text()))
    if art.manifest.get("digest") != out_dir.name:
        raise ArtifactError(f"{source}: digest {art.manifest.get('digest')!r} does not match its directory")
    try:
        art.verify_all()
    except ArtifactError as e:
        raise ArtifactError(
            f"{out_dir} is a finished artifact whose files no longer match its manifest ({e}); it is left as it is. "
            f"`dormouse verify` lists every altered file; to rebuild it, move the directory out of the store"
        ) from None
    if not manifest.exists():
        _link_or_copy(keep, manifest)
    elif not keep.exists():  # an artifact written before the copy existed
        _link_or_copy(manifest, keep)
    return art


def _move_into_place(tmp: Path, out_dir: Path) -> bool:
    """Rename tmp to out_dir; True when out_dir was already published with this digest and verified files
    (another writer got there first: e.g. an orphaned job of a killed Snakemake): tmp is dropped, out_dir kept."""
    if (out_dir / MANIFEST).exists() or (out_dir / MANIFEST_KEEP).exists():
        shutil.rmtree(tmp, ignore_errors=True)
        published(out_dir)  # raises when that artifact does not verify; never overwritten either way
        return True
    if out_dir.exists():
        # Snakemake creates the output's parent directory before the job runs; an empty one (or one
        # holding leftovers of a killed job, which never has a manifest) is replaced.
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return False


@dataclass
class Artifact:
    """A finished artifact. A stage's input is checked for every listed file's presence and size before the stage
    reads it (`check_sizes()`, by stage.input_artifact), and each file's sha256 the first time the stage asks for it
    (`file()`), so a stage hashes exactly what it reads."""

    path: Path
    manifest: dict
    verified: set = field(default_factory=set)

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def stage(self) -> str:
        return self.manifest["stage"]

    def file(self, name: str) -> Path:
        if name not in self.manifest["files"]:
            raise ArtifactError(f"{self.path}: manifest lists no file {name!r}")
        p = self.path / name
        if name not in self.verified:
            if problem := file_problem(p, self.manifest["files"][name]):
                raise ArtifactError(f"{p}: {problem}")
            self.verified.add(name)
        return p

    def check_sizes(self) -> "Artifact":
        """Every listed file is on disk at its listed size (a stat each, no reading): what a stage checks of an input
        before it reads any of it, so a file it never opens (a shard's .idx.npy under pretrain) cannot be missing
        or cut short unnoticed. Hashing every file instead would re-read a trunk's kept checkpoints (GBs each) to
        use one; the files a stage reads are hashed by file()."""
        bad = [(name, problem) for name, meta in sorted(self.manifest["files"].items())
               if (problem := file_problem(self.path / name, meta, hash_it=False))]
        if bad:
            name, problem = bad[0]
            more = f" (and {len(bad) - 1} more listed file(s); `dormouse verify` lists them)" if len(bad) > 1 else ""
            raise ArtifactError(f"{self.path / name}: {problem}, in the {self.stage} artifact {self.path}{more}")
        return self

    def files(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.manifest["files"] if n.startswith(prefix))

    def verify_all(self) -> "Artifact":
        for name in self.manifest["files"]:
            self.file(name)
        return self


def open_artifact(path: str | Path, stage: str | None = None, verify: bool = False) -> Artifact:
    """Load an artifact's manifest; files are verified when read (or all now, with verify=True)."""
    path = Path(path)
    if path.name == MANIFEST:
        path = path.parent
    mpath = path / MANIFEST
    if not mpath.exists():
        raise ArtifactError(f"{path}: no {MANIFEST}; the artifact is missing or was never finished")
    manifest = json.loads(mpath.read_text())
    if stage is not None and manifest.get("stage") != stage:
        raise ArtifactError(f"{path}: expected a {stage!r} artifact, manifest says {manifest.get('stage')!r}")
    if manifest.get("digest") != path.name:
        raise ArtifactError(f"{path}: manifest digest {manifest.get('digest')!r} does not match its directory")
    art = Artifact(path, manifest)
    return art.verify_all() if verify else art
