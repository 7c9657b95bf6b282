"""Raw inputs: files outside the store (the corpus, the quality example sets, a quality model, bench tasks).
Listed by spec (a file, a directory read recursively, or a glob) and fingerprinted by path, size and mtime,
or, for the demo corpus, by its recipe. The plan digests them; the filter and bench stages read them."""

from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dormouse.core.config import ConfigError
from dormouse.core.store import canonical_json

RAW_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt")
DEMO_ROOT = Path("corpus/demo")
DEMO_BUILT = DEMO_ROOT / "BUILD.json"  # written last by the demo-corpus rule
GLOB_MAGIC = re.compile(r"[*?[]")  # what makes a path part a pattern to glob.glob



def is_raw_file(path: str | Path) -> bool:
    return str(path).endswith(RAW_SUFFIXES)


@dataclass
class RawScan:
    """What a spec names on disk. Links are resolved and each real file (device, inode) is read once, under its
    link-free path when it has one, else its first path in sorted order; every other path is in `skipped`. A link
    that resolves outside the spec's root (its directory, or a glob's fixed leading directories) is not followed:
    `ln -s .. corp/up` read the corpus's parent."""

    files: list[Path] = field(default_factory=list)  # every regular file to consider, sorted
    skipped: list[dict] = field(default_factory=list)  # {"path", "reason"[, "same_as" | "resolves_to"]}: each not read
    links_followed: int = 0  # files read through a path that passes a symlink
    duplicate_paths: int = 0  # paths to a file already read (a symlink loop, a second link, a hard link)


def _outside_root(path: Path, root_real: str, scan: RawScan) -> bool:
    """A link whose target is not under the spec's root: listed as skipped (the filter counts and prints it)."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, root_real]) == root_real:
        return False
    scan.skipped.append({"path": str(path), "reason": "link_outside_root", "resolves_to": real})
    return True


def _walk(top: Path, scan: RawScan) -> list[tuple[Path, bool]]:
    """Every regular file under top, following symlinked directories once each, never out of top; (path, via a
    symlink)."""
    found: list[tuple[Path, bool]] = []
    root_real = os.path.realpath(top)
    stack = [(top, False, (root_real,))]
    while stack:
        d, via_link, ancestors = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            scan.skipped.append({"path": str(d), "reason": f"unreadable_directory: {e.strerror}"})
            continue
        for entry in entries:
            path = Path(entry.path)
            link = entry.is_symlink()
            if link and not path.exists():
                scan.skipped.append({"path": str(path), "reason": "broken_symlink"})
            elif link and _outside_root(path, root_real, scan):
                pass
            elif path.is_dir():
                real = os.path.realpath(path)
                if real in ancestors:  # a link back up the tree: following it would read the same files again
                    scan.skipped.append({"path": str(path), "reason": "symlink_loop", "same_as": real})
                else:
                    stack.append((path, via_link or link, ancestors + (real,)))
            elif path.is_file():
                found.append((path, via_link or link))
            else:
                scan.skipped.append({"path": str(path), "reason": "not_a_regular_file"})
    return found


def scan_raw(spec: str, root: Path = Path(".")) -> RawScan:
    """The files a spec names (a file, a directory read recursively through symlinks, or a glob), each once."""
    p = Path(spec) if os.path.isabs(spec) else root / spec
    scan = RawScan()
    if p.is_file():
        found = [(p, p.is_symlink())]
    elif p.is_dir():
        found = _walk(p, scan)
    else:  # glob's ** follows symlinked directories, loops too (until ELOOP): duplicates are removed below
        found = []
        fixed = next((i for i, part in enumerate(p.parts) if GLOB_MAGIC.search(part)), len(p.parts))
        root_real = os.path.realpath(Path(*p.parts[:fixed]) if fixed else ".")
        for f in sorted(glob.glob(str(p), recursive=True)):
            path = Path(f)
            if path.is_symlink() and not path.exists():
                scan.skipped.append({"path": f, "reason": "broken_symlink"})
            elif _outside_root(path, root_real, scan):
                pass
            elif path.is_file():
                found.append((path, os.path.realpath(f) != os.path.abspath(f)))
    by_file: dict[tuple[int, int], list[tuple[Path, bool]]] = {}
    for path, via_link in found:
        st = path.stat()
        by_file.setdefault((st.st_dev, st.st_ino), []).append((path, via_link))
    for paths in by_file.values():
        paths.sort(key=lambda pv: (pv[1], len(pv[0].parts), str(pv[0])))  # link-free first, then the shortest path
        kept, via_link = paths[0]
        scan.files.append(kept)
        scan.links_followed += via_link
        for dup, _ in paths[1:]:
            scan.skipped.append({"path": str(dup), "reason": "duplicate_path", "same_as": str(kept)})
            scan.duplicate_paths += 1
    scan.files.sort()
    scan.skipped.sort(key=lambda s: s["path"])
    return scan


def expand_raw(spec: str, root: Path = Path(".")) -> list[Path]:
    """The raw files a spec names (scan_raw, with a reader for their suffix): each real file once, sorted. A spec
    that names one file is that file whatever its suffix (a fastText model, say)."""
    p = Path(spec) if os.path.isabs(spec) else root / spec
    if p.is_file():
        return [p]
    return [f for f in scan_raw(spec, root).files if is_raw_file(f)]


def ignored_files(spec: str, root: Path = Path(".")) -> list[dict]:
    """Every path a spec matches that is not read, with its reason: no reader for the suffix (`unknown_suffix`;
    dotfiles `hidden_file`), a second path to a file already read (`duplicate_path`), a `symlink_loop`, a
    `broken_symlink`, a link out of the spec's root (`link_outside_root`), a `not_a_regular_file`. The filter counts
    and lists them: nothing is left out silently."""
    scan = scan_raw(spec, root)
    out = list(scan.skipped)
    for f in scan.files:
        if not is_raw_file(f):
            out.append({"path": str(f), "reason": "hidden_file" if f.name.startswith(".") else "unknown_suffix"})
    return sorted(out, key=lambda s: s["path"])


def is_demo(spec: str, root: Path = Path(".")) -> bool:
    p = Path(spec) if os.path.isabs(spec) else root / spec
    try:
        p.resolve().relative_to((root / DEMO_ROOT).resolve())
        return True
    except ValueError:
        return False


def raw_fingerprint(spec: str, root: Path = Path(".")) -> str:
    """Digest of a raw input. The demo corpus is fingerprinted by its recipe (pins, selection rules, output
    constants: it may not be built yet); anything else by its file list, sizes and mtimes (filter records
    full content hashes)."""
    if is_demo(spec, root):
        from dormouse.data import demo_corpus  # stdlib only at import

        payload = {"demo": demo_corpus.fingerprint(), "spec": Path(spec).as_posix()}
    else:
        files = expand_raw(spec, root)
        if not files:
            raise ConfigError(f"raw input {spec!r} matched no files ending in {', '.join(RAW_SUFFIXES)}")
        listing = []
        for f in files:
            st = f.stat()
            # a relative spec's files by their path from the root, whatever the root is spelled as: `dormouse plan` (root
            # absolute, found from the cwd) and Snakemake (root ".") then fingerprint one corpus alike
            name = str(f) if os.path.isabs(spec) else os.path.relpath(f, root)
            listing.append([name, st.st_size, st.st_mtime_ns])
        payload = {"files": listing}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:20]


def raw_input(specs: list[str], root: Path = Path("."), cache: dict | None = None) -> dict:
    """A job input made of raw files: one digest over the fingerprints of its specs, in order."""
    cache = {} if cache is None else cache
    for s in specs:
        if s not in cache:
            cache[s] = raw_fingerprint(s, root)
    digests = [cache[s] for s in specs]
    combined = digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()[:20]
    return {"kind": "raw", "digest": combined, "specs": list(specs)}
