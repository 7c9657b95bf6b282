"""pretrain: train the byte LM on the train shards; evaluate BPB on a fixed window of the eval tail.

    dormouse pretrain --job "$(dormouse plan --preset tiny --stage pretrain)"
    torchrun --standalone --nproc-per-node 8 -m dormouse.cli pretrain --job ...   # data-parallel (DDP)

Checkpoints go to the digest-keyed scratch dir (results/scratch/pretrain/<digest>/) every
`ckpt_every` steps; a rerun resumes from the latest one. On CPU (deterministic kernels, one thread)
the resumed run reaches bit-identical weights; on CUDA it continues from the same state but
kernel nondeterminism can change the last bits. The artifact holds model.safetensors, config.json and metrics.jsonl; the manifest's
counters prove which arms ran in training (train.*) and in eval (eval.*).

Under torchrun (WORLD_SIZE > 1) the stage runs data-parallel: the global batch is still
train.batch_size rows (a multiple of the world size), each rank trains on its contiguous slice of
every batch and DistributedDataParallel averages the gradients, so the run differs from one process
only by floating-point reduction order; the world size is no param and not in the digest. Rank 0
writes the checkpoints and the artifact (the pretrain view appends the history entry); a checkpoint resumes under any world size.

A non-finite step is skipped whole (dormouse/train/firewall.py); on CUDA that decision stays on the device,
so no step waits for the GPU: the loss and the counts reach the host at log and checkpoint steps.

`train.qat: {rung, fraction}` is a quantization-aware finish (dormouse/train/qat.py): the last `fraction` of the
steps train through the forward of the rung's export file, straight through to the fp32 master weights the
artifact holds. Every eval from the finish's start, and the final one always, sees the rung (its metrics row
says `eval_rung`), so `final.eval_bpb` is the rung's BPB, what export measures on the file (fraction 0: the
post-training quantization of the final weights); `final.eval_bpb_master` is the master weights' own. The
counters prove the finish ran: train.qat.steps, qat.tensors.<rung> (and .bf16), qat.tensors_moved, eval.qat.evals and
cuda_graphs.eager_steps_qat for graphed steps that ran eagerly through the rung.

`train.keep_checkpoints: [steps]` keeps those steps' checkpoints in the artifact (checkpoints/step-N/). A job with a
`trunk` input (an experiment with `branch: true`: each QAT arm's trunk is its seed's control) starts from the trunk's
kept checkpoint at its finish's first step, after checking that the trunk trained the same params up to there, so
only the finish trains; counted as train.branched_from_step, and `final.branched_from` names the trunk's digest, step
and kept weights' sha256 (a GPU rebuild of the trunk has the same digest, other weights: the verdict checks them).

`train.ptq_rungs: [...]` evaluates the final weights through each listed rung's forward as well (post-training
quantization, what export measures on a PTQ rung file): `final.eval_bpb_ptq: {rung: BPB}`, counted as
eval.ptq.<rung>.evals. One control run then serves a QAT experiment's arms of several rungs.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

from dormouse.data import shards as layout
from dormouse.data.byte_stream import StreamState, TrainStream, eval_window, planned_epochs
from dormouse.engine import progress
from dormouse.engine.stage import input_artifact, parse_job, summary, writer
from dormouse.engine.store import scratch_dir
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM, count_params
from dormouse.model.kda import fla_op
from dormouse.train import checkpoint, compile_cache, distributed, qat
from dormouse.train.firewall import BadStepsError, Firewall  # noqa: F401 (BadStepsError: the stage's abort)
from dormouse.train.optim import build_optimizers, set_lr, wsd_multiplier
from dormouse.train.arms import before_finish, finish_start
from dormouse.train.qat import FakeQuant
from dormouse.train.runtime import LN2, check_arms_active, compile_for, deterministic_cpu, device_for, evaluate
from dormouse.train.trainer import PretrainStep, resume


def main(argv=None) -> int:
    t_main = time.time()  # time to first step counts from here (imports before it: a few seconds)
    job = parse_job(argv, "pretrain", __doc__)
    cfg = ModelConfig.from_dict(job["params"]["model"])
    train = job["params"]["train"]
    world = distributed.world_from_env()
    if train["batch_size"] % world.size:
        raise SystemExit(f"pretrain: train.batch_size {train['batch_size']} is not divisible by the world size {world.size} "
                         f"(WORLD_SIZE): every rank trains on an equal slice of the global batch; use a multiple of the GPU count")
    rows, micro = train["batch_size"] // world.size, train.get("micro_batch_size")
    if micro and micro < rows and rows % micro:
        raise SystemExit(f"pretrain: train.micro_batch_size {micro} does not divide each rank's {rows} rows "
                         f"(train.batch_size {train['batch_size']} over {world.size} processes)")
    shards = input_artifact(job, "shard")
    check_epochs(job, train, shards)  # before any device is touched
    device = distributed.init(world, device_for(train["device"]))
    try:
        run(job, cfg, train, shards, world, device, t_main)
    finally:
        distributed.shutdown()
    return 0


def run(job: dict, cfg: ModelConfig, train: dict, shards, world: distributed.World, device: torch.device,
        t_main: float) -> None:
    say = print if world.is_main else (lambda *args, **kwargs: None)
    torch.manual_seed(train["seed"])
    deterministic_cpu(device)

    model = ByteLM(cfg).to(device)  # __init__ runs init_weights()
    model.defer_routing = True  # an MoE's routing counts stay on the device until the loop reads them (below)
    n_params = sum(p.numel() for p in model.parameters())
    formula = count_params(cfg)
    assert formula["total"] == n_params, f"param formula {formula} != model {n_params}"
    say(f"[pretrain] params {n_params:,} (formula {formula}) device {device} world_size {world.size}", flush=True)
    opts = build_optimizers(model, train)
    cache_counts = Counter()
    compiled = compile_for(model, device, train)
    if compiled:
        compile_cache.load(device, cache_counts, say)
    say(f"[pretrain] torch.compile regions: {len(compiled)} ({train.get('compile', 'cuda')})", flush=True)
    if device.type == "cuda" and fla_op("chunk_kda") is None and world.is_main:  # counted as kda_path.torch too
        progress.note("[pretrain] WARNING: fla-core is not importable, so KDA runs its torch path on the GPU "
                      "(several times slower): pip install '.[cuda]' (fla-core, triton and torch at the tested pins)")
    fq, qat_from = qat_finish(model, train, say)
    keep_steps = set(train.get("keep_checkpoints") or ())

    with (writer(job) if world.is_main else nullcontext()) as art:
        c = art.counters if world.is_main else Counter()  # the manifest's own counters (rank 0)
        c["compile.regions"] = len(compiled)
        c.update(cache_counts)
        ckpt_root = scratch_dir(Path(job["out"]))  # the same path on every rank; rank 0 writes it
        stream = TrainStream(layout.train_bins(shards),
                             train["batch_size"], train["seq_len"], train["seed"], rows=world.rows(train["batch_size"]))
        ex, ey, eval_bytes = eval_window(layout.eval_bin(shards), train["eval_bytes"], train["seq_len"])
        metrics: list[dict] = []
        start, bad_in_row = 0, 0
        resumed_train, resumed_eval = Counter(), Counter()  # every rank's counts up to the checkpoint resumed from
        train_counters, eval_counters = Counter(), Counter()  # this process's counts since it started

        last, snap = resume(ckpt_root, model, opts, c)
        if last is not None:
            c["resumed_from_step"] = snap["step"]
            say(f"[pretrain] resumed from {last}", flush=True)
        elif "trunk" in job["inputs"]:  # a finish continues its trunk's steps from the trunk's kept checkpoint
            last, snap = branch(job, model, opts, qat_from)
            say(f"[pretrain] branched from {last}: steps {qat_from}.. train here", flush=True)
            # in the train counters, so later checkpoints of this run carry it to the manifest (train.branched_from_step)
            snap["train_counters"] = {**snap["train_counters"], "branched_from_step": snap["step"]}
        branched = (snap or {}).get("branched_from")  # which build of the trunk: final.branched_from
        if last is not None:
            stream.state = StreamState(**snap["stream"])
            start, metrics, bad_in_row = snap["step"], snap["metrics"], snap["bad_in_row"]
            resumed_train, resumed_eval = Counter(snap["train_counters"]), Counter(snap["eval_counters"])
        # DDP averages the gradients over ranks in backward (= the gradient of the global batch mean);
        # Muon and AdamW then step on identical full gradients on every rank.
        net = model if world.size == 1 else DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

        step_fn = PretrainStep(model, opts, cfg, train, device, world, net)  # graphs captured on its first call
        firewall = step_fn.firewall
        firewall.resume(bad_in_row)
        if step_fn.graphs.startswith("refused"):
            c[f"cuda_graphs.{step_fn.graphs}"] = 1
            say(f"[pretrain] train.cuda_graphs: {step_fn.graphs}; the step runs eagerly", flush=True)
        t_last, bytes_last = time.time(), 0
        meter = progress.Meter("pretrain", "step", train["steps"], start)
        first_step_s = None  # no step left to run (a resume at the end)
        net.train()
        for step in range(start, train["steps"]):
            mult = wsd_multiplier(step, train["steps"], train["warmup_steps"], train["decay_frac"], train["min_lr_frac"])
            set_lr(opts, mult)
            x, y = stream.next_batch()  # this rank's rows of the global batch
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            step_fn.qat = fq if step >= qat_from else None
            if step_fn.graphs == "graphed" and step_fn.graphed is None and step_fn.qat is None:
                c["cuda_graphs.captures"] += 1
            step_fn(x, y, train_counters, f"step {step}")
            if step == start:  # one sync: the first step's kernels (compile, autotune, graph capture) have run
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                first_step_s = round(time.time() - t_main, 1)
                say(f"[pretrain] time to first step: {first_step_s} s (since the stage started: load, compile, capture, "
                    f"step {step + 1})", flush=True)
            if step == start + 1 and compiled and world.is_main:  # the step's graphs (forward, backward, optimizer) exist
                compile_cache.save(device, c, say)
            if step_fn.qat is not None and world.is_main:
                train_counters["qat.steps"] += 1
            c["train.steps_run_this_process"] += 1
            bytes_last += x.numel() * world.size

            done = step + 1
            row = None
            kept = done in keep_steps
            if any(done % train[k] == 0 for k in ("log_every", "eval_every", "ckpt_every")) or done == train["steps"] or kept:
                model.take_routing(train_counters)  # one host read, and before eval counts its own
            if done % train["log_every"] == 0 or done == train["steps"]:
                mean_loss = read_firewall(firewall, train_counters, world, f"step {done}")
                now = time.time()
                row = {"step": done, "loss": round(mean_loss, 5), "bpb": round(mean_loss / LN2, 5),
                       "lr": opts[-1].param_groups[0]["lr"], "tokens_per_s": round(bytes_last / max(now - t_last, 1e-9), 1),
                       "epochs": round(stream.epochs_seen(), 4)}
                t_last, bytes_last = now, 0
            if done % train["eval_every"] == 0 or done == train["steps"]:
                row = row or {"step": done}
                rung_eval = fq if fq is not None and (done > qat_from or done == train["steps"]) else None
                with qat.through(rung_eval):
                    row["eval_bpb"] = round(eval_bpb(model, ex, ey, train, device, eval_counters, world), 5)
                row["eval_bytes"] = eval_bytes
                if rung_eval is not None:
                    row["eval_rung"] = rung_eval.rung
                    if world.is_main:
                        eval_counters["qat.evals"] += 1
                say(f"[pretrain] step:{done} eval_bpb:{row['eval_bpb']:.4f} eval_bytes:{eval_bytes}", flush=True)
            if row:
                metrics.append(row)
                say(f"[pretrain] {json.dumps(row)}", flush=True)
                meter.update(done, bpb=row.get("bpb"), eval_bpb=row.get("eval_bpb"),
                             **({"bytes/s": progress.rate(row["tokens_per_s"])} if "tokens_per_s" in row else {}))
            periodic = done % train["ckpt_every"] == 0 and done < train["steps"]
            if periodic or kept:
                read_firewall(firewall, train_counters, world, f"step {done}")
                if world.is_main and periodic:
                    train_counters["checkpoints_written"] += 1  # before the save, so a resumed run counts it too
                snap_train, snap_eval = totals(resumed_train, train_counters, world), totals(resumed_eval, eval_counters, world)
                if distributed.check_replicas(model, world):  # rank 0 saves what every rank holds
                    c["ddp.replica_checks"] += 1
                if world.is_main:
                    state = {"stream": stream.state.to_dict(), "metrics": metrics, "bad_in_row": firewall.bad_in_row,
                             "train_counters": dict(snap_train), "eval_counters": dict(snap_eval),
                             **({"branched_from": branched} if branched else {})}
                    # the kept one first: a kill between the two saves then resumes before this step and saves both
                    # again (the other way round, the resume would start at this step and never keep it)
                    if kept:  # beside the rotating ones, never pruned: the artifact takes it at the end
                        checkpoint.save(ckpt_root / KEPT, done, model, opts, state, keep=len(keep_steps))
                    if periodic:
                        checkpoint.save(ckpt_root, done, model, opts, state)
                distributed.barrier(world)

        read_firewall(firewall, train_counters, world, "the end")
        # the master weights' own BPB beside the rung's (a collective: every rank evaluates)
        master_bpb = eval_bpb(model, ex, ey, train, device, eval_counters, world) if fq is not None else None
        ptq_bpb = {}  # train.ptq_rungs: the final weights through other rungs' forwards (post-training quantization)
        for rung in train.get("ptq_rungs") or ():
            with FakeQuant(model, rung).applied():
                ptq_bpb[rung] = round(eval_bpb(model, ex, ey, train, device, eval_counters, world), 5)
            if world.is_main:
                eval_counters[f"ptq.{rung}.evals"] += 1
        train_total, eval_total = totals(resumed_train, train_counters, world), totals(resumed_eval, eval_counters, world)
        if distributed.check_replicas(model, world):
            c["ddp.replica_checks"] += 1
        if world.is_main:
            check_arms_active(cfg, train_total, "training")
            check_arms_active(cfg, eval_total, "eval")
            for k, v in train_total.items():
                c[f"train.{k}"] = v
            for k, v in eval_total.items():
                c[f"eval.{k}"] = v
            c["train.steps"] = train["steps"]
            if step_fn.graphed is not None:
                c["cuda_graphs.replays_this_process"] = step_fn.replays
            c["train.bytes_seen"] = stream.bytes_seen()
            c["eval.window_bytes"] = eval_bytes
            final = {
                "eval_bpb": metrics[-1].get("eval_bpb"), "eval_bytes": eval_bytes, "params": formula,
                "epochs": round(stream.epochs_seen(), 4), "train_bytes_seen": stream.bytes_seen(),
                "device": str(device), "world_size": world.size, "optimizers": [type(o).__name__ for o in opts],
                "time_to_first_step_s": first_step_s,  # this process's (a resumed run's own)
            }
            if ptq_bpb:
                final["eval_bpb_ptq"] = ptq_bpb
            if branched:
                final["branched_from"] = branched
            lineage = []
            if fq is not None:
                final["eval_bpb_master"] = round(master_bpb, 5)
                # this process's forwards through the rung (rank 0's): a step's micro-batches each enter it
                here = train_counters["qat.steps"] * step_fn.parts(len(world.rows(train["batch_size"]))) + eval_counters["qat.evals"]
                final["qat"] = qat_summary(c, fq, train, qat_from, train_total, step_fn, here)
                lineage.append(qat.lineage_entry("pretrain", final["qat"]))
            if compiled:  # the eval's graphs too, when this process compiled them
                compile_cache.save(device, c, say)
            write_artifact(art, model, cfg, train, formula, metrics, final, device, lineage)
            keep_checkpoints(art, ckpt_root / KEPT, keep_steps)
            if keep_steps:
                c["checkpoints_kept"] = len(keep_steps)
            summary("pretrain", c)
    distributed.barrier(world)  # the other ranks wait until the artifact is in place


def qat_finish(model, train: dict, say) -> tuple[FakeQuant | None, int]:
    """(the finish's FakeQuant or None, its first step; train.steps when off)."""
    spec = train.get("qat")
    if spec is None:
        return None, train["steps"]
    start = finish_start(train["steps"], spec["fraction"])
    if spec["fraction"] > 0 and start == train["steps"]:
        raise SystemExit(f"pretrain: train.qat.fraction {spec['fraction']} of {train['steps']} steps rounds to no step; "
                         "raise it, or set 0 to measure only the final weights' rung")
    fq = FakeQuant(model, spec["rung"])
    say(f"[pretrain] qat: steps {start}..{train['steps'] - 1} train through {spec['rung']} "
        f"({len(fq.quantized)} tensors; the rest bf16, as export writes them)", flush=True)
    return fq, start


def qat_summary(c, fq: FakeQuant, train: dict, start: int, train_total, step_fn: PretrainStep, here: int) -> dict:
    """Counters and the manifest's final.qat; a finish that did not run is a defect, as an inert arm is: every step
    and eval counted through the rung in this process must have entered the rung's forward (fq.applications)."""
    planned, ran = train["steps"] - start, train_total.get("qat.steps", 0)
    if ran != planned:
        raise SystemExit(f"pretrain: the quantization-aware finish planned {planned} steps through {fq.rung}, ran {ran}")
    if fq.applications != here:
        raise SystemExit(f"pretrain: {here} forwards (steps x micro-batches, evals) through {fq.rung} in this process entered its forward "
                         f"{fq.applications} times")
    summary = qat.file_counters(c, fq, "pretrain", ran)
    if step_fn.graphs == "graphed":
        c["cuda_graphs.eager_steps_qat"] = step_fn.eager_steps_qat
    return {**summary, "fraction": train["qat"]["fraction"], "from_step": start}


KEPT = "kept"  # the scratch folder of train.keep_checkpoints


def keep_checkpoints(art, kept_root: Path, steps: set[int]) -> None:
    """train.keep_checkpoints: each kept step's checkpoint (weights, optimizer state, data position, counters) into
    the artifact's checkpoints/, where a finish branches from it (an experiment's `branch`)."""
    for step in sorted(steps):
        src = kept_root / f"step-{step:08d}"
        if not (src / checkpoint.SNAPSHOT).exists():
            raise SystemExit(f"pretrain: train.keep_checkpoints lists step {step}, but {src} holds no checkpoint")
        for name in (checkpoint.WEIGHTS, checkpoint.OPTIM, checkpoint.SNAPSHOT):
            shutil.copyfile(src / name, art.path(f"checkpoints/{src.name}/{name}"))


def branch(job: dict, model, opts, start: int) -> tuple[Path, dict]:
    """Load the trunk's kept checkpoint at this run's finish start: the run continues the trunk's own steps, as a
    resume would, so only the finish trains. The trunk must have trained exactly these params up to there (every
    key but the finish's own, arms.before_finish), which the experiment's plan arranges and this checks."""
    trunk = input_artifact(job, "trunk")
    mine, theirs = before_finish(job["params"]), before_finish(trunk.manifest["params"])
    if mine != theirs:
        differ = sorted(k for sec in ("model", "train") for k in {**mine[sec], **theirs[sec]}
                        if mine[sec].get(k) != theirs[sec].get(k))
        raise SystemExit(f"pretrain: trunk {trunk.path} trained other params than this run before its finish ({differ})")
    own = trunk.manifest["params"]["train"].get("qat")
    if own and finish_start(theirs["train"]["steps"], own["fraction"]) < start:
        raise SystemExit(f"pretrain: trunk {trunk.path} trains through {own['rung']} before step {start}, where this "
                         "run's finish starts: its steps are not this run's")
    name = f"checkpoints/step-{start:08d}"
    if f"{name}/{checkpoint.SNAPSHOT}" not in trunk.manifest["files"]:
        raise SystemExit(f"pretrain: trunk {trunk.path} keeps no checkpoint at step {start}, where this run's finish "
                         f"starts (its kept: {sorted({f.split('/')[1] for f in trunk.files('checkpoints/')})})")
    for f in (checkpoint.WEIGHTS, checkpoint.OPTIM, checkpoint.SNAPSHOT):
        trunk.file(f"{name}/{f}")  # verified against the trunk's manifest
    path = trunk.path / name
    checkpoint.load_weights(model, path / checkpoint.WEIGHTS)
    checkpoint.load_optimizers(opts, path / checkpoint.OPTIM)
    # the build of the trunk, not only its digest (a GPU rebuild of one digest is another build): the verdict checks
    # that an arm and its control are the same build
    built = {"digest": trunk.digest, "step": start,
             "weights_sha256": trunk.manifest["files"][f"{name}/{checkpoint.WEIGHTS}"]["sha256"]}
    return path, {**checkpoint.load_snapshot(path), "branched_from": built}


def write_artifact(art, model, cfg: ModelConfig, train: dict, formula: dict, metrics: list[dict], final: dict,
                   device: torch.device, qat_lineage: list[dict] = ()) -> None:
    """The weights (safetensors), config.json (with `qat`, only when a stage trained through a rung: the lineage sft
    and rl extend and export reads), metrics.jsonl and the manifest's `final` summary."""
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(art.path("model.safetensors")))
    config = {"model": cfg.to_dict(), "train": train, "params": formula, **({"qat": list(qat_lineage)} if qat_lineage else {})}
    art.path("config.json").write_text(json.dumps(config, indent=1))
    art.path("metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if device.type == "cuda":
        final["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)  # rank 0's GPU
        # reserved counts CUDA graphs' private pools, which the allocated peak may leave out
        final["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
        final["gpu"] = torch.cuda.get_device_name(device)
    final["torch_threads"] = torch.get_num_threads()
    art.extra["final"] = final


def train_bytes(shards) -> int:
    """Bytes of the train shards, from the shard manifest (what TrainStream reads)."""
    return layout.train_bytes(shards.manifest)


def check_epochs(job: dict, train: dict, shards) -> None:
    """Refuse a run planned past train.max_epochs passes over its train shards (null: no ceiling)."""
    n = train_bytes(shards)
    passes = planned_epochs(n, train["batch_size"], train["seq_len"], train["steps"])
    if train["max_epochs"] is not None and passes > train["max_epochs"]:
        who = f"preset {', '.join(job['presets'])}" if job.get("presets") else f"pretrain job {job['digest']}"
        budget = train["steps"] * train["batch_size"] * train["seq_len"]
        raise SystemExit(
            f"pretrain: {who} plans {train['steps']} steps x {train['batch_size']} x {train['seq_len']} = {budget:,} bytes, "
            f"{passes:.1f} passes over its {n:,} bytes of train shards ({shards.path}), past train.max_epochs "
            f"{train['max_epochs']}: a repeated corpus is memorised and the eval BPB stops measuring the model. "
            "Bring more text (corpus=...), lower train.steps, or raise train.max_epochs if the repeats are meant.")
    print(f"[pretrain] planned passes over the train shards: {passes:.2f} ({n:,} bytes; max_epochs {train['max_epochs']})",
          flush=True)


def read_firewall(firewall: Firewall, train_counters: Counter, world: distributed.World, where: str) -> float:
    """The last step's loss; skipped steps into the counters (once, not once per rank)."""
    loss = firewall.read(where)
    skipped = firewall.take_skipped()
    if world.is_main and skipped:
        train_counters["steps_skipped_nonfinite"] += skipped
    return loss


def totals(resumed: Counter, local: Counter, world: distributed.World) -> Counter:
    """Counters of the whole run so far: the resumed checkpoint's plus every rank's since (a collective)."""
    out = Counter(resumed)
    out.update(distributed.sum_counters(local, world))  # update, not +: zero counts stay listed
    return out


def eval_bpb(model, ex, ey, train: dict, device, counters: Counter, world: distributed.World) -> float:
    """BPB on the fixed eval window. Several ranks split its rows and add up bits and bytes: the same
    BPB as one process up to reduction order."""
    if world.size == 1:
        return evaluate(model, ex, ey, train["batch_size"], device, train["dtype"], counters)
    rows = world.rows(len(ex))
    x, y = ex[rows.start : rows.stop], ey[rows.start : rows.stop]
    bits = evaluate(model, x, y, train["batch_size"], device, train["dtype"], counters) * y.numel() if len(rows) else 0.0
    total_bits, n_bytes = distributed.all_sum(torch.tensor([bits, float(y.numel())], dtype=torch.float64, device=device), world)
    return total_bits / n_bytes
