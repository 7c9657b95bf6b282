"""The pretrain loop over its steps: each step's schedule, batch and PretrainStep; the log, eval and checkpoint rows
at their intervals; the counters of every rank summed. The pretrain stage builds the pieces, resumes or branches,
runs `PretrainLoop.run` and writes the artifact from what it holds."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from dormouse.core import progress
from dormouse.train import checkpoint, compile_cache, distributed, qat
from dormouse.train.finish import KEPT
from dormouse.train.firewall import Firewall
from dormouse.train.optim import set_lr, wsd_multiplier
from dormouse.train.qat import FakeQuant
from dormouse.train.runtime import LN2, evaluate
from dormouse.train.settings import TrainSettings


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


def eval_bpb(model, ex, ey, train: TrainSettings, device, counters: Counter, world: distributed.World) -> float:
    """BPB on the fixed eval window. Several ranks split its rows and add up bits and bytes: the same
    BPB as one process up to reduction order."""
    if world.size == 1:
        return evaluate(model, ex, ey, train.batch_size, device, train.dtype, counters)
    rows = world.rows(len(ex))
    x, y = ex[rows.start : rows.stop], ey[rows.start : rows.stop]
    bits = evaluate(model, x, y, train.batch_size, device, train.dtype, counters) * y.numel() if len(rows) else 0.0
    total_bits, n_bytes = distributed.all_sum(torch.tensor([bits, float(y.numel())], dtype=torch.float64, device=device), world)
    return total_bits / n_bytes


class PretrainLoop:
    """Steps `start`..train.steps of one run. Holds what the artifact is written from: `metrics`, this process's
    `train_counters` / `eval_counters` and the resumed run's (`resumed_train` / `resumed_eval`), the time to the first
    step. `window` is the eval window (ex, ey, eval bytes); `fq` the finish's FakeQuant from step `qat_from`."""

    def __init__(self, *, model, opts, step_fn, stream, train: TrainSettings, device, world: distributed.World, window,
                 fq, qat_from: int, keep_steps: set[int], ckpt_root: Path, c: Counter, compiled: list, say,
                 snap: dict | None, branched: dict | None):
        self.model, self.opts, self.step_fn, self.stream, self.train = model, opts, step_fn, stream, train
        self.device, self.world, self.window, self.fq, self.qat_from = device, world, window, fq, qat_from
        self.keep_steps, self.ckpt_root, self.c, self.compiled, self.say = keep_steps, ckpt_root, c, compiled, say
        self.branched = branched
        snap = snap or {}
        self.metrics: list[dict] = snap.get("metrics", [])
        self.resumed_train = Counter(snap.get("train_counters", {}))  # every rank's counts up to the checkpoint
        self.resumed_eval = Counter(snap.get("eval_counters", {}))
        self.train_counters, self.eval_counters = Counter(), Counter()  # this process's counts since it started
        self.first_step_s = None  # no step left to run (a resume at the end)
        self.firewall = step_fn.firewall
        self.firewall.resume(snap.get("bad_in_row", 0))

    def run(self, start: int, t_main: float, net) -> None:
        train = self.train
        self.t_last, self.bytes_last = time.time(), 0
        meter = progress.Meter("pretrain", "step", train.steps, start)
        net.train()
        for step in range(start, train.steps):
            self.step(step)
            if step == start:  # one sync: the first step's kernels (compile, autotune, graph capture) have run
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.first_step_s = round(time.time() - t_main, 1)
                self.say(f"[pretrain] time to first step: {self.first_step_s} s (since the stage started: load, compile, "
                         f"capture, step {step + 1})", flush=True)
            if step == start + 1 and self.compiled and self.world.is_main:  # the step's graphs exist
                compile_cache.save(self.device, self.c, self.say)
            done = step + 1
            kept = done in self.keep_steps
            if any(done % every == 0 for every in (train.log_every, train.eval_every, train.ckpt_every)) or done == train.steps or kept:
                self.model.take_routing(self.train_counters)  # one host read, and before eval counts its own
            row = self.row(done)
            if row:
                self.metrics.append(row)
                self.say(f"[pretrain] {json.dumps(row)}", flush=True)
                meter.update(done, bpb=row.get("bpb"), eval_bpb=row.get("eval_bpb"),
                             **({"bytes/s": progress.rate(row["tokens_per_s"])} if "tokens_per_s" in row else {}))
            periodic = done % train.ckpt_every == 0 and done < train.steps
            if periodic or kept:
                self.save(done, periodic, kept)
        read_firewall(self.firewall, self.train_counters, self.world, "the end")

    def step(self, step: int) -> None:
        train, step_fn = self.train, self.step_fn
        set_lr(self.opts, wsd_multiplier(step, train.steps, train.warmup_steps, train.decay_frac,
                                         train.min_lr_frac))
        x, y = self.stream.next_batch()  # this rank's rows of the global batch
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        step_fn.qat = self.fq if step >= self.qat_from else None
        if step_fn.graphs == "graphed" and step_fn.graphed is None and step_fn.qat is None:
            self.c["cuda_graphs.captures"] += 1
        step_fn(x, y, self.train_counters, f"step {step}")
        if step_fn.qat is not None and self.world.is_main:
            self.train_counters["qat.steps"] += 1
        self.c["train.steps_run_this_process"] += 1
        self.bytes_last += x.numel() * self.world.size

    def row(self, done: int) -> dict | None:
        """The metrics row of step `done`: loss and throughput at log steps, eval BPB at eval steps (through the
        finish's rung from its start, and at the end always)."""
        train, row = self.train, None
        if done % train.log_every == 0 or done == train.steps:
            mean_loss = read_firewall(self.firewall, self.train_counters, self.world, f"step {done}")
            now = time.time()
            row = {"step": done, "loss": round(mean_loss, 5), "bpb": round(mean_loss / LN2, 5),
                   "lr": self.opts[-1].param_groups[0]["lr"],
                   "tokens_per_s": round(self.bytes_last / max(now - self.t_last, 1e-9), 1),
                   "epochs": round(self.stream.epochs_seen(), 4)}
            self.t_last, self.bytes_last = now, 0
        if done % train.eval_every == 0 or done == train.steps:
            row = row or {"step": done}
            fq = self.fq
            rung_eval = fq if fq is not None and (done > self.qat_from or done == train.steps) else None
            with qat.through(rung_eval):
                row["eval_bpb"] = round(self.eval_bpb(), 5)
            row["eval_bytes"] = self.window[2]
            if rung_eval is not None:
                row["eval_rung"] = rung_eval.rung
                if self.world.is_main:
                    self.eval_counters["qat.evals"] += 1
            self.say(f"[pretrain] step:{done} eval_bpb:{row['eval_bpb']:.4f} eval_bytes:{self.window[2]}", flush=True)
        return row

    def eval_bpb(self) -> float:
        ex, ey, _ = self.window
        return eval_bpb(self.model, ex, ey, self.train, self.device, self.eval_counters, self.world)

    def final_evals(self) -> tuple[float | None, dict]:
        """(the master weights' BPB beside the finish's rung, None without a finish; {rung: BPB} of the final weights
        through each of train.ptq_rungs' forwards: post-training quantization). Collectives: every rank evaluates."""
        master_bpb = self.eval_bpb() if self.fq is not None else None
        ptq_bpb = {}
        for rung in self.train.ptq_rungs or ():
            with FakeQuant(self.model, rung).applied():
                ptq_bpb[rung] = round(self.eval_bpb(), 5)
            if self.world.is_main:
                self.eval_counters[f"ptq.{rung}.evals"] += 1
        return master_bpb, ptq_bpb

    def totals(self) -> tuple[Counter, Counter]:
        """The whole run's train and eval counters so far (a collective)."""
        return (totals(self.resumed_train, self.train_counters, self.world),
                totals(self.resumed_eval, self.eval_counters, self.world))

    def save(self, done: int, periodic: bool, kept: bool) -> None:
        """A checkpoint at step `done`: the rotating one (periodic) and/or a kept one (train.keep_checkpoints)."""
        world = self.world
        read_firewall(self.firewall, self.train_counters, world, f"step {done}")
        if world.is_main and periodic:
            self.train_counters["checkpoints_written"] += 1  # before the save, so a resumed run counts it too
        snap_train, snap_eval = self.totals()
        if distributed.check_replicas(self.model, world):  # rank 0 saves what every rank holds
            self.c["ddp.replica_checks"] += 1
        if world.is_main:
            state = {"stream": self.stream.state.to_dict(), "metrics": self.metrics,
                     "bad_in_row": self.firewall.bad_in_row, "train_counters": dict(snap_train),
                     "eval_counters": dict(snap_eval), **({"branched_from": self.branched} if self.branched else {})}
            # the kept one first: a kill between the two saves then resumes before this step and saves both
            # again (the other way round, the resume would start at this step and never keep it)
            if kept:  # beside the rotating ones, never pruned: the artifact takes it at the end
                checkpoint.save(self.ckpt_root / KEPT, done, self.model, self.opts, state, keep=len(self.keep_steps))
            if periodic:
                checkpoint.save(self.ckpt_root, done, self.model, self.opts, state)
        distributed.barrier(world)
