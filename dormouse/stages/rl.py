"""rl: GRPO on the verifiable task families, the exact verifiers as the reward.

    dormouse rl --job "$(dormouse plan --preset tiny --stage rl)"

Per step: `prompts_per_step` x `oversample` prompts from the rl seed split, `group_size` samples each
(temperature, optional top-k); reward 1 for a verified answer, else 0 (malformed replies are counted
apart from wrong ones); advantage = (r - group mean) / (group std + 1e-4), or r - group mean with
`advantage: mean` (Dr. GRPO). A group whose rewards are
all equal carries no learning signal (counted): the step trains on the first `prompts_per_step` groups
that do (DAPO's dynamic sampling), so most of a batch is signal even when most groups are all-wrong.
`ppo_epochs` gradient steps on the clipped-ratio objective against the sampling policy, plus
`kl_coef` x the k3 estimate of KL to the frozen SFT model. Loss is averaged over each reply's bytes
(the END that stops it included), then over replies. The lr warms up linearly over `warmup_steps`:
a fresh AdamW's first steps are sign steps of the full lr on every parameter, and on small they moved
the policy so far that the second PPO epoch's loss was 3.6 instead of ~0.
`loss_norm: token` weighs every reply byte of the batch alike instead (DAPO).
Prompts (`prompts`), over difficulties curriculum.start..max (max null: the largest of tasks.difficulties, what the
dev and held-out sets ask): `curriculum`: each family unlocks `curriculum.start` first, a prompt's difficulty drawn
uniformly from the unlocked ones, and unlocks the next when the frontier's mean reward over its last `window` groups
reaches `promote_at`; `pass_rate`: each prompt's (family, difficulty) is drawn in proportion to the measured share
of that cell's recent groups that teach (PassRateSampler), so the prompts follow the policy's per-prompt pass rates
instead of a fixed threshold. Counted per cell either way (rl.cell_groups.<family>.<difficulty>,
rl.cell_groups_teaching.*). Each seed starts at its own place in every cell's prompts (task_eval.cell_stream).
Model selection (dormouse/posttrain/selection.py): every `select.every` steps (and at step 0, the SFT model)
greedy exact match on the dev split (task_eval.dev_items: distinct prompts rl never trains on and the held-out set
never asks). `select.rule` bonferroni (default): the most accurate checkpoint whose paired sign test against step 0
on all the dev prompts (exact, one-sided) reaches p <= alpha / the planned checkpoints ships, else the SFT weights;
select_then_confirm: the best on a select half ships if it beats step 0 on the confirm half at z >= min_z; final: the
model rl ends with ships if it beats step 0 on all the dev prompts at p <= alpha (one planned test). Each
ships a checkpoint no better than step 0 at most ~alpha of the time (benchmarks/rl_selection_sim.py). rl stops
early when dev accuracy reaches its plateau (`select.plateau`). `shuffle_rewards`: the null arm (each group's
rewards permuted before the advantages). `skip_cells`: cells whose groups never teach, left out of rl's prompts
(the dev and held-out sets still ask them).
Sampling runs through one `decode.DecodeStep` of every step's rows, kept for the whole stage: on CUDA one graph
replay per byte (the optimizers update the weights in place, so each replay reads the current policy), eager on the
CPU and under `rl.qat` (its fake-quantized weights are new tensors at every step, which a graph would not see); each
row draws from its own seed (from the stage's seeded generator) with `rowrng`. Counted rl.decode_graphed; each step's
row in metrics.jsonl holds its decode, update and dev-check seconds (decode_s, train_s, dev_s).
Reports held-out task accuracy and corpus BPB at start and end (of the selected model), as sft does.
`rl.qat: <rung>`: the policy runs through the rung's export forward everywhere in the stage (sampling, the old and
new log-probs, the selection's dev checks, the reports; dormouse/train/qat.py), so the checkpoint chosen is the best
as the rung; the KL reference stays the SFT weights as they are. Counted as pretrain's finish is.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections import Counter, deque

import torch
import torch.nn.functional as F

from dormouse.data import shards as layout
from dormouse.data.byte_stream import eval_window
from dormouse.engine import progress
from dormouse.engine.registry import RL_LATER_DEFAULTS, rl_difficulties, rl_skip_cells
from dormouse.engine.stage import input_artifact, parse_job, summary, writer
from dormouse.posttrain import chat, selection, task_eval
from dormouse.posttrain.decode import DecodeStep, generate_static
from dormouse.train import qat
from dormouse.train.optim import build_optimizers, set_lr, wsd_multiplier
from dormouse.train.runtime import (
    autocast,
    checked_counters,
    deterministic_cpu,
    device_for,
    load_model,
    pad_width,
    save_model_artifact,
    update,
    uses_bf16,
    with_moe_aux,
)


class Curriculum:
    """Per family, the unlocked difficulties start..level; a prompt's difficulty is drawn uniformly from them, so
    a promoted family keeps training the cells below (the dev and held-out sets ask them too). The frontier moves
    up one when the mean reward of its last `window` groups reaches `promote_at`."""

    def __init__(self, families: list[str], cur: dict, difficulties: range):
        self.cur, self.low, self.top = cur, difficulties[0], difficulties[-1]
        self.level = {f: self.low for f in families}
        self.recent = {f: deque(maxlen=cur["window"]) for f in families}

    def __call__(self, family: str, rng) -> int:
        return rng.randint(self.low, self.level[family])

    def record(self, family: str, difficulty: int, mean_reward: float) -> bool:
        """Record one group's mean reward (only the frontier's count); True when the family moved up a difficulty."""
        if difficulty != self.level[family]:
            return False
        q = self.recent[family]
        q.append(mean_reward)
        if len(q) == q.maxlen and statistics.fmean(q) >= self.cur["promote_at"] and self.level[family] < self.top:
            self.level[family] += 1
            q.clear()
            return True
        return False


class PassRateSampler:
    """rl.prompts: pass_rate. Each prompt's (family, difficulty) is drawn with weight max(floor, share), the share
    being the fraction of the cell's last `window` groups whose rewards differed (0 < successes < G: the groups
    that teach), or `prior` for a cell not yet measured. So prompts go where the current policy's per-prompt pass
    rate is informative, measured online per cell, and a cell that went all-right or all-wrong is still sampled
    at the floor and noticed when the policy moves."""

    def __init__(self, families: list[str], difficulties: range, cfg: dict, skip: frozenset = frozenset()):
        self.cells = [(f, d) for f in families for d in difficulties if (f, d) not in skip]
        self.cfg = cfg
        self.recent = {cell: deque(maxlen=cfg["window"]) for cell in self.cells}
        self.pass_rates = {cell: deque(maxlen=cfg["window"]) for cell in self.cells}

    def share(self, cell) -> float:
        q = self.recent[cell]
        return statistics.fmean(q) if q else self.cfg["prior"]

    def __call__(self, rng) -> tuple[str, int]:
        weights = [max(self.cfg["floor"], self.share(cell)) for cell in self.cells]
        return rng.choices(self.cells, weights=weights)[0]

    def record(self, family: str, difficulty: int, rewards: torch.Tensor) -> None:
        cell = (family, difficulty)
        self.recent[cell].append(float(rewards.std()) > 0.0)
        self.pass_rates[cell].append(float(rewards.mean()))

    def report(self) -> dict:
        return {f"{f}/{d}": {"teaching_share": round(self.share((f, d)), 4), "groups_measured": len(self.recent[(f, d)]),
                             "pass_rate": round(statistics.fmean(self.pass_rates[(f, d)]), 4) if self.pass_rates[(f, d)] else None}
                for f, d in self.cells}


class Selection:
    """Greedy dev correctness per item at step 0 (the SFT model) and every `select.every` steps; `restore` then ships
    what selection.decide picks under `select.rule` (bonferroni by default: the most accurate checkpoint that beats
    step 0 on all the dev prompts at p <= alpha / the planned checkpoints), else step 0. Two CPU copies are kept:
    step 0's and the rule's candidate so far (selection.candidate stays put or moves to the newest step). Testing each
    of ten checkpoints at z >= 2 and shipping the best that passed (format 10) shipped noise ~17 % of the time under
    the null (benchmarks/rl_selection_sim.py). `stop` says when dev accuracy has reached its plateau
    (select.plateau). With `every` 0 it does nothing and the last step's model is kept."""

    def __init__(self, model, dev: list, task_params: dict, device, params: dict, select: dict, steps: int,
                 decoder: DecodeStep | None = None):
        self.model, self.dev, self.device, self.select = model, dev, device, select
        self.decoder = decoder  # every check through it (step 0 too): checks compare with each other only
        self.max_new, self.dtype = task_params["max_new_bytes"], params["dtype"]
        self.prompts = [it.prompt for it in dev]
        every = select["every"]
        self.planned = len(set(range(every, steps + 1, every)) | {steps}) if every else 0  # as `due` checks
        self.rule_args = {"rule": select["rule"], "alpha": select["alpha"], "planned": max(self.planned, 1)}
        self.curve: list[tuple[int, float]] = []
        self.cell_curve: list[dict] = []  # per check: accuracy per family.difficulty (which cells rl moves)
        self.units = selection.distinct_units(self.prompts)
        self.paired: list[dict] = []
        self.steps: list[int] = []
        self.rows: list[list[bool]] = []
        self.base_state = self.cand_state = None
        self.cand_step = 0
        self.decision: dict | None = None
        if dev:
            self.check(0)

    def due(self, step: int, rl: dict) -> bool:
        every = rl["select"]["every"]
        return bool(self.dev) and (step % every == 0 or step == rl["steps"])

    def _copy(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def check(self, step: int) -> float:
        right = task_eval.correct(self.model, self.dev, self.max_new, self.device, self.dtype, step=self.decoder)
        acc = round(sum(right[i] for i in self.units) / len(self.units), 5)  # each distinct prompt once, as the tests count
        self.curve.append((step, acc))
        by_cell: dict[str, list[bool]] = {}
        for i in self.units:
            by_cell.setdefault(f"{self.dev[i].family}.{self.dev[i].difficulty}", []).append(right[i])
        cells = {k: round(sum(v) / len(v), 4) for k, v in sorted(by_cell.items())}
        self.cell_curve.append({"step": step, **cells})
        progress.note(f"[rl] dev@{step}: accuracy {acc} over {len(self.units)} distinct prompts; per cell "
                      + " ".join(f"{k} {v}" for k, v in cells.items()))
        self.steps.append(step)
        self.rows.append(right)
        if step == 0:
            self.base_state = self._copy()
        else:  # all the dev prompts against step 0 (bonferroni's test; descriptive under select_then_confirm)
            paired = task_eval.paired_sign(self.rows[0], right, self.prompts)
            self.paired.append({"step": step, **paired, "z": round(paired["z"], 3)})
            cand = selection.candidate(steps=self.steps, correct=self.rows, prompts=self.prompts, **self.rule_args)
            if self.select["rule"] == "final":  # the model rl ends with is the one tested: no copy
                self.cand_step = cand
            elif cand == step and cand != self.cand_step:
                self.cand_step = cand
                self.cand_state = None  # the old copy goes before the new one is made
                self.cand_state = self._copy()
        return acc

    def stop(self) -> bool:
        """Whether dev accuracy has reached its plateau: the best of the last `checkpoints` checks is below the best
        before them + min_rise (select.plateau; None: never)."""
        plateau = self.select.get("plateau")
        return bool(self.dev) and plateau is not None and selection.plateaued(
            [a for _, a in self.curve], plateau["checkpoints"], plateau["min_rise"])

    def decide(self) -> dict:
        self.decision = selection.decide(self.steps, self.rows, self.prompts, self.select["min_z"], **self.rule_args)
        if self.decision["candidate_step"] != self.cand_step:
            raise RuntimeError(f"selection kept step {self.cand_step}, the rule's candidate is "
                               f"{self.decision['candidate_step']}")
        return self.decision

    def restore(self) -> None:
        self.decoder = None  # its graphs and buffers go before the held-out decode
        if self.dev:
            selected = self.decide()["selected_step"]
            if not (selected and self.select["rule"] == "final"):  # final ships the weights rl ends with, as they are
                self.model.load_state_dict(self.cand_state if selected else self.base_state)
            self.base_state = self.cand_state = None

    def report(self) -> dict:
        """The rule and its evidence (selection.decide), each step's accuracy on the distinct dev prompts (`curve`),
        its accuracy per family.difficulty cell (`cell_curve`: which cells rl moves), each checkpoint's test against step
        0 on all of them (`vs_step0`) and the selected step (None with
        selection off)."""
        if not self.dev:
            return {"rule": self.select["rule"], "dev_items": 0, "curve": [], "vs_step0": [],
                    "min_z": self.select["min_z"], "selected_step": None}
        return {"dev_items": len(self.dev), "curve": self.curve, "cell_curve": self.cell_curve, "vs_step0": self.paired,
                "min_z": self.select["min_z"], **(self.decision or self.decide())}


def selection_line(r: dict) -> str:
    """The selection's evidence in one line."""
    if r["rule"] == "final":
        t = r["tests"][-1] if r["tests"] else None
        return (f"final: the last checkpoint against step 0, p <= {r['alpha']}; "
                + (f"step {t['step']} gained {t['gained']} lost {t['lost']} p {t['p']}" if t else "no checkpoint"))
    if r["rule"] == "bonferroni":
        best = min(r["tests"], key=lambda t: t["p"], default=None)
        return (f"bonferroni: p <= {r['p_crit']} (alpha {r['alpha']} over {r['planned_checkpoints']} planned "
                f"checkpoints); the least p {best['p'] if best else None} at step {best['step'] if best else None}")
    return (f"candidate {r['candidate_step']}, best on the select half; on the confirm half vs step 0: gained "
            f"{r['confirm']['gained']} lost {r['confirm']['lost']} z {r['confirm']['z']}, min_z {r['min_z']}")


def group_advantages(rewards: torch.Tensor, group_size: int, kind: str = "mean_std") -> torch.Tensor:
    """Per group of `group_size` consecutive samples: r - group mean, divided by (group std + 1e-4) when `kind`
    is mean_std (GRPO; "mean" is Dr. GRPO's); a group whose rewards are all equal gets zeros (no signal)."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
    if kind == "mean_std":
        centred = centred / (grouped.std(1, keepdim=True) + 1e-4)
    elif kind != "mean":
        raise ValueError(f"rl.advantage {kind!r}")
    return centred.view(-1)


def grpo_loss(new_lp, old_lp, ref_lp, adv, mask, clip_eps: float, kl_coef: float, norm: str = "reply") -> torch.Tensor:
    """Clipped-ratio objective per reply byte, plus kl_coef x the k3 KL estimate to the reference
    (unbiased, >= 0); norm "reply": averaged over each reply's bytes (`mask`), then over replies; "token": over
    every reply byte of the batch at once (DAPO). [N, L] tensors, adv [N, 1]; ref_lp None = no KL term."""
    ratio = (new_lp - old_lp).exp()
    per_byte = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if ref_lp is not None:
        d = ref_lp - new_lp
        per_byte = per_byte + kl_coef * (d.exp() - d - 1)
    m = mask.float()
    if norm == "token":
        return (per_byte * m).sum() / m.sum()
    if norm != "reply":
        raise ValueError(f"rl.loss_norm {norm!r}")
    return ((per_byte * m).sum(1) / m.sum(1)).mean()


def reply_logprobs(model, prompts: list[bytes], replies: list[bytes], temperature: float, device, counters=None):
    """Per reply byte, log p(byte | prompt + reply so far) at the sampling temperature: [N, L] and a mask."""
    seqs = [p + r for p, r in zip(prompts, replies)]
    width = pad_width(max(len(s) for s in seqs) - 1, device)
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    tgt = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        t = torch.tensor(list(s), dtype=torch.long)
        x[i, : len(s) - 1], tgt[i, : len(s) - 1] = t[:-1], t[1:]
        mask[i, len(p) - 1 : len(s) - 1] = True  # targets that are reply bytes
    x, tgt, mask = x.to(device), tgt.to(device), mask.to(device)
    logits, _ = model(x, counters=counters)
    lp = F.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return lp, mask


def main(argv=None) -> int:
    job = parse_job(argv, "rl", __doc__)
    params = job["params"]
    rl, task_params = params["rl"], params["tasks"]
    device = device_for(params["device"], "rl")
    deterministic_cpu(device)
    torch.manual_seed(rl["seed"])
    sft_art, shards = input_artifact(job, "sft"), input_artifact(job, "shard")
    model, cfg = load_model(sft_art, device)
    ref = None
    if rl["kl_coef"] > 0:
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    ex, ey, eval_bytes = eval_window(layout.eval_bin(shards), params["eval"]["eval_bytes"], params["eval"]["seq_len"])
    heldout = task_eval.heldout_items(task_params)
    opts = build_optimizers(model, rl)
    params_list = list(model.parameters())
    fq = qat.FakeQuant(model, rl["qat"]) if rl.get("qat") else None
    lineage = qat.upstream_lineage(sft_art)
    families = task_params["families"]
    later = {k: rl.get(k, v) for k, v in RL_LATER_DEFAULTS.items()}  # keys left out of the digest at their defaults
    difficulties = rl_difficulties(rl["curriculum"], task_params)
    curriculum = Curriculum(families, rl["curriculum"], difficulties)
    skip = frozenset(rl_skip_cells({**rl, "skip_cells": later["skip_cells"]}, task_params))
    sampler = None
    if later["prompts"] == "pass_rate":
        sampler = PassRateSampler(families, difficulties, rl["pass_rate"], skip)
        stream = task_eval.cell_stream("rl", sampler, rl["seed"], spread=True)
    else:
        stream = task_eval.item_stream("rl", families, curriculum, rl["seed"], spread=True, skip=skip)
    gen = torch.Generator().manual_seed(rl["seed"])  # a CPU generator: the same draws on any device
    null_gen = torch.Generator().manual_seed(rl["seed"] + 1)  # rl.shuffle_rewards' permutations, apart from sampling
    G, temp, max_new = rl["group_size"], rl["temperature"], task_params["max_new_bytes"]
    dev = task_eval.dev_items(task_params, rl["select"]["items_per_cell"]) if rl["select"]["every"] else []
    n_rows = rl["prompts_per_step"] * rl["oversample"] * G
    decoder = DecodeStep(model.eval(), n_rows, buckets=[n_rows], graphed=device.type == "cuda" and fq is None,
                         bf16=uses_bf16(params["dtype"]))

    with writer(job) as art:
        c = art.counters
        train_counters, eval_counters = Counter(), Counter()
        with qat.through(fq):
            start = task_eval.held_out(model, heldout, params["tasks"], params["dtype"], params["eval"]["batch_size"], device, ex, ey, eval_counters)
            progress.note(f"[rl] start: {task_eval.held_out_line(start)}")
            # the dev prompts in one batch through one DecodeStep (on CUDA a graph replay per byte)
            select = Selection(model, dev, task_params, device, params, rl["select"], rl["steps"],
                               DecodeStep(model.eval(), len(dev), buckets=[len(dev)], graphed=decoder.graphed,
                                          bf16=uses_bf16(params["dtype"])) if dev else None)
        metrics, t0 = [], time.time()
        prompts_seen: dict[str, set[str]] = {}  # per cell: the distinct prompts rl trained on (rl.cell_prompts.*)
        meter = progress.Meter("rl", "step", rl["steps"])
        for step in range(rl["steps"]):
            set_lr(opts, wsd_multiplier(step, rl["steps"], rl["warmup_steps"], 0.0, 1.0))
            items = [next(stream) for _ in range(rl["prompts_per_step"] * rl["oversample"])]
            unique = [chat.prompt_bytes(it.prompt) for it in items]
            model.eval()
            t_step = time.perf_counter()
            seeds = torch.randint(0, 2**63 - 1, (n_rows,), generator=gen).tolist()
            with torch.no_grad(), qat.through(fq):
                replies = generate_static(model, unique, max_new, temperature=temp, top_k=rl["top_k"], seeds=seeds,
                                          samples_per_prompt=G, step=decoder)
            t_decoded = time.perf_counter()
            grades = [task_eval.grade(items[j // G], r) for j, r in enumerate(replies)]
            rewards = torch.tensor([float(g == "correct") for g in grades]).view(-1, G)
            signal = []  # groups with a learning signal, in draw order
            for i, it in enumerate(items):
                c["rl.groups"] += 1
                if float(rewards[i].std()) == 0.0:
                    c["rl.groups_zero_variance"] += 1
                else:
                    signal.append(i)
                cell = f"{it.family}.{it.difficulty}"
                c[f"rl.cell_groups.{cell}"] += 1
                c[f"rl.cell_groups_teaching.{cell}"] += int(float(rewards[i].std()) > 0.0)
                if it.prompt not in prompts_seen.setdefault(cell, set()):  # a small cell's few prompts come back
                    prompts_seen[cell].add(it.prompt)
                    c[f"rl.cell_prompts.{cell}"] += 1
                if sampler is not None:
                    sampler.record(it.family, it.difficulty, rewards[i])
                elif curriculum.record(it.family, it.difficulty, float(rewards[i].mean())):
                    c[f"rl.promotions.{it.family}"] += 1
            tally = Counter(grades)
            for k in ("correct", "wrong", "malformed"):
                c[f"rl.samples_{k}"] += tally[k]
            keep = signal[: rl["prompts_per_step"]]
            c["rl.groups_trained"] += len(keep)
            loss = None
            if not keep:
                c["rl.steps_without_signal"] += 1
            else:
                rows = [i * G + j for i in keep for j in range(G)]
                prompts, kept = [unique[i // G] for i in rows], [replies[i] for i in rows]
                trained = rewards[keep]
                if later["shuffle_rewards"]:  # the null arm: rewards permuted within each group, credited at random
                    trained = trained.gather(1, torch.rand(trained.shape, generator=null_gen).argsort(1))
                    c["rl.null_shuffled_groups"] += len(keep)
                adv = group_advantages(trained.reshape(-1), G, later["advantage"]).to(device).unsqueeze(1)
                with torch.no_grad(), autocast(device, params["dtype"]):
                    with qat.through(fq):
                        old_lp, mask = reply_logprobs(model, prompts, kept, temp, device)
                    ref_lp = reply_logprobs(ref, prompts, kept, temp, device)[0] if ref is not None else None
                model.train()
                for _ in range(rl["ppo_epochs"]):
                    with qat.through(fq), autocast(device, params["dtype"]):  # entered per update: the weights moved
                        new_lp, _ = reply_logprobs(model, prompts, kept, temp, device, train_counters)
                    loss = grpo_loss(new_lp, old_lp, ref_lp, adv, mask, rl["clip_eps"], rl["kl_coef"], later["loss_norm"])
                    update(with_moe_aux(loss, model, cfg, params.get("moe_aux_coef")), params_list, opts, rl["grad_clip"],
                           "rl", step)
                    c["rl.updates"] += 1
            row = {"step": step + 1, "reward": round(float(rewards.mean()), 4), "groups_trained": len(keep),
                   "loss": None if loss is None else round(loss.item(), 5), "malformed": tally["malformed"],
                   "levels": dict(curriculum.level) if sampler is None else "pass_rate",
                   "decode_s": round(t_decoded - t_step, 3), "train_s": round(time.perf_counter() - t_decoded, 3)}
            if fq is not None:
                train_counters["qat.steps"] += 1
            if select.due(step + 1, rl):
                t_dev = time.perf_counter()
                with qat.through(fq):
                    row["dev_accuracy"] = select.check(step + 1)
                row["dev_s"] = round(time.perf_counter() - t_dev, 3)
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
            end = task_eval.held_out(model, heldout, params["tasks"], params["dtype"], params["eval"]["batch_size"], device, ex, ey, eval_counters)
        progress.note(f"[rl] end: {task_eval.held_out_line(end)}")
        checked_counters(c, cfg, train_counters, eval_counters, "rl", trained=c["rl.updates"] > 0)
        c["rl.steps"] = rl["steps"]
        c["rl.skipped_cells"] = len(skip)
        art.extra["final"] = {"start": start, "end": end, "eval_bytes": eval_bytes, "heldout_items": len(heldout),
                              "curriculum_levels": dict(curriculum.level) if sampler is None else None,
                              "pass_rate_cells": sampler.report() if sampler is not None else None,
                              "algorithm": later, "device": str(device),
                              "selection": select.report()}
        if fq is not None:
            art.extra["final"]["qat"] = qat.file_counters(c, fq, "rl", train_counters["qat.steps"])
            lineage.append(qat.lineage_entry("rl", art.extra["final"]["qat"]))
        save_model_artifact(art, model, {"model": cfg.to_dict(), "rl": rl, "tasks": task_params,
                                         **({"qat": lineage} if lineage else {})}, metrics)
        summary("rl", c)
    return 0
