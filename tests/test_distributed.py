"""Data-parallel pretraining under torchrun, on CPU over gloo, through the stage's entry point:
2 processes against 1 with the same global batch, a checkpoint of 2 processes resumed by 1, the
NaN firewall deciding for every rank, and the batch-size rule. The tiny model of test_pretrain.

Tolerance. 2 processes differ from 1 only in floating-point reduction order: each rank's loss is
the mean over its half of the rows and DDP averages the two gradients (measured: bit-identical to
one process accumulating the two halves' gradients). With AdamW that stays at rounding level:
over 60 steps the loss curves agreed to 7e-6 relative, eval BPB to 4e-5, weights to 1.5e-4
absolute; hence RTOL and WEIGHT_ATOL below. The equality tests therefore train with
`optimizer: adamw`. With Muon (torch.optim.Muon) the same last-bit gradient differences are cast
to bf16 for the Newton-Schulz iteration, flip bf16 roundings, and the training dynamics amplify
them: 1e-4 relative loss after 10 steps, 1e-2 after 50, weights apart by up to 0.4 while the eval
BPB stayed within 0.2% (4.382 vs 4.391). That is the optimizer, not the parallelism: Muon runs
check that the replicas hold identical weights (`ddp.replica_checks`) instead. The MoE load-balancing
loss averages the routing fractions over ranks (dormouse/model/ffn.py), tested below.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pipeline_util import configure, plan_in
from safetensors.torch import load_file
from test_pretrain import TINY_MODEL, TINY_TRAIN, job_json, run_stage, set_model, shards_fixture  # noqa: F401 -- the shards fixture

from dormouse.data.byte_stream import TrainStream
from dormouse.core.config import ConfigError
from dormouse.planner.plan import Plan
from dormouse.train.distributed import World

RTOL = 1e-4  # loss curve and eval BPB, relative
WEIGHT_ATOL = 1e-3  # final weights, absolute (the largest are O(1))
ADAMW = {**TINY_TRAIN, "optimizer": "adamw", "steps": 30}  # evals at 20 and 30


def torchrun(workdir: Path, job: str, log: Path, nproc: int = 2, entry=("-m", "dormouse.cli", "pretrain")) -> subprocess.Popen:
    """The stage under torchrun (the command the pretrain rule runs for N > 1 GPUs), output to `log`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *entry, "--job", job]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, log: Path) -> str:
    proc.wait(timeout=600)
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    return out


def result(workdir: Path, out_dir: str) -> dict:
    art = workdir / out_dir
    return {
        "weights": load_file(str(art / "model.safetensors")),
        "metrics": [json.loads(line) for line in (art / "metrics.jsonl").read_text().splitlines()],
        "manifest": json.loads((art / "manifest.json").read_text()),
    }


def assert_same_run(a: dict, b: dict) -> None:
    """Two runs of one job agree up to floating-point reduction order."""
    assert [r["step"] for r in a["metrics"]] == [r["step"] for r in b["metrics"]]
    for ra, rb in zip(a["metrics"], b["metrics"]):
        for key in ("loss", "eval_bpb"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=RTOL), (ra["step"], key, ra[key], rb[key])
        assert ra.get("epochs") == rb.get("epochs") and ra.get("eval_bytes") == rb.get("eval_bytes")
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        torch.testing.assert_close(b["weights"][k], a["weights"][k], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")
    ca, cb = a["manifest"]["counters"], b["manifest"]["counters"]
    for key in ("train.steps", "train.bytes_seen", "eval.window_bytes", "train.checkpoints_written"):
        assert ca.get(key) == cb.get(key), key
    fa, fb = a["manifest"]["final"], b["manifest"]["final"]
    assert fa["train_bytes_seen"] == fb["train_bytes_seen"] and fa["eval_bytes"] == fb["eval_bytes"]


def test_rank_rows_concatenate_to_the_global_batch(tmp_path):
    paths = []
    for i, n in enumerate([700, 500, 900]):
        paths.append(tmp_path / f"s{i}.bin")
        (np.arange(n) % 251 + i).astype(np.uint8).tofile(paths[-1])
    whole = TrainStream(paths, batch_size=4, seq_len=16, seed=3)
    ranks = [TrainStream(paths, batch_size=4, seq_len=16, seed=3, rows=World(r, 2).rows(4)) for r in range(2)]
    for _ in range(80):  # 32 batches an epoch: into the third
        x, y = whole.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert ranks[0].state == ranks[1].state == whole.state  # the data position does not depend on the world size
        assert ranks[1].bytes_seen() == whole.bytes_seen()
    assert whole.state.epoch >= 2
    with pytest.raises(ValueError, match="not a contiguous non-empty slice"):
        TrainStream(paths, batch_size=4, seq_len=16, seed=3, rows=range(3, 5))


def worker_pids(agent_pid: int) -> list[int]:
    """The worker processes torchrun started (its children; they run in sessions of their own)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == agent_pid:  # field 4 of /proc/<pid>/stat: the parent pid
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.slow  # ~30 s: one process, then two
def test_two_processes_train_like_one(shards, tmp_path):
    config = set_model(shards, TINY_MODEL, {**ADAMW, "ckpt_every": 10})
    job, out_dir = job_json(shards, config)
    run_stage(shards, job)
    one = result(shards, out_dir)
    shutil.rmtree(shards / out_dir)

    out = finish(torchrun(shards, job, tmp_path / "w2.log"), tmp_path / "w2.log")
    two = result(shards, out_dir)
    assert_same_run(one, two)
    assert one["manifest"]["digest"] == two["manifest"]["digest"]  # the world size is not in the digest
    assert one["manifest"]["final"]["world_size"] == 1 and two["manifest"]["final"]["world_size"] == 2
    c1, c2 = one["manifest"]["counters"], two["manifest"]["counters"]
    assert c2["train.checkpoints_written"] == 2  # counted once, not once per rank
    assert c2["ddp.replica_checks"] == 3 and "ddp.replica_checks" not in c1  # at each checkpoint and at the end
    assert c2["train.kda_path.torch"] == 2 * c1["train.kda_path.torch"]  # counters add up over ranks: a call per block per rank
    assert out.count("[pretrain] step:30 eval_bpb") == 1  # rank 0 reports; the others stay quiet


@pytest.mark.slow  # ~40 s
def test_two_processes_of_micro_batches_train_like_one_whole_batch(shards, tmp_path):
    """train.micro_batch_size 1: each rank's 2 rows as 2 micro-batches, DDP's all-reduce on the second only (no_sync
    on the first); the same run as one process taking the 4 rows at once."""
    job, out_dir = job_json(shards, set_model(shards, TINY_MODEL, ADAMW))
    run_stage(shards, job)
    one = result(shards, out_dir)
    job, out_dir = job_json(shards, set_model(shards, TINY_MODEL, {**ADAMW, "micro_batch_size": 1}))
    finish(torchrun(shards, job, tmp_path / "w2.log"), tmp_path / "w2.log")
    two = result(shards, out_dir)
    assert_same_run(one, two)
    assert two["manifest"]["counters"]["train.micro_batches"] == 2 * 2 * 30  # ranks x parts x steps
    assert "train.micro_batches" not in one["manifest"]["counters"]


@pytest.mark.slow  # ~30 s
def test_checkpoint_of_two_processes_resumes_in_one(shards, tmp_path):
    config = set_model(shards, TINY_MODEL, ADAMW)  # a checkpoint every 5 steps
    job, out_dir = job_json(shards, config)
    run_stage(shards, job)
    reference = result(shards, out_dir)
    shutil.rmtree(shards / out_dir)

    log = tmp_path / "w2.log"
    proc = torchrun(shards, job, log)
    scratch = shards / "results" / "scratch" / "pretrain" / Path(out_dir).name
    deadline = time.monotonic() + 300
    while not list(scratch.glob("step-*/snapshot.json")):
        assert proc.poll() is None, f"finished before the first checkpoint; raise steps\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, workers
    for pid in workers:  # both ranks die at once, mid-step (a lost node)
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    assert not (shards / out_dir / "manifest.json").exists()

    run_stage(shards, job)  # one process resumes the two-process checkpoint
    resumed = result(shards, out_dir)
    c = resumed["manifest"]["counters"]
    assert c["resumed_from_step"] >= 5 and c["resumed_from_step"] % 5 == 0
    assert resumed["manifest"]["final"]["world_size"] == 1
    assert_same_run(reference, resumed)
    assert not scratch.exists()


@pytest.mark.slow  # ~25 s
def test_moe_aux_loss_does_not_depend_on_the_world_size(shards, tmp_path):
    config = set_model(shards, {**TINY_MODEL, "moe": True, "n_experts": 4}, {**ADAMW, "steps": 20, "ckpt_every": 100})
    job, out_dir = job_json(shards, config)
    run_stage(shards, job)
    one = result(shards, out_dir)
    shutil.rmtree(shards / out_dir)
    finish(torchrun(shards, job, tmp_path / "w2.log"), tmp_path / "w2.log")
    assert_same_run(one, result(shards, out_dir))  # measured: 1e-3 relative loss at step 20 (0 with moe_aux_coef 0)


NAN_ON_RANK_1 = """
import os, sys
from dormouse.cli import main
from dormouse.model.gpt import ByteLM

real_forward = ByteLM.forward
calls = 0


def forward(self, idx, targets=None, counters=None):
    global calls
    logits, loss = real_forward(self, idx, targets, counters)
    if targets is not None:
        calls += 1
        if calls == 3 and os.environ["RANK"] == "1":  # one rank's loss only
            loss = loss * float("nan")
    return logits, loss


ByteLM.forward = forward
sys.exit(main(["pretrain", *sys.argv[1:]]))
"""


@pytest.mark.slow  # ~15 s
def test_one_ranks_nonfinite_loss_skips_the_step_on_every_rank(shards, tmp_path):
    config = set_model(shards, TINY_MODEL, {**TINY_TRAIN, "steps": 8, "ckpt_every": 100, "eval_every": 8})
    job, out_dir = job_json(shards, config)
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text(NAN_ON_RANK_1)
    log = tmp_path / "w2.log"
    finish(torchrun(shards, job, log, entry=(str(script),)), log)  # no hang: the ranks agreed before backward
    m = json.loads((shards / out_dir / "manifest.json").read_text())
    c = m["counters"]
    assert c["train.steps_skipped_nonfinite"] == 1  # counted once, not once per rank
    assert c["train.steps"] == 8 and m["final"]["world_size"] == 2
    assert c["ddp.replica_checks"] == 1  # Muon stepped identically on every rank: the weights are equal


def test_batch_not_divisible_by_the_world_size_is_refused(shards, tmp_path):
    config = set_model(shards, TINY_MODEL, {**TINY_TRAIN, "batch_size": 5})
    job, out_dir = job_json(shards, config)
    log = tmp_path / "w2.log"
    proc = torchrun(shards, job, log)
    proc.wait(timeout=300)
    assert proc.returncode != 0
    assert "train.batch_size 5 is not divisible by the world size 2" in log.read_text()
    assert not (shards / out_dir).exists()


def plan_with(workdir: Path, corpus, quality, **presets) -> Plan:
    """A plan whose presets are tiny with the given changes ({"train": {...}, "resources": {...}})."""
    tiny = yaml.safe_load((workdir / "config" / "presets" / "tiny.yaml").read_text())
    for name, change in presets.items():
        preset = {**tiny, **{k: {**tiny.get(k, {}), **v} for k, v in change.items()}}
        (workdir / "config" / "presets" / f"{name}.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    return plan_in(workdir, configure(workdir, corpus, *quality, presets=tuple(presets)))


def test_gpu_count_is_a_preset_resource_outside_the_digest(workdir, small_corpus, quality_examples):
    cuda = {"device": "cuda", "batch_size": 8}
    plan = plan_with(workdir, small_corpus, quality_examples,
                     one={"train": cuda}, two={"train": cuda, "resources": {"gpus": 2}},
                     four={"train": cuda, "resources": {"gpus": 4}}, cpu={"train": {"batch_size": 8}})
    pretrain = {name: plan.chain[name]["pretrain"] for name in ("one", "two", "four", "cpu")}
    assert pretrain["one"] == pretrain["two"] == pretrain["four"] != pretrain["cpu"]  # not a param
    assert plan.gpus("pretrain", pretrain["one"]) == 4  # one job for three presets: the largest count
    assert plan.gpus("pretrain", pretrain["cpu"]) == 0
    assert plan.gpus("sft", plan.chain["four"]["sft"]) == 1  # the other stages hold one GPU

    with pytest.raises(ConfigError, match="train.batch_size 8 is not a multiple of resources.gpus 3"):
        plan_with(workdir, small_corpus, quality_examples, three={"train": cuda, "resources": {"gpus": 3}})
    with pytest.raises(ConfigError, match="resources.gpus 2 needs train.device cuda"):
        plan_with(workdir, small_corpus, quality_examples, cpu={"resources": {"gpus": 2}})


def test_memory_and_time_requests_come_from_the_preset_outside_the_digest(workdir, small_corpus, quality_examples):
    plan = plan_with(workdir, small_corpus, quality_examples,
                     short={"resources": {"mem_gb": {"pretrain": 2}, "runtime_min": {"pretrain": 10}}},
                     long={"resources": {"mem_gb": {"pretrain": 6}, "runtime_min": {"pretrain": 600}}},
                     plain={})
    pretrain = plan.chain["short"]["pretrain"]
    assert pretrain == plan.chain["long"]["pretrain"] == plan.chain["plain"]["pretrain"]  # not a param
    assert (plan.mem_mb("pretrain", pretrain), plan.runtime_min("pretrain", pretrain)) == (6000, 600)  # the largest
    alone = plan_with(workdir, small_corpus, quality_examples,
                      short={"resources": {"mem_gb": {"pretrain": 2}, "runtime_min": {"pretrain": 10}}})
    digest = alone.chain["short"]["pretrain"]
    assert (alone.mem_mb("pretrain", digest), alone.runtime_min("pretrain", digest)) == (2000, 10)
    assert alone.runtime_min("sft", alone.chain["short"]["sft"]) == 360  # a stage the preset leaves: the schema's


def test_the_shipped_presets_size_their_jobs(workdir, small_corpus, quality_examples):
    plan = plan_in(workdir, configure(workdir, small_corpus, *quality_examples, presets=("tiny", "b1")))
    tiny, b1 = plan.chain["tiny"]["pretrain"], plan.chain["b1"]["pretrain"]
    assert plan.runtime_min("pretrain", tiny) == 30 and plan.mem_mb("pretrain", tiny) == 4000
    assert plan.runtime_min("pretrain", b1) == 720
