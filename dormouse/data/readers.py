"""Raw corpus readers: jsonl, jsonl.gz, jsonl.zst, parquet (nested struct columns, row-batch streamed), txt.

Every record that comes out is either a document or a counted skip with its reason and raw size, so
the filter can prove read = kept + dropped. Bad input raises `ReadError` naming the file and the
line/row, unless the config's policy (`on_bad_record` / `on_bad_file`: skip) says to count and skip.
Nothing is ever invented: a file we cannot read yields no bytes, never filler.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import zstandard

from dormouse.data.raw import RAW_SUFFIXES, expand_raw, ignored_files, scan_raw
from dormouse.core.config import InputError
from dormouse.core.store import sha256_file


class ReadError(InputError):
    """Unreadable input; the message names the file and the line or row. A stream that breaks part-way says what
    it lost: `lost_decoded`, text bytes decoded after the last whole record; `lost_beyond`, the bytes the break
    cut off (from the zstd frame header's content size), or None when the format cannot tell (gzip, a zstd
    frame written without its size)."""

    lost_decoded: int = 0
    lost_beyond: int | None = None


@dataclass
class Record:
    id: str
    text: str  # "" when skipped
    source: str  # file path relative to the corpus root
    nbytes: int  # UTF-8 bytes of the text, or raw bytes of a skipped record
    skip: str | None = None  # reason, when the record was skipped by policy


@dataclass
class ReaderConfig:
    text_field: str = "text"
    id_field: str = "id"
    parquet_text_column: str = "text"
    parquet_id_column: str = "id"
    batch_rows: int = 1024
    on_bad_record: str = "error"
    on_bad_file: str = "error"


class _ZstdRaw(io.RawIOBase):
    """Streams a (multi-frame) .zst file and raises on a truncated last frame.

    Written by hand because zstandard's stream_reader returns a short read, not an error, on truncation.
    """

    def __init__(self, f, path):
        self._f, self._path = f, path
        self._d = zstandard.ZstdDecompressor().decompressobj()
        self._fed = False  # has the current frame's decompressor seen input?
        self._buf = b""
        self.produced = 0  # decompressed bytes so far
        self._frame_head = b""  # the current frame's first bytes (its header: content size, when written)
        self._frame_produced = 0

    def readable(self):
        return True

    def readinto(self, b):
        while not self._buf:
            chunk = self._f.read(1 << 20)
            if not chunk:
                if self._fed and not self._d.eof:
                    err = ReadError(f"{self._path}: truncated zstd stream (the last frame has no end)")
                    err.lost_beyond = self._frame_missing()
                    raise err
                return 0
            while chunk:
                if not self._fed:
                    self._frame_head, self._frame_produced = b"", 0
                self._fed = True
                self._frame_head = (self._frame_head + chunk)[:32]
                try:
                    out = self._d.decompress(chunk)
                except zstandard.ZstdError as e:
                    raise ReadError(f"{self._path}: corrupt zstd data: {e}") from None
                self._buf += out
                self.produced += len(out)
                self._frame_produced += len(out)
                if self._d.eof:
                    chunk = self._d.unused_data
                    self._d = zstandard.ZstdDecompressor().decompressobj()
                    self._fed = False
                else:
                    chunk = b""
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _zstd_frame_missing(self) -> int | None:
    """Bytes of the broken frame that never arrived, from its header's content size; None if it has none."""
    try:
        size = zstandard.get_frame_parameters(self._frame_head).content_size
    except zstandard.ZstdError:
        return None
    if size in (0, zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        return None
    return max(0, size - self._frame_produced)


_ZstdRaw._frame_missing = _zstd_frame_missing


def _open_lines(path: Path):
    raw = open(path, "rb")
    name = path.name
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdRaw(raw, path), buffer_size=1 << 20)
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return raw


class RecordError(ReadError):
    """A bad record under on_bad_record: error. It stops the run whatever on_bad_file says (caught as a file error,
    it once dropped the rest of the file's good records under on_bad_file: skip)."""


def _bad(policy: str, reason: str, message: str, counters: Counter, prefix: str) -> None:
    if policy == "error":
        record = prefix == "reader.records_skipped"
        key = "on_bad_record" if record else "on_bad_file"
        raise (RecordError if record else ReadError)(
            f"{message} (data.reader.{key}: skip counts and skips such {'records' if record else 'files'}, e.g. "
            f"snakemake ... --config set=data.reader.{key}=skip)")
    counters[f"{prefix}.{reason}"] += 1


def _read_jsonl(path: Path, rel: str, cfg: ReaderConfig, counters: Counter) -> Iterator[Record]:
    lineno = 0
    with _open_lines(path) as f:
        try:
            for lineno, line in enumerate(_lines(f, path), 1):
                if not line.strip():
                    counters["reader.blank_lines"] += 1
                    continue
                try:
                    obj = json.loads(line)
                except UnicodeDecodeError as e:
                    _bad(cfg.on_bad_record, "invalid_utf8", f"{path}:{lineno}: not UTF-8: {e}", counters, "reader.records_skipped")
                    yield Record(f"{rel}:{lineno}", "", rel, len(line), "bad_record_invalid_utf8")
                    continue
                except json.JSONDecodeError as e:
                    _bad(cfg.on_bad_record, "invalid_json", f"{path}:{lineno}: invalid JSON: {e}", counters, "reader.records_skipped")
                    yield Record(f"{rel}:{lineno}", "", rel, len(line), "bad_record_invalid_json")
                    continue
                text = obj.get(cfg.text_field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    _bad(cfg.on_bad_record, "no_text_field",
                         f"{path}:{lineno}: no string field {cfg.text_field!r} (keys: {sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__})",
                         counters, "reader.records_skipped")
                    yield Record(f"{rel}:{lineno}", "", rel, len(line), "bad_record_no_text_field")
                    continue
                doc_id = obj.get(cfg.id_field)
                if doc_id is None:
                    counters["reader.ids_derived"] += 1
                    doc_id = f"{rel}:{lineno}"
                try:
                    str(doc_id).encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate from a JSON escape: the shard writer cannot store it
                    _bad(cfg.on_bad_record, "invalid_utf8", f"{path}:{lineno}: id {cfg.id_field!r} is not valid Unicode: {e}",
                         counters, "reader.records_skipped")
                    yield Record(f"{rel}:{lineno}", "", rel, len(line), "bad_record_invalid_utf8")
                    continue
                yield from _text_record(str(doc_id), text, rel, f"{path}:{lineno}", cfg, counters, len(line))
        except (EOFError, OSError, zlib.error) as e:  # gzip: truncated or corrupt stream
            raise ReadError(f"{path}: unreadable after line {lineno} (the record at line {lineno + 1} is cut off; "
                            f"how much text followed is unknown): {e}") from None


def _lines(f, path: Path):
    """The lines of f; a ReadError mid-stream names the record it broke in and what was lost."""
    it = iter(f)
    lineno = consumed = 0  # the whole lines handed out so far, and their decompressed bytes
    while True:
        try:
            line = next(it)
        except StopIteration:
            return
        except ReadError as e:
            raw = getattr(f, "raw", None)
            decoded = getattr(raw, "produced", consumed)
            err = ReadError(f"{path}: record at line {lineno + 1} (decompressed byte {consumed}) is cut off: {e}")
            err.lost_decoded, err.lost_beyond = max(0, decoded - consumed), e.lost_beyond
            raise err from None
        lineno, consumed = lineno + 1, consumed + len(line)
        yield line


def _text_record(doc_id, text, rel, where, cfg, counters, raw_len) -> Iterator[Record]:
    try:
        n = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates from JSON escapes
        _bad(cfg.on_bad_record, "invalid_utf8", f"{where}: text is not valid Unicode: {e}", counters, "reader.records_skipped")
        yield Record(doc_id, "", rel, raw_len, "bad_record_invalid_utf8")
        return
    yield Record(doc_id, text, rel, n)


def _read_txt(path: Path, rel: str, cfg: ReaderConfig, counters: Counter) -> Iterator[Record]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        _bad(cfg.on_bad_record, "invalid_utf8", f"{path}: not UTF-8 at byte {e.start}: {e.reason}", counters, "reader.records_skipped")
        yield Record(rel, "", rel, len(data), "bad_record_invalid_utf8")
        return
    yield Record(rel, text, rel, len(data))


def _column(batch: pa.RecordBatch, dotted: str) -> pa.Array:
    head, *rest = dotted.split(".")
    arr = batch.column(head)
    for name in rest:
        arr = pc.struct_field(arr, name)
    return arr


def _has_path(schema: pa.Schema, dotted: str) -> bool:
    head, *rest = dotted.split(".")
    if head not in schema.names:
        return False
    t = schema.field(head).type
    for name in rest:
        if not pa.types.is_struct(t) or t.get_field_index(name) < 0:
            return False
        t = t.field(name).type
    return True


def _leaf_paths(schema: pa.Schema) -> list[str]:
    out = []

    def walk(prefix, t):
        if pa.types.is_struct(t):
            for f in t:
                walk(f"{prefix}.{f.name}", f.type)
        else:
            out.append(f"{prefix} ({t})")

    for f in schema:
        walk(f.name, f.type)
    return out


# Where parquet corpora keep their text by convention (dolma/datatrove's nested document.text, a flat text): when
# data.reader.parquet_text_column names one of them and a file lacks it, the other is read (counted). A path of
# your own is never replaced: a file without it is an error naming its columns.
CONVENTIONAL_TEXT_COLUMNS = ("document.text", "text")


def _read_parquet(path: Path, rel: str, cfg: ReaderConfig, counters: Counter) -> Iterator[Record]:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ReadError(f"{path}: not a readable parquet file: {e}") from None
    schema = pf.schema_arrow
    text_column = cfg.parquet_text_column
    if not _has_path(schema, text_column) and text_column in CONVENTIONAL_TEXT_COLUMNS:
        # a conventional name that this file does not use: the other conventional one, counted per file
        text_column = next((c for c in CONVENTIONAL_TEXT_COLUMNS if _has_path(schema, c)), text_column)
        if text_column != cfg.parquet_text_column:
            counters[f"reader.parquet_text_column_fallback.{text_column}"] += 1
    if not _has_path(schema, text_column):
        # The lesson of the reader that only looked at top-level string columns: say where text could be.
        raise ReadError(
            f"{path}: no column {cfg.parquet_text_column!r}; leaf columns are: {', '.join(_leaf_paths(schema))}. "
            f"Set data.reader.parquet_text_column to the dotted path of the text."
        )
    has_id = _has_path(schema, cfg.parquet_id_column)
    columns = [text_column] + ([cfg.parquet_id_column] if has_id else [])
    row = 0
    for rg in range(pf.num_row_groups):
        texts_in_group = 0
        try:
            batches = pf.iter_batches(batch_size=cfg.batch_rows, row_groups=[rg], columns=columns)
            for batch in batches:
                texts = _column(batch, text_column)
                is_binary = pa.types.is_binary(texts.type) or pa.types.is_large_binary(texts.type)
                ids = _column(batch, cfg.parquet_id_column).to_pylist() if has_id else [None] * len(texts)
                for text, doc_id in zip(texts.to_pylist(), ids, strict=True):
                    where = f"{path}: row group {rg}, row {row}"
                    if doc_id is None:
                        counters["reader.ids_derived"] += 1
                        doc_id = f"{rel}#row{row}"
                    row += 1
                    if text is None:
                        yield Record(str(doc_id), "", rel, 0, "null_text")
                        continue
                    if is_binary:
                        try:
                            text = text.decode("utf-8")
                        except UnicodeDecodeError as e:
                            _bad(cfg.on_bad_record, "invalid_utf8", f"{where}: not UTF-8: {e}", counters, "reader.records_skipped")
                            yield Record(str(doc_id), "", rel, len(text), "bad_record_invalid_utf8")
                            continue
                    elif not isinstance(text, str):
                        raise ReadError(f"{where}: column {text_column!r} holds {texts.type}, not text")
                    texts_in_group += bool(text)
                    yield from _text_record(str(doc_id), text, rel, where, cfg, counters, len(text))
        except (pa.ArrowInvalid, OSError) as e:
            raise ReadError(f"{path}: row group {rg} unreadable: {e}") from None
        if texts_in_group == 0 and pf.metadata.row_group(rg).num_rows > 0:
            _bad(cfg.on_bad_file, "row_group_no_text", f"{path}: row group {rg} yields no text in {text_column!r}",
                 counters, "reader.row_groups_skipped")


def read_file(path: Path, rel: str, cfg: ReaderConfig, counters: Counter) -> Iterator[Record]:
    """Records of one raw file. Whole-file problems follow `on_bad_file`, per-record ones `on_bad_record`."""
    name = path.name
    if path.stat().st_size == 0:
        _bad(cfg.on_bad_file, "empty_file", f"{path}: empty file", counters, "reader.files_skipped")
        return
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        reader = _read_jsonl
    elif name.endswith(".parquet"):
        reader = _read_parquet
    elif name.endswith(".txt"):
        reader = _read_txt
    else:
        raise ReadError(f"{path}: unknown raw format (expected .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .txt)")
    n_text = n_bad = 0
    try:
        for rec in reader(path, rel, cfg, counters):
            n_text += rec.skip is None and bool(rec.text)
            n_bad += (rec.skip or "").startswith("bad_record")
            yield rec
    except ReadError as e:
        if cfg.on_bad_file == "error" or isinstance(e, RecordError):
            raise
        # Records already yielded were read intact and stay counted; the rest of the file is lost, loudly.
        counters["reader.files_skipped.unreadable"] += 1
        counters["reader.file_bytes_skipped.unreadable"] += path.stat().st_size
        # Text lost: what was decoded after the last whole record (its records are not in docs_read), plus what
        # the break cut off when the format records it; else the file is counted as losing an unknown amount.
        counters["reader.text_bytes_lost.unreadable"] += e.lost_decoded + (e.lost_beyond or 0)
        if e.lost_beyond is None:
            counters["reader.files_text_bytes_lost_unknown.unreadable"] += 1
        lost = f"{e.lost_decoded} decoded bytes of a cut record, " + (
            f"{e.lost_beyond} more cut off" if e.lost_beyond is not None else "and an unknown amount cut off")
        print(f"[reader] skipping the rest of {path} by policy on_bad_file=skip ({lost}): {e}")
        return
    if n_text == 0 and n_bad == 0:  # records skipped by policy were already counted
        _bad(cfg.on_bad_file, "no_text", f"{path}: file yields no text", counters, "reader.files_skipped")
    counters["reader.files_read"] += 1



def iter_records(specs: list[str], cfg: ReaderConfig, counters: Counter, files_out: list | None = None,
                 ignored_out: list | None = None) -> Iterator[Record]:
    """Every record of the raw corpus `specs` (data/raw.py's discovery: links followed within the root, each real
    file once); the files read (path, size, sha256) go to `files_out`, those not read, with their reason, to
    `ignored_out`, both counted."""
    for spec in specs:
        base = Path(spec)
        scan = scan_raw(spec)
        counters["corpus_links_followed"] += scan.links_followed
        counters["corpus_duplicate_paths"] += scan.duplicate_paths
        for entry in ignored_files(spec):
            reason = entry["reason"].split(":")[0]
            counters[f"reader.files_ignored.{reason}"] += 1
            if ignored_out is not None:
                ignored_out.append(entry)
            why = (f"no reader for its suffix (expected {', '.join(RAW_SUFFIXES)})" if reason == "unknown_suffix"
                   else f"a link to {entry['resolves_to']}, outside {spec} (link_outside_root; to read it, point the "
                        f"corpus at a directory holding both)" if reason == "link_outside_root"
                   else entry["reason"] + (f" (the same as {entry['same_as']})" if "same_as" in entry else ""))
            print(f"[filter] not reading {entry['path']}: {why}", flush=True)
        for path in expand_raw(spec):
            rel = path.relative_to(base).as_posix() if base.is_dir() else path.as_posix()
            if files_out is not None:
                files_out.append({"path": str(path), "size": path.stat().st_size, "sha256": sha256_file(path)})
            yield from read_file(path, rel, cfg, counters)
