"""rl: GRPO on the verifiable task families, the exact verifiers as the reward.

    dormouse rl --job "$(dormouse plan --preset tiny --stage rl)"

Per step: `prompts_per_step` x `oversample` prompts from the rl seed split, `group_size` samples each (temperature,
optional top-k); reward 1 for a verified answer, else 0 (malformed replies are counted apart from wrong ones);
advantage = (r - group mean) / (group std + 1e-4), or r - group mean with `advantage: mean` (Dr. GRPO). A group whose
rewards are all equal carries no learning signal (counted): the step trains on the first `prompts_per_step` groups
that do (DAPO's dynamic sampling), so most of a batch is signal even when most groups are all-wrong. `ppo_epochs`
gradient steps on the clipped-ratio objective against the sampling policy, plus `kl_coef` x the k3 estimate of KL to
the frozen SFT model, plus `replay_weight` x the next-byte loss of `replay_rows` corpus rows (as sft's replay, against
the corpus BPB drifting; 0 rows: none). Loss is averaged over each reply's bytes (the END that stops it included),
then over replies. The lr warms up linearly over `warmup_steps`: a fresh AdamW's first steps are sign steps of the
full lr on every parameter, and on small they moved the policy so far that the second PPO epoch's loss was 3.6 instead
of ~0. `loss_norm: token` weighs every reply byte of the batch alike instead (DAPO). Prompts (`prompts`), over
difficulties curriculum.start..max (max null: the largest of tasks.difficulties, what the dev and held-out sets ask):
`curriculum`: each family unlocks `curriculum.start` first, a prompt's difficulty drawn uniformly from the unlocked
ones, and unlocks the next when the frontier's mean reward over its last `window` groups reaches `promote_at`;
`pass_rate`: each prompt's (family, difficulty) is drawn in proportion to the measured share of that cell's recent
groups that teach (PassRateSampler), so the prompts follow the policy's per-prompt pass rates instead of a fixed
threshold. Counted per cell either way (rl.cell_groups.<family>.<difficulty>, rl.cell_groups_teaching.*). Each seed
starts at its own place in every cell's prompts (task_eval.cell_stream). Model selection
(dormouse/posttrain/selection.py): every `select.every` steps (and at step 0, the SFT model) greedy exact match on the
dev split (task_eval.dev_items: distinct prompts rl never trains on and the held-out set never asks). `select.rule`
bonferroni (default): the most accurate checkpoint whose paired sign test against step 0 on all the dev prompts
(exact, one-sided) reaches p <= alpha / the planned checkpoints ships, else the SFT weights; select_then_confirm: the
best on a select half ships if it beats step 0 on the confirm half at z >= min_z; final: the model rl ends with ships
if it beats step 0 on all the dev prompts at p <= alpha (one planned test). Each ships a checkpoint no better than
step 0 at most ~alpha of the time (benchmarks/rl_selection_sim.py). rl stops early when dev accuracy reaches its
plateau (`select.plateau`). `shuffle_rewards`: the null arm (each group's rewards permuted before the advantages).
`skip_cells`: cells whose groups never teach, left out of rl's prompts (the dev and held-out sets still ask them).
Sampling runs through one `decode.DecodeStep` of every step's rows, kept for the whole stage: on CUDA one graph replay
per byte (the optimizers update the weights in place, so each replay reads the current policy), eager on the CPU and
under `rl.qat` (its fake-quantized weights are new tensors at every step, which a graph would not see); each row draws
from its own seed (from the stage's seeded generator) with `rowrng`. Counted rl.decode_graphed; each step's row in
metrics.jsonl holds its decode, update and dev-check seconds (decode_s, train_s, dev_s). Reports held-out task
accuracy and corpus BPB at start and end (of the selected model), as sft does. `rl.qat: <rung>`: the policy runs
through the rung's export forward everywhere in the stage (sampling, the old and new log-probs, the selection's dev
checks, the reports; dormouse/train/qat.py), so the checkpoint chosen is the best as the rung; the KL reference stays
the SFT weights as they are. Counted as pretrain's finish is.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import torch

from dormouse.data import shards as layout
from dormouse.data.byte_stream import TrainStream, eval_window
from dormouse.core import progress
from dormouse.planner.registry import RL_LATER_DEFAULTS, rl_difficulties, rl_skip_cells
from dormouse.planner.job import input_artifact, parse_job, summary, writer
from dormouse.data import chat
from dormouse.posttrain import task_eval
from dormouse.posttrain.decode import DecodeStep, generate_static
from dormouse.posttrain.grpo import GroupUpdate, GRPOSettings, frozen_copy, prompt_sampler, tally_groups
from dormouse.posttrain.selection import Selection, selection_line
from dormouse.train import qat
from dormouse.train.optim import build_optimizers, set_lr, wsd_multiplier
from dormouse.train.settings import OptimSettings
from dormouse.train.runtime import LN2, checked_counters, deterministic_cpu, device_for, load_model, save_model_artifact, uses_bf16


def held_out(model, fq, heldout, params, device, window, counters) -> dict:
    """Held-out task accuracy and corpus BPB of the model as it stands (through the QAT rung when there is one)."""
    with qat.through(fq):
        return task_eval.held_out(model, heldout, params["tasks"], params["dtype"], params["eval"]["batch_size"],
                                  device, *window, counters)


class Steps:
    """One rl step: sample every prompt's group through the stage's DecodeStep, grade, count, learn from the groups
    that teach, and check dev when due; returns the step's metrics row."""

    def __init__(self, model, fq, decoder, learn, stream, sampler, curriculum, select, opts, rl: dict, s, max_new: int):
        self.model, self.fq, self.decoder, self.learn, self.stream = model, fq, decoder, learn, stream
        self.sampler, self.curriculum, self.select, self.opts, self.rl, self.s = sampler, curriculum, select, opts, rl, s
        self.max_new, self.n_prompts = max_new, rl["prompts_per_step"] * rl["oversample"]
        self.gen = torch.Generator().manual_seed(rl["seed"])  # a CPU generator: the same draws on any device
        self.prompts_seen: dict[str, set[str]] = {}  # per cell: the distinct prompts rl trained on (rl.cell_prompts.*)

    def __call__(self, step: int, c, train_counters) -> dict:
        rl, G = self.rl, self.s.group_size
        set_lr(self.opts, wsd_multiplier(step, rl["steps"], rl["warmup_steps"], 0.0, 1.0))
        items = [next(self.stream) for _ in range(self.n_prompts)]
        unique = [chat.prompt_bytes(it.prompt) for it in items]
        self.model.eval()
        t_step = time.perf_counter()
        seeds = torch.randint(0, 2**63 - 1, (self.n_prompts * G,), generator=self.gen).tolist()
        with torch.no_grad(), qat.through(self.fq):
            replies = generate_static(self.model, unique, self.max_new, temperature=self.s.temperature,
                                      top_k=rl["top_k"], seeds=seeds, samples_per_prompt=G, step=self.decoder)
        t_decoded = time.perf_counter()
        grades = [task_eval.grade(items[j // G], r) for j, r in enumerate(replies)]
        rewards = torch.tensor([float(g == "correct") for g in grades]).view(-1, G)
        keep = tally_groups(c, items, rewards, self.sampler, self.curriculum, self.prompts_seen)[: rl["prompts_per_step"]]
        tally = Counter(grades)
        for k in ("correct", "wrong", "malformed"):
            c[f"rl.samples_{k}"] += tally[k]
        c["rl.groups_trained"] += len(keep)
        if not keep:
            c["rl.steps_without_signal"] += 1
        rows = [i * G + j for i in keep for j in range(G)]
        loss = self.learn([unique[i // G] for i in rows], [replies[i] for i in rows], rewards[keep], step, c,
                          train_counters) if keep else None
        row = {"step": step + 1, "reward": round(float(rewards.mean()), 4), "groups_trained": len(keep),
               "loss": None if loss is None else round(loss.item(), 5), "malformed": tally["malformed"],
               "levels": dict(self.curriculum.level) if self.sampler is None else "pass_rate",
               "decode_s": round(t_decoded - t_step, 3), "train_s": round(time.perf_counter() - t_decoded, 3)}
        if keep and self.learn.replay is not None:
            row["replay_bpb"] = round(self.learn.replay_loss / LN2, 5)
        if self.fq is not None:
            train_counters["qat.steps"] += 1
        if self.select.due(step + 1, rl["steps"]):
            t_dev = time.perf_counter()
            with qat.through(self.fq):
                row["dev_accuracy"] = self.select.check(step + 1)
            row["dev_s"] = round(time.perf_counter() - t_dev, 3)
        return row


def main(argv=None) -> int:
    job = parse_job(argv, "rl", __doc__)
    params = job["params"]
    rl, task_params = params["rl"], params["tasks"]
    device = device_for(params["device"], "rl")
    deterministic_cpu(device)
    torch.manual_seed(rl["seed"])
    sft_art, shards = input_artifact(job, "sft"), input_artifact(job, "shard")
    model, cfg = load_model(sft_art, device)
    ref = frozen_copy(model) if rl["kl_coef"] > 0 else None
    ex, ey, eval_bytes = eval_window(layout.eval_bin(shards), params["eval"]["eval_bytes"], params["eval"]["seq_len"])
    heldout = task_eval.heldout_items(task_params)
    opts = build_optimizers(model, OptimSettings.of(rl, "rl"))
    fq = qat.FakeQuant(model, rl["qat"]) if rl.get("qat") else None
    lineage = qat.upstream_lineage(sft_art)
    later = {k: rl.get(k, v) for k, v in RL_LATER_DEFAULTS.items()}  # keys left out of the digest at their defaults
    skip = frozenset(rl_skip_cells({**rl, "skip_cells": later["skip_cells"]}, task_params))
    stream, sampler, curriculum = prompt_sampler(task_params["families"], rl_difficulties(rl["curriculum"], task_params),
                                                 rl, later["prompts"], skip)
    s = GRPOSettings.of(rl, later, params)
    replay = (TrainStream(layout.train_bins(shards), later["replay_rows"], later["replay_seq_len"], rl["seed"] + 2)
              if later["replay_rows"] else None)  # corpus rows in every update, against the BPB drifting (as sft's)
    learn = GroupUpdate(model, ref, fq, opts, cfg, s, device,
                        torch.Generator().manual_seed(rl["seed"] + 1), replay)  # the null arm's permutations apart
    max_new, n_rows = task_params["max_new_bytes"], rl["prompts_per_step"] * rl["oversample"] * s.group_size
    dev = task_eval.dev_items(task_params, rl["select"]["items_per_cell"]) if rl["select"]["every"] else []
    bf16 = uses_bf16(params["dtype"])
    decoder = DecodeStep(model.eval(), n_rows, buckets=[n_rows], bf16=bf16,
                         graphed=device.type == "cuda" and fq is None)

    with writer(job) as art:
        c = art.counters
        train_counters, eval_counters = Counter(), Counter()
        start = held_out(model, fq, heldout, params, device, (ex, ey), eval_counters)
        progress.note(f"[rl] start: {task_eval.held_out_line(start)}")
        with qat.through(fq):  # the dev prompts in one batch through one DecodeStep (on CUDA a graph replay per byte)
            select = Selection(model, dev, task_params, device, params, rl["select"], rl["steps"],
                               DecodeStep(model.eval(), len(dev), buckets=[len(dev)], graphed=decoder.graphed,
                                          bf16=bf16) if dev else None)
        metrics, t0 = [], time.time()
        meter = progress.Meter("rl", "step", rl["steps"])
        loop = Steps(model, fq, decoder, learn, stream, sampler, curriculum, select, opts, rl, s, max_new)
        for step in range(rl["steps"]):
            row = loop(step, c, train_counters)
            row["elapsed_s"] = round(time.time() - t0, 2)
            metrics.append(row)
            print(f"[rl] {json.dumps(row)}", flush=True)
            meter.update(step + 1, reward=row["reward"], dev_accuracy=row.get("dev_accuracy"))
            c["rl.steps_run"] = step + 1
            if "dev_accuracy" in row and select.stop():
                c["rl.stopped_at_plateau"] = step + 1
                progress.note(f"[rl] dev accuracy at its plateau: stopped at step {step + 1} of {rl['steps']}")
                break
        c["rl.decode_graphed"] = int(decoder.graphed)
        decoder = None  # its graphs and buffers go before the held-out decode
        select.restore()
        if dev:
            r = select.report()
            progress.note(f"[rl] selected step {r['selected_step']} of {c['rl.steps_run']} ({selection_line(r)})")
        end = held_out(model, fq, heldout, params, device, (ex, ey), eval_counters)
        progress.note(f"[rl] end: {task_eval.held_out_line(end)}")
        checked_counters(c, cfg, train_counters, eval_counters, "rl", trained=c["rl.updates"] > 0)
        c["rl.steps"] = rl["steps"]
        c["rl.skipped_cells"] = len(skip)
        art.extra["final"] = {"start": start, "end": end, "eval_bytes": eval_bytes, "heldout_items": len(heldout),
                              "curriculum_levels": dict(curriculum.level) if sampler is None else None,
                              "pass_rate_cells": sampler.report() if sampler is not None else None,
                              "algorithm": later, "device": str(device), "selection": select.report()}
        if fq is not None:
            art.extra["final"]["qat"] = qat.file_counters(c, fq, "rl", train_counters["qat.steps"])
            lineage.append(qat.lineage_entry("rl", art.extra["final"]["qat"]))
        save_model_artifact(art, model, {"model": cfg.to_dict(), "rl": rl, "tasks": task_params,
                                         **({"qat": lineage} if lineage else {})}, metrics)
        summary("rl", c)
    return 0
