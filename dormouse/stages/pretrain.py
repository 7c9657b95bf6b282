"""pretrain: train the byte LM on the train shards; evaluate BPB on a fixed window of the eval tail.

    dormouse pretrain --job "$(dormouse plan --preset tiny --stage pretrain)"

Checkpoints go to the digest-keyed scratch dir (results/scratch/pretrain/<digest>/) every
`ckpt_every` steps; a rerun resumes from the latest one. On CPU (deterministic kernels, one thread)
the resumed run reaches bit-identical weights; on CUDA it continues from the same state but
kernel nondeterminism can change the last bits. The artifact holds model.safetensors, config.json and metrics.jsonl; the manifest's
counters prove which arms ran in training (train.*) and in eval (eval.*).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from dormouse import checkpoint, history
from dormouse.byte_stream import StreamState, TrainStream, eval_window
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM, count_params
from dormouse.optim import build_optimizers, set_lr, wsd_multiplier
from dormouse.runtime import LN2, autocast, check_arms_active, deterministic_cpu, device_for, evaluate
from dormouse.stage import input_artifact, parse_job, summary, writer


class BadStepsError(RuntimeError):
    pass


def main(argv=None) -> int:
    job = parse_job(argv, "pretrain", __doc__)
    cfg = ModelConfig.from_dict(job["params"]["model"])
    train = job["params"]["train"]
    shards = input_artifact(job, "shard")
    device = device_for(train)
    torch.manual_seed(train["seed"])
    deterministic_cpu(device)

    model = ByteLM(cfg).to(device)  # __init__ runs init_weights()
    n_params = sum(p.numel() for p in model.parameters())
    formula = count_params(cfg)
    assert formula["total"] == n_params, f"param formula {formula} != model {n_params}"
    print(f"[pretrain] params {n_params:,} (formula {formula}) device {device}", flush=True)
    opts = build_optimizers(model, train)

    with writer(job) as art:
        c = art.counters
        ckpt_root = art.scratch
        stream = TrainStream([shards.file(n) for n in shards.files("train/") if n.endswith(".bin")],
                             train["batch_size"], train["seq_len"], train["seed"])
        ex, ey, eval_bytes = eval_window(shards.file("eval/tail.bin"), train["eval_bytes"], train["seq_len"])
        metrics: list[dict] = []
        start, bad_in_row = 0, 0
        train_counters, eval_counters = Counter(), Counter()

        last = checkpoint.latest(ckpt_root)
        if last is not None:
            snap = checkpoint.load_snapshot(last)
            checkpoint.load_weights(model, last / checkpoint.WEIGHTS)
            checkpoint.load_optimizers(opts, last / checkpoint.OPTIM)
            stream.state = StreamState(**snap["stream"])
            start, metrics, bad_in_row = snap["step"], snap["metrics"], snap["bad_in_row"]
            train_counters, eval_counters = Counter(snap["train_counters"]), Counter(snap["eval_counters"])
            c["resumed_from_step"] = start
            print(f"[pretrain] resumed from {last}", flush=True)

        params = [p for p in model.parameters()]
        t_last, bytes_last = time.time(), 0
        model.train()
        for step in range(start, train["steps"]):
            mult = wsd_multiplier(step, train["steps"], train["warmup_steps"], train["decay_frac"], train["min_lr_frac"])
            set_lr(opts, mult)
            x, y = stream.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, train):
                _, loss = model(x, y, counters=train_counters)
                total = loss + train["moe_aux_coef"] * model.aux_loss if cfg.moe else loss
            ok = bool(torch.isfinite(total))
            if ok:
                total.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, train["grad_clip"])
                ok = bool(torch.isfinite(grad_norm))
            if ok:
                for opt in opts:
                    opt.step()
                bad_in_row = 0
            else:  # the NaN firewall: skip the whole step (no update at all), count it
                train_counters["steps_skipped_nonfinite"] += 1
                bad_in_row += 1
                if bad_in_row > train["max_bad_steps"]:
                    raise BadStepsError(f"pretrain: {bad_in_row} non-finite steps in a row at step {step}; aborting")
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            c["train.steps_run_this_process"] += 1
            bytes_last += x.numel()

            done = step + 1
            row = None
            if done % train["log_every"] == 0 or done == train["steps"]:
                now = time.time()
                row = {"step": done, "loss": round(loss.item(), 5), "bpb": round(loss.item() / LN2, 5),
                       "lr": opts[-1].param_groups[0]["lr"], "tokens_per_s": round(bytes_last / max(now - t_last, 1e-9), 1),
                       "epochs": round(stream.epochs_seen(), 4)}
                t_last, bytes_last = now, 0
            if done % train["eval_every"] == 0 or done == train["steps"]:
                row = row or {"step": done}
                row["eval_bpb"] = round(evaluate(model, ex, ey, train["batch_size"], device, train, eval_counters), 5)
                row["eval_bytes"] = eval_bytes
                print(f"[pretrain] step:{done} eval_bpb:{row['eval_bpb']:.4f} eval_bytes:{eval_bytes}", flush=True)
            if row:
                metrics.append(row)
                print(f"[pretrain] {json.dumps(row)}", flush=True)
            if done % train["ckpt_every"] == 0 and done < train["steps"]:
                train_counters["checkpoints_written"] += 1  # before the save, so a resumed run counts it too
                checkpoint.save(ckpt_root, done, model, opts, {
                    "stream": stream.state.to_dict(), "metrics": metrics, "bad_in_row": bad_in_row,
                    "train_counters": dict(train_counters), "eval_counters": dict(eval_counters),
                })

        check_arms_active(cfg, train_counters, "training")
        check_arms_active(cfg, eval_counters, "eval")
        for k, v in train_counters.items():
            c[f"train.{k}"] = v
        for k, v in eval_counters.items():
            c[f"eval.{k}"] = v
        c["train.steps"] = train["steps"]
        c["train.bytes_seen"] = stream.bytes_seen()
        c["eval.window_bytes"] = eval_bytes
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(art.path("model.safetensors")))
        art.path("config.json").write_text(json.dumps({"model": cfg.to_dict(), "train": train, "params": formula}, indent=1))
        art.path("metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        art.extra["final"] = {
            "eval_bpb": metrics[-1].get("eval_bpb"), "eval_bytes": eval_bytes, "params": formula,
            "epochs": round(stream.epochs_seen(), 4), "train_bytes_seen": stream.bytes_seen(),
            "device": str(device), "optimizers": [type(o).__name__ for o in opts],
        }
        if device.type == "cuda":
            art.extra["final"]["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            art.extra["final"]["gpu"] = torch.cuda.get_device_name(device)
        art.extra["final"]["torch_threads"] = torch.get_num_threads()
        summary("pretrain", c)
    record_history(Path(job["out"]))
    return 0


def record_history(out_dir: Path) -> None:
    """Append the finished run to the benchmark history (`dormouse history`). The artifact is already
    complete: a history problem is reported loudly but does not fail the stage (Snakemake would
    delete a finished artifact's manifest)."""
    try:
        added = history.append(history.DEFAULT_HISTORY, history.entry_from_artifact(out_dir))
        print(f"[pretrain] history {history.DEFAULT_HISTORY}: {'appended' if added else 'already there'}", flush=True)
    except (OSError, ValueError, KeyError) as e:
        print(f"[pretrain] WARNING: history {history.DEFAULT_HISTORY} not updated: {e}", file=sys.stderr, flush=True)
