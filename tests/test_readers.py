import gzip
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import write_jsonl_zst, write_nested_parquet

from dormouse.data.readers import ReaderConfig, ReadError, read_file

TEXTS = ["First document.\nWith two lines.", "Second — with UTF-8 ✓", "third"]


def read(path, **cfg):
    counters = Counter()
    recs = list(read_file(path, path.name, ReaderConfig(**cfg), counters))
    return recs, counters


def rows():
    return [{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_variants_read_every_record(tmp_path, suffix):
    data = "".join(json.dumps(r) + "\n" for r in rows()).encode()
    if suffix == ".jsonl.gz":
        data = gzip.compress(data)
    elif suffix == ".jsonl.zst":
        data = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"x{suffix}"
    path.write_bytes(data)
    recs, counters = read(path)
    assert [r.text for r in recs] == TEXTS and [r.id for r in recs] == ["d0", "d1", "d2"]
    assert recs[1].nbytes == len(TEXTS[1].encode())
    assert counters["reader.files_read"] == 1


def test_multi_frame_zstd_is_read_across_frames(tmp_path):
    c = zstandard.ZstdCompressor()
    lines = [json.dumps(r).encode() + b"\n" for r in rows()]
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(b"".join(c.compress(line) for line in lines))
    assert [r.text for r in read(path)[0]] == TEXTS


def test_parquet_nested_struct_column_streamed_by_row_group(tmp_path):
    path = tmp_path / "x.parquet"
    write_nested_parquet(path, rows() * 5, row_group_size=2)
    assert pq.ParquetFile(path).num_row_groups == 8
    recs, _ = read(path, parquet_text_column="document.text")
    assert [r.text for r in recs] == TEXTS * 5


def test_parquet_missing_column_names_the_nested_candidates(tmp_path):
    path = tmp_path / "x.parquet"
    write_nested_parquet(path, rows())
    with pytest.raises(ReadError) as e:
        read(path, parquet_text_column="body")  # a column of the user's own: never replaced
    assert str(path) in str(e.value) and "document.text" in str(e.value)


def test_parquet_conventional_text_columns_stand_in_for_each_other(tmp_path):
    """The presets name document.text (dolma's layout); an ordinary parquet with a top-level text column is read
    through it too, and the other way round, counted per file."""
    flat, nested = tmp_path / "flat.parquet", tmp_path / "nested.parquet"
    pq.write_table(pa.table({"id": [r["id"] for r in rows()], "text": TEXTS}), flat)
    write_nested_parquet(nested, rows())
    recs, c = read(flat, parquet_text_column="document.text")
    assert [r.text for r in recs] == TEXTS and c["reader.parquet_text_column_fallback.text"] == 1
    recs, c = read(nested, parquet_text_column="text")
    assert [r.text for r in recs] == TEXTS and c["reader.parquet_text_column_fallback.document.text"] == 1
    assert not any(k.startswith("reader.parquet_text_column_fallback") for k in read(nested, parquet_text_column="document.text")[1])


def test_parquet_row_group_without_text(tmp_path):
    path = tmp_path / "x.parquet"
    table = pa.table({"id": ["a", "b", "c", "d"], "text": ["real text", "more", None, None]})
    pq.write_table(table, path, row_group_size=2)
    with pytest.raises(ReadError, match="row group 1 yields no text"):
        read(path)
    recs, counters = read(path, on_bad_file="skip")
    assert counters["reader.row_groups_skipped.row_group_no_text"] == 1
    assert [r.skip for r in recs] == [None, None, "null_text", "null_text"]


def test_truncated_zstd_is_an_error_not_a_short_read(tmp_path):
    data = "".join(json.dumps(r) + "\n" for r in rows() * 200).encode()
    comp = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(comp[: len(comp) - 7])
    with pytest.raises(ReadError, match="truncated zstd"):
        read(path)
    recs, counters = read(path, on_bad_file="skip")
    assert counters["reader.files_skipped.unreadable"] == 1
    assert all(r.text for r in recs)  # what was read intact is real; nothing is padded


def test_truncated_zstd_counts_the_text_it_lost_and_names_the_record(tmp_path):
    lines = [json.dumps(r) + "\n" for r in rows() * 200]
    data = "".join(lines).encode()
    comp = zstandard.ZstdCompressor().compress(data)  # the frame header records the content size
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(comp[: len(comp) * 2 // 3])
    with pytest.raises(ReadError, match=r"record at line \d+ \(decompressed byte \d+\) is cut off"):
        read(path)
    recs, counters = read(path, on_bad_file="skip")
    kept = len("".join(lines[: len(recs)]).encode())  # every row is one record here
    assert counters["reader.text_bytes_lost.unreadable"] == len(data) - kept > 0
    assert counters["reader.files_text_bytes_lost_unknown.unreadable"] == 0


def test_truncated_gzip_lost_text_is_named_unknown(tmp_path):
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows() * 500).encode())
    path = tmp_path / "x.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    recs, counters = read(path, on_bad_file="skip")
    assert counters["reader.files_text_bytes_lost_unknown.unreadable"] == 1


def test_truncated_gzip_names_the_file(tmp_path):
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows() * 500).encode())
    path = tmp_path / "x.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReadError, match=r"x\.jsonl\.gz: unreadable"):
        read(path)


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": \n{"id": "c", "text": "ok"}\n')
    with pytest.raises(ReadError, match=r"x\.jsonl:2: invalid JSON"):
        read(path)
    recs, counters = read(path, on_bad_record="skip")
    assert [r.skip for r in recs] == [None, "bad_record_invalid_json", None]
    assert counters["reader.records_skipped.invalid_json"] == 1
    assert recs[1].nbytes == len(b'{"id": "b", "text": \n')


def test_a_bad_record_stops_the_run_even_where_bad_files_are_skipped(tmp_path):
    """on_bad_record: error with on_bad_file: skip: the bad line is an error, not a file error that drops the good
    records after it (it once read one record of four and counted the rest as lost text of unknown size)."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"id": "a", "text": "A"}\nnot json\n{"id": "c", "text": "C"}\n{"id": "d", "text": "D"}\n')
    with pytest.raises(ReadError, match=r"x\.jsonl:2: invalid JSON"):
        read(path, on_bad_file="skip")
    recs, counters = read(path, on_bad_record="skip", on_bad_file="skip")
    assert [r.text for r in recs if r.skip is None] == ["A", "C", "D"] and counters["reader.records_skipped.invalid_json"] == 1


def test_an_id_that_is_no_unicode_is_a_bad_record_naming_its_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"id": "ok", "text": "A"}\n{"id": "doc-\\ud800", "text": "B"}\n')
    with pytest.raises(ReadError, match=r"x\.jsonl:2: id 'id' is not valid Unicode"):
        read(path)
    recs, counters = read(path, on_bad_record="skip")
    assert [r.skip for r in recs] == [None, "bad_record_invalid_utf8"] and counters["reader.records_skipped.invalid_utf8"] == 1


def test_non_utf8_bytes(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"id": "a", "text": "caf\xe9"}\n')
    with pytest.raises(ReadError, match=r"x\.jsonl:1: not UTF-8"):
        read(path)
    txt = tmp_path / "y.txt"
    txt.write_bytes(b"ok then \xff\xfe broken")
    with pytest.raises(ReadError, match=r"y\.txt: not UTF-8 at byte 8.*data\.reader\.on_bad_record: skip counts and "
                                        r"skips such records, e\.g\. snakemake \.\.\. --config set=data\.reader\."
                                        r"on_bad_record=skip"):
        read(txt)
    recs, counters = read(txt, on_bad_record="skip")
    assert recs[0].skip == "bad_record_invalid_utf8" and recs[0].nbytes == 17


def test_empty_file_and_file_without_text(tmp_path):
    empty = tmp_path / "e.jsonl.zst"
    empty.write_bytes(b"")
    with pytest.raises(ReadError, match="empty file"):
        read(empty)
    assert read(empty, on_bad_file="skip")[1]["reader.files_skipped.empty_file"] == 1
    blank = tmp_path / "b.jsonl"
    blank.write_text('{"id": "a", "text": ""}\n')
    with pytest.raises(ReadError, match="yields no text"):
        read(blank)


def test_missing_text_field(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"id": "a", "body": "text here"}\n')
    with pytest.raises(ReadError, match=r"x\.jsonl:1: no string field 'text'"):
        read(path)
    recs, _ = read(path, text_field="body")
    assert recs[0].text == "text here"


def test_missing_ids_are_derived_and_counted(tmp_path):
    path = tmp_path / "x.jsonl.zst"
    write_jsonl_zst(path, [{"text": t} for t in TEXTS])
    recs, counters = read(path)
    assert [r.id for r in recs] == ["x.jsonl.zst:1", "x.jsonl.zst:2", "x.jsonl.zst:3"]
    assert counters["reader.ids_derived"] == 3


def test_txt_file_is_one_document(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(TEXTS[0])
    recs, _ = read(path)
    assert len(recs) == 1 and recs[0].id == "doc.txt" and recs[0].text == TEXTS[0]


def test_a_bad_input_is_one_line_from_the_command_line(tmp_path, monkeypatch, capsys):
    """A stage stopped by bad input prints the reader's message (file, place, the policy that skips it) as one line
    and exits 2, as a configuration mistake does: it was a traceback through Snakemake's RuleException."""
    from dormouse import cli
    from dormouse.planner import plan_cli

    txt = tmp_path / "y.txt"
    txt.write_bytes(b"ok then \xff\xfe broken")

    def stage(argv):
        read(txt)
    monkeypatch.setattr(plan_cli, "main", stage)
    assert cli.main(["plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dormouse plan: ") and "y.txt: not UTF-8 at byte 8" in err[0]
    assert "on_bad_record=skip" in err[0]
