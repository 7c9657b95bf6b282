"""sft: supervised fine-tuning of the pretrained byte LM on the verifiable task families.

    dormouse sft --job "$(dormouse plan --preset tiny --stage sft)"

Each example is one exchange in the chat template (dormouse/data/chat.py); the task loss counts only the
assistant bytes and the END that closes them. Every step also replays `replay_rows` rows of the train
shards (plain next-byte loss, weight `replay_weight`): without it the tiny preset's corpus BPB went
from 2.96 to 6.41 in 150 steps. Its own warmup-stable-decay schedule and optimizers.
Reported at start and end: held-out task accuracy (greedy exact match on the bench-split items,
dormouse/posttrain/task_eval.py) and held-out corpus BPB on the pretrain eval window (to show forgetting).
The artifact holds model.safetensors, config.json and metrics.jsonl, like pretrain's.
`sft.qat: <rung>` trains the whole stage through the rung's export forward (dormouse/train/qat.py), and its start
and end reports see the rung too; counted as pretrain's finish is (train.qat.steps, qat.tensors.<rung>, ...).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import torch

from dormouse.data import shards as layout
from dormouse.data.byte_stream import TrainStream, eval_window
from dormouse.core import progress
from dormouse.planner.job import input_artifact, parse_job, summary, writer
from dormouse.posttrain import chat_batches, task_eval
from dormouse.posttrain.settings import TaskSettings
from dormouse.train import qat
from dormouse.train.optim import build_optimizers, set_lr, wsd_multiplier
from dormouse.train.settings import OptimSettings
from dormouse.train.runtime import (
    LN2,
    autocast,
    checked_counters,
    deterministic_cpu,
    device_for,
    load_model,
    save_model_artifact,
    update,
    with_moe_aux,
)


def main(argv=None) -> int:
    job = parse_job(argv, "sft", __doc__)
    params = job["params"]
    sft, task_params = params["sft"], params["tasks"]
    device = device_for(params["device"], "sft")
    deterministic_cpu(device)
    torch.manual_seed(sft["seed"])
    pre, shards = input_artifact(job, "pretrain"), input_artifact(job, "shard")
    model, cfg = load_model(pre, device)
    ex, ey, eval_bytes = eval_window(layout.eval_bin(shards), params["eval"]["eval_bytes"], params["eval"]["seq_len"])
    task_set = TaskSettings.of(task_params)
    heldout = task_eval.heldout_items(task_set)
    opts = build_optimizers(model, OptimSettings.of(sft, "sft"))
    params_list = list(model.parameters())
    fq = qat.FakeQuant(model, sft["qat"]) if sft.get("qat") else None
    lineage = qat.upstream_lineage(pre)
    stream = task_eval.item_stream("sft", list(task_set.families), lambda fam, rng: rng.choice(task_set.difficulties),
                                   sft["seed"])
    replay = None
    if sft["replay_rows"]:  # corpus rows from the train shards in every step, against forgetting
        replay = TrainStream(layout.train_bins(shards),
                             sft["replay_rows"], sft["replay_seq_len"], sft["seed"] + 1)

    with writer(job) as art:
        c = art.counters
        train_counters, eval_counters = Counter(), Counter()
        with qat.through(fq):
            start = task_eval.held_out(model, heldout, task_set, params["dtype"], params["eval"]["batch_size"], device, ex, ey, eval_counters)
        progress.note(f"[sft] start: {task_eval.held_out_line(start)}")
        metrics, t0 = [], time.time()
        meter = progress.Meter("sft", "step", sft["steps"])
        model.train()
        for step in range(sft["steps"]):
            set_lr(opts, wsd_multiplier(step, sft["steps"], sft["warmup_steps"], sft["decay_frac"], sft["min_lr_frac"]))
            x, y, n_bytes = chat_batches.sft_batch([next(stream) for _ in range(sft["batch_size"])], device)
            with qat.through(fq), autocast(device, params["dtype"]):
                _, loss = model(x, y, counters=train_counters)
                total = with_moe_aux(loss, model, cfg, params.get("moe_aux_coef"))
                if replay is not None:
                    rx, ry = replay.next_batch()
                    _, replay_loss = model(rx.to(device), ry.to(device), counters=train_counters)
                    total = total + sft["replay_weight"] * with_moe_aux(replay_loss, model, cfg, params.get("moe_aux_coef"))
                    c["train.replay_bytes"] += ry.numel()
            if replay is not None:
                task_loss = loss
                loss = loss + sft["replay_weight"] * replay_loss
            update(total, params_list, opts, sft["grad_clip"], "sft", step)
            if fq is not None:
                train_counters["qat.steps"] += 1
            c["train.assistant_bytes"] += n_bytes
            c["train.examples"] += len(x)
            if (step + 1) % sft["log_every"] == 0 or step + 1 == sft["steps"]:
                task = task_loss if replay is not None else loss
                row = {"step": step + 1, "loss": round(task.item(), 5), "bpb": round(task.item() / LN2, 5),
                       **({"replay_bpb": round(replay_loss.item() / LN2, 5)} if replay is not None else {}),
                       "lr": opts[-1].param_groups[0]["lr"], "elapsed_s": round(time.time() - t0, 2)}
                metrics.append(row)
                print(f"[sft] {json.dumps(row)}", flush=True)
                meter.update(step + 1, bpb=row["bpb"], **({"replay_bpb": row["replay_bpb"]} if "replay_bpb" in row else {}))
        with qat.through(fq):
            end = task_eval.held_out(model, heldout, task_set, params["dtype"], params["eval"]["batch_size"], device, ex,
                                     ey, eval_counters, base=start)
        progress.note(f"[sft] end: {task_eval.held_out_line(end)}")
        checked_counters(c, cfg, train_counters, eval_counters, "sft")
        c["train.steps"] = sft["steps"]
        final = {"start": start, "end": end, "eval_bytes": eval_bytes, "heldout_items": len(heldout), "device": str(device)}
        if fq is not None:
            final["qat"] = qat.file_counters(c, fq, "sft", train_counters["qat.steps"])
            lineage.append(qat.lineage_entry("sft", final["qat"]))
        save_model_artifact(art, model, {"model": cfg.to_dict(), "sft": sft, "tasks": task_params,
                                         **({"qat": lineage} if lineage else {})}, metrics)
        art.extra["final"] = final
        summary("sft", c)
    return 0
