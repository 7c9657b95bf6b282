"""Raw inputs: files outside the store (the corpus, the quality example sets, a quality model, bench tasks).
Listed by spec (a file, a directory read recursively, or a glob) and fingerprinted by path, size and mtime,
or, for the demo corpus, by its recipe. The plan digests them; the filter and bench stages read them."""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

from dormouse.engine.config import ConfigError
from dormouse.engine.store import canonical_json

RAW_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt")
DEMO_ROOT = Path("corpus/demo")
DEMO_BUILT = DEMO_ROOT / "BUILD.json"  # written last by the demo-corpus rule



def is_raw_file(path: str | Path) -> bool:
    return str(path).endswith(RAW_SUFFIXES)


def expand_raw(spec: str, root: Path = Path(".")) -> list[Path]:
    """The raw files a spec names: a file, a directory (recursive), or a glob; sorted."""
    p = Path(spec) if os.path.isabs(spec) else root / spec
    if p.is_file():
        return [p]
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file() and is_raw_file(f)]
    else:
        files = [Path(f) for f in glob.glob(str(p), recursive=True) if os.path.isfile(f) and is_raw_file(f)]
    return sorted(files)


def ignored_files(spec: str, root: Path = Path(".")) -> list[Path]:
    """Regular files a directory or glob spec matches that are not raw text (no reader for their
    suffix); dotfiles aside. The filter counts and lists them: nothing is left out silently."""
    p = Path(spec) if os.path.isabs(spec) else root / spec
    if p.is_file():
        return []
    found = p.rglob("*") if p.is_dir() else (Path(f) for f in glob.glob(str(p), recursive=True))
    return sorted(f for f in found if f.is_file() and not is_raw_file(f) and not f.name.startswith("."))


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
            listing.append([str(f), st.st_size, st.st_mtime_ns])
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
