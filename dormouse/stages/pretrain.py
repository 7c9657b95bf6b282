"""pretrain: train the byte LM on the train shards; evaluate BPB on a fixed window of the eval tail.

    dormouse pretrain --job "$(dormouse plan --preset tiny --stage pretrain)"
    torchrun --standalone --nproc-per-node 8 -m dormouse.cli pretrain --job ...   # data-parallel (DDP)

Checkpoints go to the digest-keyed scratch dir (results/scratch/pretrain/<digest>/) every `ckpt_every` steps; a rerun
resumes from the latest one. On CPU (deterministic kernels, one thread) the resumed run reaches bit-identical weights;
on CUDA it continues from the same state but kernel nondeterminism can change the last bits. The artifact holds
model.safetensors, config.json and metrics.jsonl; the manifest's counters prove which arms ran in training (train.*)
and in eval (eval.*).

Under torchrun (WORLD_SIZE > 1) the stage runs data-parallel: the global batch is still train.batch_size rows (a
multiple of the world size), each rank trains on its contiguous slice of every batch and DistributedDataParallel
averages the gradients, so the run differs from one process only by floating-point reduction order; the world size is
no param and not in the digest. Rank 0 writes the checkpoints and the artifact (the pretrain view appends the history
entry); a checkpoint resumes under any world size.

A non-finite step is skipped whole (dormouse/train/firewall.py); on CUDA that decision stays on the device, so no step
waits for the GPU: the loss and the counts reach the host at log and checkpoint steps.

`train.qat: {rung, fraction}` is a quantization-aware finish (dormouse/train/qat.py): the last `fraction` of the steps
train through the forward of the rung's export file, straight through to the fp32 master weights the artifact holds.
Every eval from the finish's start, and the final one always, sees the rung (its metrics row says `eval_rung`), so
`final.eval_bpb` is the rung's BPB, what export measures on the file (fraction 0: the post-training quantization of
the final weights); `final.eval_bpb_master` is the master weights' own. The counters prove the finish ran:
train.qat.steps, qat.tensors.<rung> (and .bf16), qat.tensors_moved, eval.qat.evals and cuda_graphs.eager_steps_qat for
graphed steps that ran eagerly through the rung.

`train.keep_checkpoints: [steps]` keeps those steps' checkpoints in the artifact (checkpoints/step-N/). A job with a
`trunk` input (an experiment with `branch: true`: each QAT arm's trunk is its seed's control) starts from the trunk's
kept checkpoint at its finish's first step, after checking that the trunk trained the same params up to there, so only
the finish trains; counted as train.branched_from_step, and `final.branched_from` names the trunk's digest, step and
kept weights' sha256 (a GPU rebuild of the trunk has the same digest, other weights: the verdict checks them).

`train.ptq_rungs: [...]` evaluates the final weights through each listed rung's forward as well (post-training
quantization, what export measures on a PTQ rung file): `final.eval_bpb_ptq: {rung: BPB}`, counted as
eval.ptq.<rung>.evals. One control run then serves a QAT experiment's arms of several rungs.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from dormouse.data import shards as layout
from dormouse.data.byte_stream import StreamState, TrainStream, check_epochs, eval_window
from dormouse.core import progress
from dormouse.planner.job import input_artifact, parse_job, summary, writer
from dormouse.core.store import scratch_dir
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM, count_params
from dormouse.model.kda import fla_op
from dormouse.train import compile_cache, distributed, qat
from dormouse.train.finish import KEPT, branch, keep_checkpoints, qat_finish, qat_summary
from dormouse.train.loop import PretrainLoop
from dormouse.train.optim import build_optimizers
from dormouse.train.runtime import (check_arms_active, compile_for, deterministic_cpu, device_facts, device_for,
                                    save_model_artifact)
from dormouse.train.settings import TrainSettings
from dormouse.train.trainer import PretrainStep, resume


def main(argv=None) -> int:
    t_main = time.time()  # time to first step counts from here (imports before it: a few seconds)
    job = parse_job(argv, "pretrain", __doc__)
    cfg = ModelConfig.from_dict(job["params"]["model"])
    train = TrainSettings.of(job["params"]["train"])
    world = distributed.world_from_env()
    if train.batch_size % world.size:
        raise SystemExit(f"pretrain: train.batch_size {train.batch_size} is not divisible by the world size {world.size} "
                         f"(WORLD_SIZE): every rank trains on an equal slice of the global batch; use a multiple of the GPU count")
    rows, micro = train.batch_size // world.size, train.micro_batch_size
    if micro and micro < rows and rows % micro:
        raise SystemExit(f"pretrain: train.micro_batch_size {micro} does not divide each rank's {rows} rows "
                         f"(train.batch_size {train.batch_size} over {world.size} processes)")
    shards = input_artifact(job, "shard")
    who = f"preset {', '.join(job['presets'])}" if job.get("presets") else f"pretrain job {job['digest']}"
    check_epochs(f"pretrain: {who}", layout.train_bytes(shards.manifest), shards.path, steps=train.steps,  # no device yet
                 batch_size=train.batch_size, seq_len=train.seq_len, max_epochs=train.max_epochs)
    device = distributed.init(world, device_for(train.device))
    try:
        run(job, cfg, train, shards, world, device, t_main)
    finally:
        distributed.shutdown()
    return 0


def run(job: dict, cfg: ModelConfig, train: TrainSettings, shards, world: distributed.World, device: torch.device,
        t_main: float) -> None:
    say = print if world.is_main else (lambda *args, **kwargs: None)
    torch.manual_seed(train.seed)
    deterministic_cpu(device)

    model = ByteLM(cfg).to(device)  # __init__ runs init_weights()
    model.defer_routing = True  # an MoE's routing counts stay on the device until the loop reads them
    n_params = sum(p.numel() for p in model.parameters())
    formula = count_params(cfg)
    assert formula["total"] == n_params, f"param formula {formula} != model {n_params}"
    say(f"[pretrain] params {n_params:,} (formula {formula}) device {device} world_size {world.size}", flush=True)
    opts = build_optimizers(model, train.optim)
    cache_counts = Counter()
    compiled = compile_for(model, device, train.compile)
    if compiled:
        compile_cache.load(device, cache_counts, say)
    say(f"[pretrain] torch.compile regions: {len(compiled)} ({train.compile})", flush=True)
    if device.type == "cuda" and fla_op("chunk_kda") is None and world.is_main:  # counted as kda_path.torch too
        progress.note("[pretrain] WARNING: fla-core is not importable, so KDA runs its torch path on the GPU "
                      "(several times slower): pip install '.[cuda]' (fla-core, triton and torch at the tested pins)")
    fq, qat_from = qat_finish(model, train, say)

    with (writer(job) if world.is_main else nullcontext()) as art:
        c = art.counters if world.is_main else Counter()  # the manifest's own counters (rank 0)
        c["compile.regions"] = len(compiled)
        c.update(cache_counts)
        ckpt_root = scratch_dir(Path(job["out"]))  # the same path on every rank; rank 0 writes it
        stream = TrainStream(layout.train_bins(shards),
                             train.batch_size, train.seq_len, train.seed, rows=world.rows(train.batch_size))
        window = eval_window(layout.eval_bin(shards), train.eval_bytes, train.seq_len)
        last, snap = resume(ckpt_root, model, opts, c)
        if last is not None:
            c["resumed_from_step"] = snap["step"]
            say(f"[pretrain] resumed from {last}", flush=True)
        elif "trunk" in job["inputs"]:  # a finish continues its trunk's steps from the trunk's kept checkpoint
            last, snap = branch(input_artifact(job, "trunk"), job["params"], model, opts, qat_from)
            say(f"[pretrain] branched from {last}: steps {qat_from}.. train here", flush=True)
            # in the train counters, so later checkpoints of this run carry it to the manifest (train.branched_from_step)
            snap["train_counters"] = {**snap["train_counters"], "branched_from_step": snap["step"]}
        if last is not None:
            stream.state = StreamState(**snap["stream"])
        # DDP averages the gradients over ranks in backward (= the gradient of the global batch mean);
        # Muon and AdamW then step on identical full gradients on every rank.
        net = model if world.size == 1 else DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        step_fn = PretrainStep(model, opts, cfg, train, device, world, net)  # graphs captured on its first call
        if step_fn.graphs.startswith("refused"):
            c[f"cuda_graphs.{step_fn.graphs}"] = 1
            say(f"[pretrain] train.cuda_graphs: {step_fn.graphs}; the step runs eagerly", flush=True)
        loop = PretrainLoop(model=model, opts=opts, step_fn=step_fn, stream=stream, train=train, device=device,
                            world=world, window=window, fq=fq, qat_from=qat_from,
                            keep_steps=set(train.keep_checkpoints), ckpt_root=ckpt_root, c=c,
                            compiled=compiled, say=say, snap=snap if last is not None else None,
                            branched=(snap or {}).get("branched_from"))  # which build of the trunk: final.branched_from
        loop.run(snap["step"] if last is not None else 0, t_main, net)
        finish(job, loop, art, cfg, formula, compiled)
    distributed.barrier(world)  # the other ranks wait until the artifact is in place


def finish(job: dict, loop: PretrainLoop, art, cfg: ModelConfig, formula: dict, compiled: list) -> None:
    """The final evals (the master weights beside the rung's, train.ptq_rungs), the counters checked and filed, the
    artifact written (rank 0) with its kept checkpoints."""
    model, train, world, fq, c, say = loop.model, loop.train, loop.world, loop.fq, loop.c, loop.say
    master_bpb, ptq_bpb = loop.final_evals()
    train_total, eval_total = loop.totals()
    if distributed.check_replicas(model, world):
        c["ddp.replica_checks"] += 1
    if not world.is_main:
        return
    check_arms_active(cfg, train_total, "training")
    check_arms_active(cfg, eval_total, "eval")
    for prefix, total in (("train", train_total), ("eval", eval_total)):
        for k, v in total.items():
            c[f"{prefix}.{k}"] = v
    c["train.steps"] = train.steps
    if loop.step_fn.graphed is not None:
        c["cuda_graphs.replays_this_process"] = loop.step_fn.replays
    c["train.bytes_seen"] = loop.stream.bytes_seen()
    c["eval.window_bytes"] = eval_bytes = loop.window[2]
    final = {
        "eval_bpb": loop.metrics[-1].get("eval_bpb"), "eval_bytes": eval_bytes, "params": formula,
        "epochs": round(loop.stream.epochs_seen(), 4), "train_bytes_seen": loop.stream.bytes_seen(),
        "device": str(loop.device), "world_size": world.size, "optimizers": [type(o).__name__ for o in loop.opts],
        "time_to_first_step_s": loop.first_step_s,  # this process's (a resumed run's own)
    }
    if ptq_bpb:
        final["eval_bpb_ptq"] = ptq_bpb
    if loop.branched:
        final["branched_from"] = loop.branched
    lineage = []
    if fq is not None:
        final["eval_bpb_master"] = round(master_bpb, 5)
        # this process's forwards through the rung (rank 0's): a step's micro-batches each enter it
        here = (loop.train_counters["qat.steps"] * loop.step_fn.parts(len(world.rows(train.batch_size)))
                + loop.eval_counters["qat.evals"])
        final["qat"] = qat_summary(c, fq, train, loop.qat_from, train_total, loop.step_fn, here)
        lineage.append(qat.lineage_entry("pretrain", final["qat"]))
    if compiled:  # the eval's graphs too, when this process compiled them
        compile_cache.save(loop.device, c, say)
    # config.json holds `qat` only when a stage trained through a rung: the lineage sft and rl extend and export reads
    save_model_artifact(art, model, {"model": cfg.to_dict(), "train": job["params"]["train"], "params": formula,
                                     **({"qat": lineage} if lineage else {})}, loop.metrics)
    art.extra["final"] = final | device_facts(loop.device)
    keep_checkpoints(art, loop.ckpt_root / KEPT, loop.keep_steps)
    if loop.keep_steps:
        c["checkpoints_kept"] = len(loop.keep_steps)
    summary("pretrain", c)
