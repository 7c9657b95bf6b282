"""The benchmark history: entries from real-looking pretrain artifacts (built with the store's own
writer, so digests and file checks are the real ones), idempotent concurrent appends, the table,
and the regression gate."""

import json
import multiprocessing
import statistics
from itertools import count
from pathlib import Path

import pytest

from dormouse.tools import history
from dormouse.core.store import ArtifactWriter, artifact_digest

REPO = Path(__file__).resolve().parent.parent
H200_METRICS = REPO / "benchmarks" / "records" / "2026-12-02-small-pretrain-h200" / "h200_small_pretrain.metrics.jsonl"
T0 = 1796215218  # a created_unix of a real tiny run
_serial = count()

# the small preset's params as the H200 run logged them (benchmarks/records/2026-12-02-small-pretrain-h200/h200_small_pretrain.log)
SMALL_MODEL = {"d_model": 256, "engram": True, "engram_dim": 16, "engram_heads": 2, "engram_layers": [0],
               "engram_orders": [2, 3, 4], "engram_rows": 8192, "ffn_hidden": 768, "head_dim": 64, "init_std": 0.02,
               "kda_chunk_size": 64, "kda_conv_size": 4, "moe": False, "moe_top_k": 2, "n_coda": 0, "n_core": 8,
               "n_experts": 8, "n_heads": 4, "n_loop": 1, "n_prelude": 0, "norm_eps": 1e-06,
               "tie_embeddings": False, "vocab_size": 256}
SMALL_TRAIN = {"batch_size": 32, "ckpt_every": 500, "decay_frac": 0.3, "device": "cuda", "dtype": "bfloat16",
               "eval_bytes": 2200000, "eval_every": 250, "grad_clip": 1.0, "log_every": 10, "lr": 0.003,
               "max_bad_steps": 10, "min_lr_frac": 0.1, "moe_aux_coef": 0.01, "muon_lr": 0.02, "optimizer": "muon",
               "seed": 0, "seq_len": 1024, "steps": 2000, "warmup_steps": 20, "weight_decay": 0.0}


def metric_rows(steps=200, log_every=10, tokens_per_s=300_000.0, warm=1_700.0):
    """A run's metrics.jsonl rows: a slow first window (autotune), then +-2% around tokens_per_s."""
    rows = []
    for i, step in enumerate(range(log_every, steps + 1, log_every)):
        rate = warm if i == 0 else tokens_per_s * (1 + 0.01 * ((i % 5) - 2))
        rows.append({"step": step, "loss": 1.5, "bpb": 2.1, "lr": 0.003, "tokens_per_s": round(rate, 1), "epochs": 0.1})
    rows[-1].update(eval_bpb=1.5609, eval_bytes=2055168)
    return rows


def make_run(store: Path, *, rows=None, tokens_per_s=300_000.0, peak=7.7, device="cuda", gpu="NVIDIA H200",
             batch_size=32, seq_len=1024, created=T0, torch_version="2.11.0+cu130", steps=None, counters=None,
             env_device=None, qat=None, **train_keys) -> Path:
    """A finished pretrain artifact under store/pretrain/<digest>/ shaped like the stage's own."""
    rows = rows if rows is not None else metric_rows(tokens_per_s=tokens_per_s)
    steps = steps or rows[-1]["step"]
    train = {**SMALL_TRAIN, "device": device, "batch_size": batch_size, "seq_len": seq_len, "steps": steps,
             **({"qat": qat} if qat else {}), **train_keys}
    params = {"model": SMALL_MODEL, "train": train}
    inputs = {"shard": f"{next(_serial):020d}"}  # a distinct digest per run
    digest = artifact_digest("pretrain", 3, params, inputs, [])
    final = {"eval_bpb": rows[-1].get("eval_bpb"), "eval_bytes": 2055168, "params": {"total": 9128496},
             "epochs": 0.34, "train_bytes_seen": steps * batch_size * seq_len, "device": device,
             "optimizers": ["Muon", "AdamW"]}
    if device == "cuda":
        final.update(peak_memory_gib=peak, gpu=gpu)
    env = {"python": "3.12.3", "platform": "Linux-x86_64", "cpu_count": 16,
           "versions": {"numpy": "2.4.6", "torch": torch_version},
           "device": env_device or (gpu if device == "cuda" else "cpu")}
    extra = {"environment": env, "created_unix": created, "wall_time_s": 424.0,
             "code": {"package_version": "0.1.0", "git_commit": "72165e2" + "0" * 33, "git_dirty": False},
             "final": final}
    w = ArtifactWriter(store / "pretrain" / digest, "pretrain", 3, params, inputs, [], extra=extra)
    with w as art:
        art.counters.update({"train.steps": steps, "train.steps_run_this_process": steps, **(counters or {})})
        art.path("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        art.path("config.json").write_text(json.dumps(params))
    return store / "pretrain" / digest


def add(hist: Path, *art_dirs: Path) -> list[dict]:
    for d in art_dirs:
        history.append(hist, history.entry_from_artifact(d))
    return history.read_history(hist)


# ----------------------------------------------------------------------------- entries

def test_entry_from_the_real_h200_metrics(tmp_path):
    rows = [json.loads(line) for line in H200_METRICS.read_text().splitlines()]
    e = history.entry_from_artifact(make_run(tmp_path, rows=rows, peak=7.7))
    # warm-up rule: steps <= 10% of 2000 dropped (the first window, 1 713 tok/s, is Triton autotune)
    steady = [r["tokens_per_s"] for r in rows if r["step"] > 200]
    assert e["tokens_per_s"] == pytest.approx(statistics.median(steady), abs=0.1)
    assert e["tokens_per_s_rows"] == len(steady) == 180
    assert e["key"] == {"device": "NVIDIA H200", "model": history.model_hash(SMALL_MODEL), "batch_size": 32,
                        "seq_len": 1024, "dtype": "bfloat16", "optimizer": "muon", "torch": "2.11.0+cu130",
                        "cpu_threads": None, "world_size": 1, "cuda_graphs": None}
    assert e["peak_memory_gib"] == 7.7 and e["eval_bpb"] == 1.56086 and e["wall_time_s"] == 424.0
    assert e["created"] == "2026-12-02T12:40:18+00:00" and e["git_commit"].startswith("72165e2")
    assert len(history.comparable_key(e)) == len(history.KEY_FIELDS)
    # a quantization-aware finish (eager, quantizing every step) is compared only with its like
    q = history.entry_from_artifact(make_run(tmp_path, rows=rows, peak=7.7, qat={"rung": "ternary", "fraction": 0.2}))
    assert q["key"] == {**e["key"], "qat": "ternary@0.2"} and history.comparable_key(q) != history.comparable_key(e)
    # so are gradient accumulation and a compile setting other than the default
    m = history.entry_from_artifact(make_run(tmp_path, rows=rows, micro_batch_size=8, compile="never"))
    assert m["key"] == {**e["key"], "micro_batch_size": 8, "compile": "never"}
    assert history.comparable_key(m) != history.comparable_key(e)
    assert history.entry_from_artifact(make_run(tmp_path, rows=rows, micro_batch_size=None, compile="cuda"))["key"] == e["key"]


def test_warm_up_rule():
    rows = [{"step": s, "tokens_per_s": 100.0} for s in range(10, 101, 10)]
    rows[0]["tokens_per_s"] = rows[1]["tokens_per_s"] = 1.0  # steps 10, 20 (<= 10% of 200)
    assert history.steady_throughput(rows, steps=200) == (100.0, 8)
    # resumed at step 50: the first window of the new process (step 60) is dropped too
    rows[5]["tokens_per_s"] = 1.0
    assert history.steady_throughput(rows, steps=200, resumed_from_step=50) == (100.0, 7)
    # nothing past the cut: every row but the first; one row: that row; eval-only rows carry no rate
    assert history.steady_throughput([{"step": 1, "tokens_per_s": 5.0}, {"step": 2, "tokens_per_s": 7.0}], 1000) == (7.0, 1)
    assert history.steady_throughput([{"step": 1, "tokens_per_s": 5.0}, {"step": 2, "eval_bpb": 3.0}], 1000) == (5.0, 1)
    assert history.steady_throughput([{"step": 2, "eval_bpb": 3.0}], 1000) == (None, 0)


def test_cpu_run_on_a_gpu_machine_is_a_cpu_entry(tmp_path):
    rows = metric_rows(tokens_per_s=1_800.0, warm=1_400.0)
    e = history.entry_from_artifact(make_run(tmp_path, rows=rows, device="cpu", torch_version="2.13.0+cpu",
                                             env_device="NVIDIA H200"))  # environment names GPU 0 anyway
    assert e["key"]["device"] == "cpu" and e["key"]["cpu_threads"] == 1
    assert e["peak_memory_gib"] is None
    assert e["tokens_per_s"] == pytest.approx(1_800.0, rel=0.02)


# ----------------------------------------------------------------------------- appending

def test_append_is_idempotent_per_digest(tmp_path):
    hist = tmp_path / "results" / "history.jsonl"
    a, b = make_run(tmp_path), make_run(tmp_path)
    ea = history.entry_from_artifact(a)
    assert history.append(hist, ea) is True
    assert history.append(hist, ea) is False
    assert history.append(hist, history.entry_from_artifact(a)) is False
    assert history.append(hist, history.entry_from_artifact(b)) is True
    lines = hist.read_text().splitlines()
    assert [json.loads(line)["digest"] for line in lines] == [a.name, b.name]


def _append_many(args):
    hist, worker = args
    for i in range(20):
        history.append(Path(hist), {"digest": f"w{worker}-{i}", "pad": "x" * 2000})
        history.append(Path(hist), {"digest": "shared", "worker": worker})
    return worker


def test_concurrent_appends_neither_interleave_nor_duplicate(tmp_path):
    hist = tmp_path / "history.jsonl"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        assert sorted(pool.map(_append_many, [(str(hist), w) for w in range(4)])) == [0, 1, 2, 3]
    entries = history.read_history(hist)  # every line parses
    digests = [e["digest"] for e in entries]
    assert len(digests) == len(set(digests)) == 4 * 20 + 1


def test_a_corrupt_line_is_named(tmp_path):
    hist = tmp_path / "history.jsonl"
    hist.write_text('{"digest": "a"}\n{"digest": \n')
    with pytest.raises(ValueError, match=r"history.jsonl:2"):
        history.read_history(hist)


# ----------------------------------------------------------------------------- table and CLI

def test_add_and_table(tmp_path, capsys):
    hist = tmp_path / "history.jsonl"
    a = make_run(tmp_path, tokens_per_s=302_000.0, peak=7.7)
    b = make_run(tmp_path, device="cpu", rows=metric_rows(tokens_per_s=1_800.0), created=T0 + 60, batch_size=8, seq_len=256)
    assert history.main(["--file", str(hist), "--add", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert f"added {a.name}" in out and f"added {b.name}" in out
    header, row_a, row_b = out.splitlines()[-3:]
    assert header.split() == ["date", "device", "model", "BxT", "tokens/s", "peak", "GiB", "eval", "BPB", "digest"]
    assert row_a.split() == ["2026-12-02", "12:40", "NVIDIA", "H200", history.model_hash(SMALL_MODEL)[:8], "32x1024",
                             "302,000", "7.70", "1.5609", a.name]
    assert "cpu x1thr" in row_b and "8x256" in row_b and " - " in row_b and b.name in row_b
    assert history.main(["--file", str(hist), "--add", str(a)]) == 0  # backfilling again adds nothing
    assert "already there" in capsys.readouterr().out and len(hist.read_text().splitlines()) == 2


def test_add_reports_an_unfinished_artifact_and_adds_the_rest(tmp_path, capsys):
    hist = tmp_path / "history.jsonl"
    a = make_run(tmp_path)
    unfinished = tmp_path / "pretrain" / "0123456789abcdef0123"
    unfinished.mkdir()
    assert history.main(["--file", str(hist), "--add", str(unfinished), str(a)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert [e["digest"] for e in history.read_history(hist)] == [a.name]


def test_tolerance_must_be_a_fraction(tmp_path):
    with pytest.raises(SystemExit):
        history.main(["--file", str(tmp_path / "h.jsonl"), "--tolerance", "1.5"])


# ----------------------------------------------------------------------------- the gate

def test_check_without_history_or_a_comparable_entry_passes(tmp_path):
    assert history.check([]) == (True, "history is empty: nothing to check")
    entries = add(tmp_path / "h.jsonl", make_run(tmp_path))
    ok, report = history.check(entries)
    assert ok and "no earlier comparable entry" in report


def test_check_passes_within_tolerance(tmp_path, capsys):
    hist = tmp_path / "h.jsonl"
    old, new = make_run(tmp_path, tokens_per_s=300_000.0), make_run(tmp_path, tokens_per_s=276_000.0, created=T0 + 3600)
    ok, report = history.check(add(hist, old, new))  # 0.92x, default tolerance 0.10
    assert ok, report
    assert f"newest {new.name}" in report and f"previous {old.name}" in report and "ratio 0.920" in report
    assert history.main(["--file", str(hist), "--check"]) == 0


def test_check_fails_beyond_tolerance_and_main_exits_1(tmp_path, capsys):
    hist = tmp_path / "h.jsonl"
    old, new = make_run(tmp_path, tokens_per_s=300_000.0), make_run(tmp_path, tokens_per_s=255_000.0, created=T0 + 3600)
    ok, report = history.check(add(hist, old, new))  # 0.85x
    assert not ok
    assert "REGRESSION" in report and "ratio 0.850" in report and new.name in report and old.name in report
    assert history.main(["--file", str(hist), "--check"]) == 1
    err = capsys.readouterr().err
    assert "REGRESSION" in err and new.name in err and old.name in err and "0.850" in err
    assert history.main(["--file", str(hist), "--check", "--tolerance", "0.2"]) == 0


def test_incomparable_entries_are_not_compared(tmp_path):
    hist = tmp_path / "h.jsonl"
    fast_h200 = make_run(tmp_path, tokens_per_s=300_000.0, created=T0)
    slow_h100 = make_run(tmp_path, tokens_per_s=100_000.0, gpu="NVIDIA H100 80GB HBM3", created=T0 + 10)
    other_batch = make_run(tmp_path, tokens_per_s=100_000.0, batch_size=16, created=T0 + 20)
    other_torch = make_run(tmp_path, tokens_per_s=100_000.0, torch_version="2.12.0+cu130", created=T0 + 30)
    graphed = make_run(tmp_path, tokens_per_s=100_000.0, peak=0.4, created=T0 + 35, counters={"cuda_graphs.captures": 1})
    entries = add(hist, fast_h200, slow_h100, other_batch, other_torch, graphed)
    for i in range(1, 5):  # each newest has no earlier run of its key
        ok, report = history.check(entries[: i + 1])
        assert ok and "no earlier comparable entry" in report, report
    # the newest H200 run compares with the H200 run, past the slower H100 and other-batch runs
    new = make_run(tmp_path, tokens_per_s=200_000.0, created=T0 + 40)
    ok, report = history.check(add(hist, new))
    assert not ok and f"previous {fast_h200.name}" in report and "ratio 0.667" in report


def test_memory_regression_is_detected(tmp_path):
    hist = tmp_path / "h.jsonl"
    base = make_run(tmp_path, peak=7.7, created=T0)
    ok, report = history.check(add(hist, base, make_run(tmp_path, peak=8.4, created=T0 + 10)))  # 1.09x
    assert ok, report
    ok, report = history.check(add(hist, make_run(tmp_path, peak=9.5, created=T0 + 20)))  # 9.5 / 8.4 = 1.13x
    assert not ok and "peak memory 9.500 vs 8.400 GiB: ratio 1.131" in report and "REGRESSION" in report
    assert "tokens/s" in report and "ok" in report.splitlines()[1]  # throughput itself was fine


def test_newest_is_by_creation_time_not_by_file_order(tmp_path):
    hist = tmp_path / "h.jsonl"
    new = make_run(tmp_path, tokens_per_s=250_000.0, created=T0 + 3600)
    backfilled_old = make_run(tmp_path, tokens_per_s=300_000.0, created=T0)
    ok, report = history.check(add(hist, new, backfilled_old))
    assert not ok and f"newest {new.name}" in report and f"previous {backfilled_old.name}" in report
