"""benchmarks/quality_h200.py on CPU: both systems train on the pretrain job's data for the same clock
budget and are scored on its eval window (the H200 run is the device's; this proves the script)."""

import csv
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from test_pretrain import TINY_MODEL, TINY_TRAIN, job_json, set_model, shards_fixture  # noqa: F401 -- the shards fixture

REPO = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, "-m", "benchmarks.quality_h200"]
# the runs start in the pipeline's work directory: `-m benchmarks...` finds the package through PYTHONPATH
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def test_both_systems_get_the_same_clock_and_eval_window(shards, tmp_path):
    config = set_model(shards, TINY_MODEL, {**TINY_TRAIN, "steps": 20})
    job, _ = job_json(shards, config)
    (tmp_path / "job.json").write_text(job)
    out = tmp_path / "q.tsv"
    png = tmp_path / "q.png"
    r = subprocess.run([*SCRIPT, "--job", str(tmp_path / "job.json"), "--budget-s", "1.5",
                        "--eval-every-s", "1", "--warmup-steps", "1", "--out", str(out), "--plot", str(png)],
                       cwd=shards, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(out.open(), delimiter="\t"))
    for system in ("ours", "sdpa"):
        curve = [row for row in rows if row["system"] == system]
        assert curve[0]["step"] == "0" and float(curve[-1]["train_s"]) >= 1.5 and int(curve[-1]["step"]) >= 10
        assert float(curve[-1]["eval_bpb"]) < float(curve[0]["eval_bpb"]) < 8.2  # it learned; init is ~uniform
        epoch = sum(p.stat().st_size for p in shards.glob("results/store/shard/*/train/*.bin"))
        assert all(abs(float(row["passes"]) - int(row["bytes"]) / epoch) < 1e-4 for row in curve), curve  # over the shards
    assert len({row["eval_bytes"] for row in rows}) == 1  # one eval window for both
    assert r.stdout.strip().splitlines()[-1].startswith("sdpa")  # the table prints last
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"  # the same curves drawn later from the TSV alone
    r = subprocess.run([*SCRIPT, "--from-tsv", str(out), "--plot", str(again)],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and again.stat().st_size > 10_000, r.stderr[-2000:]


def test_a_paused_run_resumes_where_it_stopped(shards, tmp_path):
    """--pause-after-s saves the run in --state; the same command again resumes it (weights, optimizer, data
    position, clock, curve) instead of starting over, repeats no eval point and ends at the budget."""
    config = set_model(shards, TINY_MODEL, {**TINY_TRAIN, "steps": 20})
    job, _ = job_json(shards, config)
    (tmp_path / "job.json").write_text(job)
    base = [*SCRIPT, "--job", str(tmp_path / "job.json"), "--systems", "ours", "--budget-s", "2",
            "--eval-every-s", "0.5", "--warmup-steps", "0", "--state", str(tmp_path / "state"), "--pause-after-s", "1"]
    first = subprocess.run(base + ["--out", str(tmp_path / "a.tsv")], cwd=shards,
                           env=ENV, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "paused at" in first.stdout and "(paused:" in first.stdout, first.stderr[-3000:]
    part = list(csv.DictReader((tmp_path / "a.tsv").open(), delimiter="\t"))
    assert float(part[-1]["train_s"]) < 2
    second = subprocess.run(base + ["--out", str(tmp_path / "b.tsv")], cwd=shards, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0 and "resumed from" in second.stdout and "(paused:" not in second.stdout, \
        second.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "b.tsv").open(), delimiter="\t"))
    assert rows[: len(part)] == part  # the first call's curve, carried in the checkpoint
    clock = [float(r["train_s"]) for r in rows]
    steps = [int(r["step"]) for r in rows]
    assert clock == sorted(set(clock)) and clock[-1] >= 2 and steps == sorted(steps) and steps[-1] > steps[len(part) - 1]
    assert float(rows[-1]["eval_bpb"]) < float(rows[0]["eval_bpb"])
    # it went on from the saved weights: a fresh model would score ~0.4 BPB worse half a second in
    assert float(rows[len(part)]["eval_bpb"]) < float(part[-1]["eval_bpb"]) + 0.1
    wrong = subprocess.run([a if a != "2" else "3" for a in base], cwd=shards, env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert wrong.returncode != 0 and "another run" in wrong.stderr  # another budget would change the schedule


def test_another_presets_model_on_this_jobs_data_and_window(shards, tmp_path):
    """--model-preset: b1 against medium on one shard artifact needs medium's model (and its lr and schedule) read
    from the same train shards and scored on the same eval window as the job's own model."""
    config = set_model(shards, TINY_MODEL, {**TINY_TRAIN, "steps": 20})
    job, _ = job_json(shards, config)
    (tmp_path / "job.json").write_text(job)
    other = yaml.safe_load((shards / "config" / "presets" / "tiny.yaml").read_text())  # a wider model, its own lr
    other["model"], other["train"] = {**TINY_MODEL, "d_model": 48, "n_heads": 3}, {**TINY_TRAIN, "lr": 1e-3,
                                                                                   "eval_bytes": 4096, "batch_size": 2}
    (shards / "config" / "presets" / "wider.yaml").write_text(yaml.safe_dump(other, sort_keys=False))
    r = subprocess.run([*SCRIPT, "--job", str(tmp_path / "job.json"), "--systems", "ours",
                        "--model-preset", "wider", "--budget-s", "1", "--eval-every-s", "0.5", "--warmup-steps", "0",
                        "--out", str(tmp_path / "m.tsv")], cwd=shards, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "m.tsv").open(), delimiter="\t"))
    assert {row["system"] for row in rows} == {"ours:wider"} and int(rows[-1]["step"]) > 0
    assert {row["eval_bytes"] for row in rows} == {str(2048 - 2048 % 32)}  # the job's window, not the preset's
    assert int(rows[-1]["bytes"]) == int(rows[-1]["step"]) * 4 * 32  # the job's batch and length
    from dormouse.model.config import ModelConfig
    from dormouse.model.gpt import count_params
    wider = count_params(ModelConfig.from_dict(other["model"]))["non_embedding"]
    assert rows[0]["note"].startswith(f"{wider:,} non-embedding")  # the other preset's model was built


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_the_sdpa_baseline_trains_the_same_from_cuda_graphs():
    """quality_h200's SDPA model (compiled whole) replayed through GraphedLoss(CounterFree(model)), as the race
    runs it under train.cuda_graphs: cuda, against the same model's eager compiled steps from the same weights."""
    from dormouse.model.config import ModelConfig
    from dormouse.train import cuda_graphs
    from dormouse.train.runtime import autocast

    import benchmarks.quality_h200 as q

    cfg = ModelConfig.from_dict(TINY_MODEL)
    train = {**TINY_TRAIN, "device": "cuda", "dtype": "bfloat16", "lr": 3e-3, "muon_lr": 0.02, "optimizer": "muon",
             "weight_decay": 0.0}
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 65), generator=g).to(dev) for _ in range(2)]
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]
    losses = {}
    for name in ("eager", "graphed"):
        torch.manual_seed(0)
        model, _, opts, _ = q.build("sdpa", cfg, train, dev)
        graphed = cuda_graphs.GraphedLoss(q.CounterFree(model), *batches[0], train["dtype"]) if name == "graphed" else None
        losses[name] = []
        for i in (0, 1, 0):
            x, y = batches[i]
            if graphed is not None:
                loss, _ = graphed(x, y, Counter())
            else:
                with autocast(dev, train["dtype"]):
                    loss = model(x, y)[1]
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["graphed"]), torch.tensor(losses["eager"]), rtol=1e-3, atol=0)
    assert losses["graphed"][2] != losses["graphed"][0]  # batch 0 again, after two updates
