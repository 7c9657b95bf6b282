"""benchmarks/decode_step.py on CPU: the eager step of a tiny model, and of a copy with its regions compiled (aot_eager
here; inductor on the GPU), timed at each row count, rows written out."""

import json

from benchmarks import decode_step


def test_each_row_count_gets_a_timed_row_whose_rate_is_its_rows_over_its_step(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert decode_step.main(["--presets", "tiny", "--rows", "1,3", "--steps", "3", "--warmup", "1", "--device", "cpu",
                             "--compile", "--compile-backend", "aot_eager", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["preset"], r["mode"], r["rows"]) for r in rows] == [("tiny", "eager", 1), ("tiny", "compiled", 1),
                                                                  ("tiny", "eager", 3), ("tiny", "compiled", 3)]
    for r in rows:
        assert r["ms_step"] > 0 and r["ms_step_with_read"] > 0
        assert abs(r["bytes_per_s"] - r["rows"] / r["ms_step_with_read"] * 1e3) <= 0.1 * r["bytes_per_s"]
