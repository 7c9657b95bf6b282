"""benchmarks/pretrain_h200.py on CPU (its GPU half runs on the lent H200, by hand): the --dry-run-cpu TSV and
the table printed last, (c)'s parameter match, the FLOP formulas, one system's failure (OOM or error) not
stopping the others, SIGTERM still printing the table, and the step with compiled regions giving the plain
step's losses (item 4, dynamo's aot_eager backend: forward and backward traced as inductor traces them; inductor
itself on CPU takes ~30 s per model). Timings are never asserted."""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import benchmarks.pretrain_h200 as bench
from benchmarks import flops, peers, pretrain_step
from dormouse.core.config import load_preset
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import count_params, engram_params
from dormouse.train.settings import OptimSettings

REPO = Path(__file__).resolve().parent.parent
SCRIPT = [sys.executable, "-m", "benchmarks.pretrain_h200"]  # from the repository root (cwd=REPO)

DRY_SYSTEMS = ["kda_kernel_torch", "kda_layer_ours", "kda_layer_eager", "fla_kda", "kda_layer_fla", "ours", "ours_eager",
               "sdpa", "ours_nosync", "ours_graphed", "kda_kernel_graphed", "kda_layer_graphed",
               "kda_layer_torch_gates_graphed"]
TRAINING = {"ours", "ours_eager", "sdpa", "ours_nosync"}


def read_tsv(path: Path) -> tuple[list[str], list[dict]]:
    header = path.read_text(encoding="utf-8").split("\n", 1)[0].split("\t")
    with open(path, encoding="utf-8") as f:
        return header, list(csv.DictReader(f, delimiter="\t"))


def table_lines(stdout: str) -> list[str]:
    """The table: from its last header line to the end of stdout (it must be the last thing printed)."""
    lines = stdout.rstrip("\n").split("\n")
    start = max(i for i, line in enumerate(lines) if line.startswith("preset  system"))
    return lines[start:]


def check_table(stdout: str, rows: list[dict]) -> None:
    lines = table_lines(stdout)
    heads = [h for h, _ in bench.TABLE]
    pos = [lines[0].index(h) for h in heads]
    assert pos == sorted(pos), lines[0]
    assert set(lines[1]) <= {"-", " "}
    assert len(lines) == 2 + len(rows), lines
    for r, line in zip(rows, lines[2:]):
        assert line.split()[:2] == [r["preset"], r["system"]]


def test_dry_run_cpu_tsv_and_table(tmp_path):
    out = tmp_path / "bench.tsv"
    p = subprocess.run([*SCRIPT, "--dry-run-cpu", "--systems", *bench.ORDER, "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    header, rows = read_tsv(out)
    assert header == bench.COLUMNS
    for col in ("date", "device", "versions", "command", "preset", "system", "status", "tokens_per_s", "ms_step",
                "peak_gib", "mfu_pct", "matmul_tflops", "ratio", "ratio_of", "flops_per_token", "note"):
        assert col in header
    assert [(r["preset"], r["system"]) for r in rows] == [("-", "matmul")] + [
        (p_, s) for p_ in ("small", "medium") for s in DRY_SYSTEMS]
    for r in rows:
        assert r["command"].startswith("python3 -m benchmarks.pretrain_h200 --dry-run-cpu"), r["command"]
        assert "torch " in r["versions"] and r["device"].startswith("CPU") and r["date"]
        assert float(r["matmul_tflops"]) > 0
        if r["system"] in ("fla_kda", "kda_layer_fla", "kda_layer_torch_gates_graphed"):
            assert r["status"] == "skipped: FLA needs CUDA (dry run)"
            continue
        if r["system"].endswith("_graphed"):
            assert r["status"] == "skipped: CUDA graphs need CUDA (dry run)"
            continue
        assert r["status"] == "ok", r
        if r["system"] == "matmul":
            continue
        for col in ("tokens_per_s", "ms_step", "ms_step_median", "mfu_pct", "flops_per_token"):
            assert float(r[col]) > 0, (r["system"], col, r[col])
        assert r["peak_gib"] == ""  # CPU: no allocator peak
    by = {(r["preset"], r["system"]): r for r in rows}
    for preset in ("small", "medium"):
        ours, sdpa = by[preset, "ours"], by[preset, "sdpa"]
        assert int(ours["batch"]) == 2 and int(ours["seq_len"]) == 64
        assert abs(int(sdpa["params_nonemb"]) / int(ours["params_nonemb"]) - 1) < 0.10
        assert "kda_path.torch=" in ours["note"] and "Muon+AdamW" in ours["note"]
        layer, kernel = by[preset, "kda_layer_ours"], by[preset, "kda_kernel_torch"]
        assert float(layer["ratio"]) == pytest.approx(float(layer["ms_step"]) / float(kernel["ms_step"]), rel=1e-2)
        assert layer["ratio_of"] == "ms / kda_kernel_torch ms"
        assert ours["ratio"] == ""  # no fla_kda row ran: no reference
    assert "kernel ratio target small" in p.stdout
    check_table(p.stdout, rows)


@pytest.mark.parametrize("preset", ["small", "medium"])
def test_sdpa_params_match_ours_at_preset_shapes(preset):
    cfg = ModelConfig.from_dict(load_preset(preset, root=REPO)["model"])
    lay = peers.sdpa_layout(cfg)
    target = count_params(cfg)["non_embedding"]
    assert lay["target"] == target and lay["n_layers"] == cfg.depth and lay["d"] == cfg.d_model
    assert abs(lay["non_embedding"] / target - 1) < 0.10
    with torch.device("meta"):
        model = peers.build_sdpa(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert total - 2 * cfg.vocab_size * cfg.d_model == lay["non_embedding"]
    norms = (2 * cfg.depth + 1) * cfg.d_model
    assert flops.linear_weight_params(model) == total - cfg.vocab_size * cfg.d_model - norms


def test_fla_model_matches_ours_without_engram():
    """Runs where flash-linear-attention + transformers are importable (not in CI: fla-core alone has no models)."""
    pytest.importorskip("transformers")
    pytest.importorskip("fla.models")
    from dormouse.train.optim import build_optimizers

    preset = load_preset("small", root=REPO)
    cfg = ModelConfig.from_dict(preset["model"])
    model = peers.build_fla(cfg)
    cp = count_params(cfg)
    assert sum(p.numel() for p in model.parameters()) == cp["total"] - cp["engram_per_layer"] * len(cfg.engram_layers)
    assert flops.linear_weight_params(model) == cp["flop_params"] - len(cfg.engram_layers) * engram_params(cfg)["proj"]
    muon, adamw = build_optimizers(model, OptimSettings.of(preset["train"]))
    assert type(muon).__name__ == "Muon" and all(p.dim() == 2 for g in muon.param_groups for p in g["params"])
    adamw_ids = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert id(model.lm_head.weight) in adamw_ids and id(model.model.embeddings.weight) in adamw_ids


def test_flop_formulas():
    k = c = 64
    assert flops.kda_state_macs_per_token(64, 64) == 3 * k * k + 3 * c * k + 2 * c * k + c * c / 3
    assert flops.kda_flops_per_token(8, 4, 64) == 6 * 8 * 4 * flops.kda_state_macs_per_token(64)
    assert round(flops.kda_flops_per_token(1, 1, 64)) == 204800  # one head; x4 heads per small layer
    assert flops.attention_flops_per_token(9, 2048, 1024) == 12 * 9 * 2048 * 1024


def test_systems_run_in_order():
    assert bench.parse_args([]).systems == bench.ORDER
    assert bench.parse_args(["--systems", "sdpa", "ours"]).systems == ["ours", "sdpa"]  # always in ORDER


def test_one_system_failing_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    def oom(ctx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    def broken(ctx):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(bench.RUNNERS, "sdpa", oom)
    monkeypatch.setitem(bench.RUNNERS, "ours_nosync", broken)
    out = tmp_path / "fail.tsv"
    before = signal.getsignal(signal.SIGTERM)
    rc = bench.main(["--dry-run-cpu", "--presets", "small", "--systems", "kda_layer_ours", "sdpa", "ours_nosync",
                     "--out", str(out)])
    assert rc == 0
    _, rows = read_tsv(out)
    status = {r["system"]: r for r in rows}
    assert status["sdpa"]["status"] == "oom" and "out of memory" in status["sdpa"]["note"]
    assert status["ours_nosync"]["status"] == "error: RuntimeError" and "kernel exploded" in status["ours_nosync"]["note"]
    assert status["kda_layer_ours"]["status"] == "ok"
    check_table(capsys.readouterr().out, rows)
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored, budget timer off
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_sigterm_still_writes_rows_and_prints_the_table(tmp_path):
    out = tmp_path / "term.tsv"
    proc = subprocess.Popen([*SCRIPT, "--dry-run-cpu", "--presets", "small", "medium",
                             "--systems", "kda_layer_ours", "ours", "sdpa", "--steps", "40", "--out", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "small ours: start" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    stdout = "".join(seen) + rest
    assert proc.returncode == 0, stdout
    _, rows = read_tsv(out)
    assert [r["system"] for r in rows] == ["matmul"] + ["kda_layer_ours", "ours", "sdpa"] * 2
    stopped = [r["status"] for r in rows[2:]]
    assert stopped[0] in ("timeout (SIGTERM)", "ok")  # ours is usually mid-step when the signal lands
    assert all(s == "skipped: SIGTERM" for s in stopped[1:]), stopped
    check_table(stdout, rows)


def test_compiled_step_gives_the_plain_losses():
    preset = load_preset("small", root=REPO)
    cfg = replace(ModelConfig.from_dict(preset["model"]), **{**pretrain_step.DRY_MODEL, "n_core": 1, "kda_chunk_size": 16},
                  engram_rows=1024, engram_dim=16)
    train = {**preset["train"], "device": "cpu"}
    try:
        res = bench.check_equivalence(cfg, train, torch.device("cpu"), batch=2, seq_len=16, steps=2, backend="aot_eager")
    finally:
        torch._dynamo.reset()
    assert res["ok"], res
    assert len(res["plain"]) == 2 and res["max_rel"] <= 1e-4
    # the stacked Muon, no compile: the same losses to bf16 Newton–Schulz rounding
    res = bench.check_equivalence(cfg, train, torch.device("cpu"), batch=2, seq_len=16, steps=3, backend="none",
                                  muon="stacked", tol=1e-2)
    assert res["ok"] and len(res["fast"]) == 3, res


def test_profile_dry_run_names_the_optimizer_and_the_mixer(one_thread):
    """--profile: torch.profiler tables of our warm step, device time first, then host time."""
    args = bench.parse_args(["--dry-run-cpu", "--profile", "--presets", "tiny"])
    cfg, train, batch, seq_len = bench.setup("tiny", args, True)
    text = bench.profile_ours(bench.Ctx(args, "tiny", cfg, train, torch.device("cpu"), batch, seq_len, 0.0, True),
                              steps=2)
    first, second = text.split("== tiny: by self_cpu_time_total")
    assert first.startswith("== tiny: 2 steps, by cpu_time_total")
    assert "Optimizer.step#" in first and "aten::" in second
    small = first.split("== tiny: small eager ops by input shape")[1]
    rows = [line.split() for line in small.splitlines()[2:] if line.strip()]
    ops = {r[6] for r in rows}
    assert ops and ops <= set(bench.SMALL_OPS) and "input shapes" in small, small[:2000]
    assert all(r[1] == "ms" and float(r[0]) >= 0 and r[7].startswith("[") for r in rows), small[:2000]


def test_the_layer_ablation_builds_every_cpu_variant():
    """benchmarks/kda_layer_h200.py --dry-run-cpu: every variant that needs no FLA builds, traces its regions and
    runs forward+backward; the older layouts (torch_conv, separate_proj) give ours' output; FLA's rows say why
    they are skipped; the table prints last."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.kda_layer_h200", "--dry-run-cpu", "--reps", "1"], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index("variant"):].splitlines()[1:]
    rows = {line.split()[0]: line for line in table}
    assert list(rows) == ["kernel", "ours", "fla_conv", "torch_gates", "separate_proj", "torch_conv", "ours_noconv",
                          "no_kernel", "fla_norm", "fla_layer"]
    for name in ("kernel", "ours", "fla_conv", "torch_gates", "separate_proj", "torch_conv", "ours_noconv", "no_kernel"):
        assert rows[name].split()[1] != "n/a" and "failed" not in rows[name], rows[name]
    assert all("max|this-ours| 0 of" in rows[n] for n in ("fla_conv", "torch_conv", "torch_gates"))  # the same code on CPU
    diff, scale = (float(rows["separate_proj"].split()[i]) for i in (4, 7))  # "max|this-ours| D of max|ours| S"
    assert diff <= 1e-5 * scale, rows["separate_proj"]  # one stacked matmul against six: fp32 rounding only
    assert all("skipped: FLA needs CUDA" in rows[n] for n in ("fla_norm", "fla_layer"))
