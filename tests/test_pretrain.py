"""The pretrain stage through its entry point: exact resume, arms counted in eval, NaN firewall,
strict loading. A tiny model on a small real corpus, on CPU."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from pipeline_util import configure, run_chain

from dormouse.planner.plan import build_plan
from dormouse.model.config import ModelConfig
from dormouse.cli import main as dormouse_main
from dormouse.model.gpt import ByteLM
from dormouse.train import checkpoint, runtime
from dormouse.train.firewall import BadStepsError
from dormouse.train.settings import OptimSettings

TINY_MODEL = {"d_model": 32, "n_heads": 2, "head_dim": 16, "ffn_hidden": 64, "n_core": 1, "kda_chunk_size": 16}
TINY_TRAIN = {"device": "cpu", "steps": 60, "batch_size": 4, "seq_len": 32, "eval_every": 20, "eval_bytes": 2048,
              "ckpt_every": 5, "log_every": 5, "warmup_steps": 5}


def set_model(workdir: Path, model: dict, train: dict) -> dict:
    path = workdir / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(path.read_text())
    preset["model"], preset["train"] = model, train
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    return yaml.safe_load((workdir / "config" / "config.yaml").read_text())


@pytest.fixture(name="shards")  # its function named apart: the modules importing it take `shards` as an argument
def shards_fixture(workdir, small_corpus, quality_examples):
    config = configure(workdir, small_corpus, *quality_examples)
    run_chain(workdir, config, stages=("filter", "shard"))
    return workdir


def job_json(workdir: Path, config: dict) -> tuple[str, str]:
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        plan = build_plan(config)
        d = plan.chain["tiny"]["pretrain"]
        return plan.job_json("pretrain", d), plan.artifact_dir("pretrain", d)
    finally:
        os.chdir(cwd)


def run_stage(workdir: Path, job: str, wait=True):
    proc = subprocess.Popen([sys.executable, "-m", "dormouse.cli", "pretrain", "--job", job], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    return proc


def test_killed_run_resumes_to_bit_identical_weights(shards):
    config = set_model(shards, TINY_MODEL, TINY_TRAIN)
    job, out_dir = job_json(shards, config)
    run_stage(shards, job)
    reference = (shards / out_dir / "model.safetensors").read_bytes()
    ref_metrics = [json.loads(line) for line in (shards / out_dir / "metrics.jsonl").read_text().splitlines()]
    ref_counters = json.loads((shards / out_dir / "manifest.json").read_text())["counters"]
    shutil.rmtree(shards / out_dir)

    proc = run_stage(shards, job, wait=False)
    scratch = shards / "results" / "scratch" / "pretrain" / Path(out_dir).name
    deadline = time.monotonic() + 300
    while not list(scratch.glob("step-*/snapshot.json")):
        assert proc.poll() is None, "finished before the first checkpoint; raise steps"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (shards / out_dir / "manifest.json").exists()
    run_stage(shards, job)
    manifest = json.loads((shards / out_dir / "manifest.json").read_text())
    assert manifest["counters"]["resumed_from_step"] >= 5
    per_process = {"train.steps_run_this_process", "resumed_from_step", "store.stale_tmp_dirs_removed"}
    same = lambda c: {k: v for k, v in c.items() if k not in per_process}
    assert same(manifest["counters"]) == same(ref_counters)  # counters survive the resume too
    assert (shards / out_dir / "model.safetensors").read_bytes() == reference
    metrics = [json.loads(line) for line in (shards / out_dir / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]
    assert strip(metrics) == strip(ref_metrics)
    assert not scratch.exists()  # a finished artifact removes its scratch


def test_every_enabled_arm_is_counted_in_training_and_eval(shards):
    model = {**TINY_MODEL, "engram": True, "engram_rows": 1024, "engram_dim": 8, "moe": True, "n_experts": 4,
             "n_prelude": 1, "n_loop": 2}
    config = set_model(shards, model, {**TINY_TRAIN, "steps": 6, "eval_every": 3, "ckpt_every": 100})
    job, out_dir = job_json(shards, config)
    run_stage(shards, job)
    m = json.loads((shards / out_dir / "manifest.json").read_text())
    c = m["counters"]
    for where in ("train", "eval"):
        assert c[f"{where}.kda_path.torch"] > 0 and c[f"{where}.engram.rows_read"] > 0
        assert c[f"{where}.loop.iterations"] > 0
        assert sum(v for k, v in c.items() if k.startswith(f"{where}.moe.tokens.")) > 0
    assert m["final"]["eval_bytes"] == 2048 - 2048 % 32
    assert 0 < m["final"]["time_to_first_step_s"] < 60  # issue #41 item 3: printed and kept (from the stage's start)
    view_curve = [json.loads(line) for line in (shards / out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in view_curve if "eval_bpb" in r] == [3, 6]
    # the stage writes nothing outside its artifact; the pretrain view appends the history entry, once per digest
    hist = shards / "results" / "history.jsonl"
    assert not hist.exists()
    view = [sys.executable, "-m", "dormouse.cli", "view", "pretrain", "--preset", "tiny", "--artifact", out_dir,
            "--out", "results/tiny/pretrain.json", "--history", "results/history.jsonl"]
    for _ in range(2):
        subprocess.run(view, cwd=shards, check=True, capture_output=True)
    assert [json.loads(line)["digest"] for line in hist.read_text().splitlines()] == [Path(out_dir).name]


def test_inert_arm_in_eval_is_a_loud_failure():
    cfg = ModelConfig(engram=True)
    live = Counter({"kda_path.torch": 2, "engram.rows_read": 10, "loop.iterations": 2})
    runtime.check_arms_active(cfg, live, "eval")
    with pytest.raises(SystemExit, match="engram enabled but no rows read"):
        runtime.check_arms_active(cfg, Counter({"kda_path.torch": 2, "loop.iterations": 2}), "eval")


def test_nan_firewall_skips_whole_steps_then_aborts(shards, monkeypatch):
    config = set_model(shards, TINY_MODEL, {**TINY_TRAIN, "steps": 10, "ckpt_every": 100, "max_bad_steps": 3})
    job, out_dir = job_json(shards, config)
    real_forward = ByteLM.forward
    bad_steps = {2}

    def forward(self, idx, targets=None, counters=None):
        logits, loss = real_forward(self, idx, targets, counters)
        if targets is not None:
            forward.calls += 1
            if forward.calls in bad_steps:
                loss = loss * float("nan")
        return logits, loss

    forward.calls = 0
    monkeypatch.setattr(ByteLM, "forward", forward)
    monkeypatch.chdir(shards)
    assert dormouse_main(["pretrain", "--job", job]) == 0
    c = json.loads((shards / out_dir / "manifest.json").read_text())["counters"]
    assert c["train.steps_skipped_nonfinite"] == 1

    shutil.rmtree(shards / out_dir)
    forward.calls = 0
    bad_steps.update(range(1, 100))
    with pytest.raises(BadStepsError, match="4 non-finite steps in a row"):
        dormouse_main(["pretrain", "--job", job])
    assert not (shards / out_dir / "manifest.json").exists()


def test_strict_loading_lists_unknown_and_missing_keys(tmp_path):
    from safetensors.torch import save_file

    from dormouse.model.gpt import ByteLM

    model = ByteLM(ModelConfig(**{k: v for k, v in TINY_MODEL.items()}))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dropped = sorted(state)[0]
    del state[dropped]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "w.safetensors"))
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_weights(model, tmp_path / "w.safetensors")
    assert dropped in str(e.value) and "extra.weight" in str(e.value)
    with pytest.raises(ValueError, match="unknown model config keys \\['d_modle'\\]"):
        ModelConfig.from_dict({"d_modle": 3})


@pytest.mark.slow
def test_compiled_regions_train_like_eager_and_count_every_arm(shards):
    """train.compile: always on CPU (inductor, ~1 min): the stage with its regions compiled counts every arm
    as the eager stage does and ends at the same eval BPB to fp32 rounding."""
    model = {**TINY_MODEL, "engram": True, "engram_rows": 1024, "engram_dim": 8, "moe": True, "n_experts": 4,
             "n_prelude": 1, "n_loop": 2}
    runs = {}
    for mode in ("never", "always"):
        config = set_model(shards, model, {**TINY_TRAIN, "steps": 6, "eval_every": 3, "ckpt_every": 100,
                                           "compile": mode})
        job, out_dir = job_json(shards, config)
        run_stage(shards, job)
        runs[mode] = json.loads((shards / out_dir / "manifest.json").read_text())
    eager, compiled = runs["never"], runs["always"]
    assert eager["counters"]["compile.regions"] == 0 and compiled["counters"]["compile.regions"] > 0
    def arm_counts(c):  # routing follows the router's last bits: the per-expert split may differ, the total not
        out = {k: v for k, v in c.items() if k.startswith(("train.", "eval.")) and "steps_run" not in k and ".moe." not in k}
        for where in ("train", "eval"):
            out[f"{where}.moe.tokens"] = sum(v for k, v in c.items() if k.startswith(f"{where}.moe.tokens."))
        return out

    assert arm_counts(compiled["counters"]) == arm_counts(eager["counters"])
    assert arm_counts(eager["counters"])["train.moe.tokens"] > 0
    assert compiled["final"]["eval_bpb"] == pytest.approx(eager["final"]["eval_bpb"], rel=1e-3)


def test_a_run_planned_past_max_epochs_is_refused_before_any_device(shards):
    """b1's train section (50 000 steps of 16 x 2048 bytes) over a corpus of a few MB: the stage refuses before it
    touches a device (train.device cuda on this CPU machine would fail later, and differently), naming the
    preset, the budget, the train bytes and max_epochs; `dormouse plan` shows the same passes."""
    b1 = yaml.safe_load((Path(__file__).resolve().parent.parent / "config" / "presets" / "b1.yaml").read_text())["train"]
    train = {**TINY_TRAIN, **{k: b1[k] for k in ("device", "steps", "batch_size", "seq_len")}}
    config = set_model(shards, TINY_MODEL, train)
    job, out_dir = job_json(shards, config)
    out = subprocess.run([sys.executable, "-m", "dormouse.cli", "pretrain", "--job", job, "--presets", "b1"], cwd=shards,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    msg = out.stderr.strip().splitlines()[-1]
    assert msg.startswith("pretrain: preset b1 plans 50000 steps x 16 x 2048 = 1,638,400,000 bytes, ") and \
        "past train.max_epochs 4" in msg, msg
    n = int(msg.split(" bytes of train shards")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert f"{1_638_400_000 / n:.1f} passes" in msg
    assert not (shards / out_dir).exists() and "CUDA" not in out.stderr
    plan = subprocess.run([sys.executable, "-m", "dormouse.cli", "plan", "--preset", "tiny"], cwd=shards,
                          capture_output=True, text=True, timeout=300, check=True).stdout
    assert f"passes {1_638_400_000 / n:.2f} over {n:,} train bytes (REFUSED by the stage: past max_epochs 4)" in plan
    config = set_model(shards, TINY_MODEL, {**train, "max_epochs": None, "steps": 1, "device": "cpu"})
    run_stage(shards, job_json(shards, config)[0])  # null: no ceiling (and a run within it trains)


def test_a_corrupt_compile_cache_is_skipped_and_counted(tmp_path, monkeypatch):
    from dormouse.train import compile_cache

    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    folder = compile_cache.cache_dir(torch.device("cpu"))
    assert folder.parent == tmp_path and folder.name.startswith(f"torch{torch.__version__}") and folder.name.endswith("-cpu")
    c, said = Counter(), []
    compile_cache.load(torch.device("cpu"), c, lambda *a, **k: said.append(a[0]))
    assert c["compile_cache.absent"] == 1
    folder.mkdir()
    (folder / "0123.bin").write_bytes(b"not a cache")
    compile_cache.load(torch.device("cpu"), c, lambda *a, **k: said.append(a[0]))
    assert c["compile_cache.load_failed"] == 1 and c["compile_cache.files_loaded"] == 0
    assert str(folder / "0123.bin") in said[-1] and "compile from scratch" in said[-1]
    # a save that cannot be written (the folder's parent is a file) is counted and the run goes on
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "0123.bin"))
    (tmp_path / "0123.bin").write_bytes(b"")
    monkeypatch.setattr(compile_cache, "compiled_here", lambda: 3)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    compile_cache.save(torch.device("cpu"), c, lambda *a, **k: said.append(a[0]))
    assert c["compile_cache.save_failed"] == 1 and "the run goes on" in said[-1] and not c["compile_cache.saved_files"]
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.cache_dir(torch.device("cpu")) is None  # unset: off


@pytest.mark.slow
def test_a_second_machine_starts_from_the_first_ones_compile_cache(shards, tmp_path):
    """DORMOUSE_COMPILE_CACHE (inductor on CPU, ~1 min): the first run compiles and writes the cache file, a second
    run with an empty inductor cache (another node) loads it, compiles nothing new, and trains to the same bits."""
    config = set_model(shards, TINY_MODEL, {**TINY_TRAIN, "steps": 4, "eval_every": 2, "ckpt_every": 100, "compile": "always"})
    job, out_dir = job_json(shards, config)
    runs, logs = [], []
    for i in range(2):
        shutil.rmtree(shards / out_dir, ignore_errors=True)
        env = dict(os.environ, DORMOUSE_COMPILE_CACHE=str(tmp_path / "cc"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"ind{i}"))
        p = subprocess.run([sys.executable, "-m", "dormouse.cli", "pretrain", "--job", job], cwd=shards, env=env,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
        logs.append(p.stdout + p.stderr)
        runs.append((json.loads((shards / out_dir / "manifest.json").read_text()),
                     (shards / out_dir / "model.safetensors").read_bytes()))
    (first, w1), (second, w2) = runs
    # the first steps' graphs and then the eval's: two saves, each a file of the artifacts made since the last
    assert first["counters"]["compile_cache.absent"] == 1 and first["counters"]["compile_cache.saved_files"] == 2
    assert second["counters"]["compile_cache.files_loaded"] == 2 and second["counters"]["compile_cache.loaded_artifacts"] > 0
    assert "compile_cache.saved_files" not in second["counters"]  # every graph a cache hit: nothing compiled here
    assert "[compile_cache] loaded 2 files" in logs[1] and w1 == w2


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    """A crash can leave the newest checkpoint's files short behind a complete name: resume passes it over for the
    one before, says so and counts it; with none readable it fails rather than start over."""
    from dormouse.model.gpt import ByteLM
    from dormouse.train.optim import build_optimizers
    from dormouse.train.trainer import resume

    cfg = ModelConfig.from_dict(TINY_MODEL)
    train = {"optimizer": "adamw", "lr": 1e-3, "muon_lr": 0.02, "weight_decay": 0.0}
    torch.manual_seed(0)
    model = ByteLM(cfg)
    opts = build_optimizers(model, OptimSettings.of(train))
    root = tmp_path / "ckpt"
    checkpoint.save(root, 4, model, opts, {"mark": 4})
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    checkpoint.save(root, 8, model, opts, {"mark": 8})
    (root / "step-00000008" / checkpoint.WEIGHTS).write_bytes(b"")  # the rename survived, the data did not
    fresh, counters = ByteLM(cfg), Counter()
    path, snap = resume(root, fresh, build_optimizers(fresh, OptimSettings.of(train)), counters)
    assert path.name == "step-00000004" and snap["mark"] == 4 and counters["checkpoints_unreadable"] == 1
    (root / "step-00000004" / checkpoint.WEIGHTS).write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint could be read"):
        resume(root, fresh, build_optimizers(fresh, OptimSettings.of(train)), counters)
