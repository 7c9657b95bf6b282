"""benchmarks/serve_bench.py's peer arms and time limits on CPU at toy sizes (issue #42): the Hugging Face peer and
our batched server give rows of the same shape for the same work, state per stream is ours' constant and the peer's
KV cache, and an arm that runs out of time is cut and still reported."""

import csv
import importlib
import importlib.util
import time
from pathlib import Path

import pytest

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="the serve_bench peer needs transformers: pip install -r requirements-bench.txt")


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.serve_bench")


def rows_of(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


@needs_transformers
def test_the_peer_and_our_batched_arm_do_the_same_work(bench, tmp_path):
    out = tmp_path / "s.tsv"
    assert bench.main(["--presets", "tiny", "--concurrency", "2", "--requests", "4", "--max-tokens", "5",
                       "--arms", "batched,hf_static,hf_dynamic", "--state-contexts", "16,64", "--out", str(out)]) == 0
    with out.open() as f:
        assert f.readline().rstrip("\n").split("\t") == bench.COLUMNS
    rows = {r["arm"]: r for r in rows_of(out)}
    assert list(rows) == ["batched", "hf_static", "hf_dynamic"]
    for r in rows.values():
        assert (r["status"], r["bytes"], r["requests_done"], r["concurrency"]) == ("ok", str(4 * 5), "4", "2"), r
        assert float(r["total_bytes_per_s"]) > 0 and float(r["stream_bytes_per_s_p50"]) > 0
        assert 0 < float(r["ttfb_p50_ms"]) <= float(r["ttfb_p99_ms"]) and r["preset"] == "tiny"
    for arm in ("hf_static", "hf_dynamic"):  # two waves of 2 prompts, 5 tokens each; CPU: generate never compiles
        assert (rows[arm]["steps"], rows[arm]["max_batch_seen"], rows[arm]["note"]) == ("10", "2", "compiled False")
    # equal parameters: the peer's non-embedding count within 3 % of ours (SwiGLU width in steps of 64)
    ours, peer = int(rows["batched"]["params_nonemb"]), int(rows["hf_static"]["params_nonemb"])
    assert abs(peer - ours) / ours < 0.03, (ours, peer)
    # ours: the same state at 16 and 64 bytes of context, the size the server measured; the peer's KV: K and V of
    # 2 layers x 4 heads x 32 dims x context x 4 bytes (fp32 on CPU), at its full request (64 + 5 tokens) per stream
    s16, s64 = (int(kv.split("=")[1]) for kv in rows["batched"]["state_bytes_by_context"].split(","))
    assert s16 == s64 == int(rows["batched"]["state_bytes_per_stream"]) > 0
    kv = 2 * 2 * 4 * 32 * 4
    for arm in ("hf_static", "hf_dynamic"):
        assert rows[arm]["state_bytes_by_context"] == f"16={kv * 16},64={kv * 64}"
        assert rows[arm]["state_bytes_per_stream"] == str(kv * (64 + 5))


@needs_transformers
def test_an_arm_out_of_time_is_cut_and_still_reported(bench, tmp_path):
    out = tmp_path / "s.tsv"
    t0 = time.perf_counter()
    # 2 x 4 096 bytes cannot be decoded in 1.5 s on a CPU (tiny: about 1-3 kB/s): every arm runs out (0.8 s left the
    # batched arm no byte past its warm-up once, on a loaded 2-core machine)
    assert bench.main(["--presets", "tiny", "--concurrency", "2", "--requests", "2", "--max-tokens", "4096",
                       "--arms", "batched,hf_static,hf_dynamic", "--arm-timeout-s", "1.5,hf_dynamic=0.5",
                       "--state-contexts", "16", "--out", str(out)]) == 0
    assert time.perf_counter() - t0 < 14  # the limits bound the run (set-up and imports aside)
    rows = {r["arm"]: r for r in rows_of(out)}
    assert list(rows) == ["batched", "hf_static", "hf_dynamic"]
    for arm, r in rows.items():
        assert r["status"] == "cut" and r["requests_done"] == "0", r
        assert 0 <= int(r["bytes"]) < 2 * 4096 and float(r["wall_s"]) < float(r["arm_timeout_s"]) + 0.7  # a step late
        assert r["arm_timeout_s"] == ("0.5" if arm == "hf_dynamic" else "1.5")
    # the bytes its streams decoded until the limit, none of them finished (the peer's warm-up may take its time)
    assert int(rows["batched"]["bytes"]) > 0
    # many short requests, one at a time, for 1.5 s (each takes some ms over HTTP): some finish, not all; the server's
    # count of decoded bytes at the limit agrees with the finished requests (2 bytes each) plus the one in flight
    out2 = tmp_path / "s2.tsv"
    assert bench.main(["--presets", "tiny", "--concurrency", "1", "--requests", "2000", "--max-tokens", "2",
                       "--arms", "batched", "--arm-timeout-s", "1.5", "--state-contexts", "16", "--out", str(out2)]) == 0
    (r,) = rows_of(out2)
    done = int(r["requests_done"])
    assert r["status"] == "cut" and 0 < done < 2000 and 2 * done <= int(r["bytes"]) <= 2 * done + 2, r


def test_the_run_budget_skips_the_arms_it_cannot_start(bench, tmp_path):
    out = tmp_path / "s.tsv"
    assert bench.main(["--presets", "tiny,small", "--concurrency", "2", "--requests", "2", "--max-tokens", "4096",
                       "--arms", "batched,unbatched", "--arm-timeout-s", "30", "--budget-s", "1.5",
                       "--state-contexts", "16", "--out", str(out)]) == 0
    rows = [(r["preset"], r["arm"], r["status"]) for r in rows_of(out)]
    # batched's own limit is 30 s: the budget's end cut it; then no arm starts, nor small's set-up
    assert rows == [("tiny", "batched", "cut"), ("tiny", "unbatched", "skipped"), ("small", "batched", "skipped"),
                    ("small", "unbatched", "skipped")]


def test_arm_timeouts_parse_per_arm(bench):
    assert bench.parse_timeouts("60,hf_static=120, unbatched=20") == (60.0, {"hf_static": 120.0, "unbatched": 20.0})
    with pytest.raises(ValueError, match="unknown arm"):
        bench.parse_timeouts("60,vllm=10")
    with pytest.raises(ValueError, match="default"):
        bench.parse_timeouts("hf_static=10")


def test_a_set_up_that_fails_gives_error_rows_and_the_run_goes_on(bench, tmp_path, monkeypatch):
    def no_peer(*args, **kwargs):
        raise MemoryError("no room for the peer")

    monkeypatch.setattr(bench, "build_peer", no_peer)
    out = tmp_path / "s.tsv"
    assert bench.main(["--presets", "nosuch,tiny", "--concurrency", "2", "--requests", "2", "--max-tokens", "3",
                       "--arms", "hf_static,batched", "--state-contexts", "16", "--out", str(out)]) == 0
    rows = [(r["preset"], r["arm"], r["status"], r["note"].split(":")[0]) for r in rows_of(out)]
    assert rows == [("nosuch", "hf_static", "error", "set-up"), ("nosuch", "batched", "error", "set-up"),
                    ("tiny", "hf_static", "error", "peer set-up"), ("tiny", "batched", "ok", "")]
