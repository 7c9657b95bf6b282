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
`anchor_rows`: each update also adds `anchor_weight` x KL(SFT || policy) along the SFT model's greedy replies to that
many prompts of the skipped cells (grpo.SkipAnchor), so the cells rl does not train keep the SFT model's answers.
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
from functools import partial

import torch

from dormouse.data import shards as layout
from dormouse.data.byte_stream import TrainStream, eval_window
from dormouse.core import progress
from dormouse.planner.registry import RL_LATER_DEFAULTS, rl_difficulties, rl_skip_cells
from dormouse.planner.job import input_artifact, parse_job, summary, writer
from dormouse.posttrain import task_eval
from dormouse.posttrain.decode import DecodeStep
from dormouse.posttrain.grpo import GroupUpdate, GRPOSettings, GRPOStep, SkipAnchor, frozen_copy, prompt_sampler
from dormouse.posttrain.selection import Selection, selection_line
from dormouse.posttrain.settings import CurriculumSettings, PassRateSettings, SelectSettings, TaskSettings
from dormouse.train import qat
from dormouse.train.optim import build_optimizers
from dormouse.train.settings import OptimSettings
from dormouse.train.runtime import checked_counters, deterministic_cpu, device_for, load_model, save_model_artifact, uses_bf16


def prompts(rl: dict, later: dict, task_params: dict, task_set: TaskSettings):
    """(the cells rl skips, (item stream, PassRateSampler or None, Curriculum)) for rl.prompts."""
    skip = frozenset(rl_skip_cells({**rl, "skip_cells": later["skip_cells"]}, task_params))
    pass_rate = PassRateSettings.of(rl["pass_rate"]) if later["prompts"] == "pass_rate" else None
    return skip, prompt_sampler(task_set.families, rl_difficulties(rl["curriculum"], task_params), rl["seed"],
                                CurriculumSettings.of(rl["curriculum"]), pass_rate, skip)


def skip_anchor(model, fq, skip: frozenset, later: dict, seed: int, max_new: int, device, dtype: str):
    """rl.anchor_rows' SkipAnchor (None at 0 rows): the SFT model's greedy replies to the skipped cells, made before
    any update, as the stage's policy runs (through the rung under rl.qat, eagerly)."""
    if not later["anchor_rows"]:
        return None
    with qat.through(fq):
        return SkipAnchor(model, skip, later["anchor_rows"], seed + 3, max_new, device, dtype,
                          graphed=None if fq is None else False)


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
    task_set = TaskSettings.of(task_params)
    heldout = task_eval.heldout_items(task_set)
    opts = build_optimizers(model, OptimSettings.of(rl, "rl"))
    fq = qat.FakeQuant(model, rl["qat"]) if rl.get("qat") else None
    lineage = qat.upstream_lineage(sft_art)
    later = {k: rl.get(k, v) for k, v in RL_LATER_DEFAULTS.items()}  # keys left out of the digest at their defaults
    skip, (stream, sampler, curriculum) = prompts(rl, later, task_params, task_set)
    s = GRPOSettings.of(rl, later, params)
    replay = (TrainStream(layout.train_bins(shards), later["replay_rows"], later["replay_seq_len"], rl["seed"] + 2)
              if later["replay_rows"] else None)  # corpus rows in every update, against the BPB drifting (as sft's)
    max_new, n_rows = task_set.max_new_bytes, rl["prompts_per_step"] * rl["oversample"] * s.group_size
    learn = GroupUpdate(model, ref, fq, opts, cfg, s, device, torch.Generator().manual_seed(rl["seed"] + 1), replay,
                        skip_anchor(model, fq, skip, later, rl["seed"], max_new, device, params["dtype"]))  # +1: null arm
    select_set = SelectSettings.of(rl["select"])
    dev = task_eval.dev_items(task_set, select_set.items_per_cell) if select_set.every else []
    bf16 = uses_bf16(params["dtype"])
    decoder = DecodeStep(model.eval(), n_rows, buckets=[n_rows], bf16=bf16,
                         graphed=device.type == "cuda" and fq is None)

    train_counters, eval_counters = Counter(), Counter()
    held_out = partial(task_eval.held_out, model, heldout, task_set, params["dtype"], params["eval"]["batch_size"],
                       device, ex, ey, eval_counters)  # task accuracy and corpus BPB, at the start and the end
    with writer(job) as art:
        c = art.counters
        c.update(learn.anchor.counts if learn.anchor is not None else {})  # the anchor's pool
        with qat.through(fq):
            start = held_out()
        progress.note(f"[rl] start: {task_eval.held_out_line(start)}")
        with qat.through(fq):  # the dev prompts in one batch through one DecodeStep (on CUDA a graph replay per byte)
            select = Selection(model, dev, max_new, device, params["dtype"], select_set, rl["steps"],
                               DecodeStep(model.eval(), len(dev), buckets=[len(dev)], graphed=decoder.graphed,
                                          bf16=bf16) if dev else None)
        metrics, t0 = [], time.time()
        meter = progress.Meter("rl", "step", rl["steps"])
        loop = GRPOStep(model, fq, decoder, learn, stream, sampler, curriculum, select, opts, s, max_new)
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
        with qat.through(fq):
            end = held_out(base=start)
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
