"""GRPO's library: the prompt samplers (curriculum, per-cell pass rates), group advantages, the clipped-ratio loss
with the k3 KL term, reply log-probs, one step's group bookkeeping, its update and the step itself (GRPOStep). The
stage (dormouse/stages/rl.py) builds them and runs the loop; what each piece computes is documented there and here."""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dormouse.data import chat
from dormouse.posttrain import task_eval, tasks
from dormouse.posttrain.decode import generate_static
from dormouse.posttrain.settings import CurriculumSettings, PassRateSettings
from dormouse.train import qat
from dormouse.train.optim import set_lr, wsd_multiplier
from dormouse.train.runtime import LN2, autocast, pad_width, update, uses_bf16, with_moe_aux


class Curriculum:
    """Per family, the unlocked difficulties start..level; a prompt's difficulty is drawn uniformly from them, so
    a promoted family keeps training the cells below (the dev and held-out sets ask them too). The frontier moves
    up one when the mean reward of its last `window` groups reaches `promote_at`."""

    def __init__(self, families: list[str], cur: CurriculumSettings, difficulties: range):
        self.cur, self.low, self.top = cur, difficulties[0], difficulties[-1]
        self.level = {f: self.low for f in families}
        self.recent = {f: deque(maxlen=cur.window) for f in families}

    def __call__(self, family: str, rng) -> int:
        return rng.randint(self.low, self.level[family])

    def record(self, family: str, difficulty: int, mean_reward: float) -> bool:
        """Record one group's mean reward (only the frontier's count); True when the family moved up a difficulty."""
        if difficulty != self.level[family]:
            return False
        q = self.recent[family]
        q.append(mean_reward)
        if len(q) == q.maxlen and statistics.fmean(q) >= self.cur.promote_at and self.level[family] < self.top:
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

    def __init__(self, families: list[str], difficulties: range, settings: PassRateSettings,
                 skip: frozenset = frozenset()):
        self.cells = [(f, d) for f in families for d in difficulties if (f, d) not in skip]
        self.settings = settings
        self.recent = {cell: deque(maxlen=settings.window) for cell in self.cells}
        self.pass_rates = {cell: deque(maxlen=settings.window) for cell in self.cells}

    def share(self, cell) -> float:
        q = self.recent[cell]
        return statistics.fmean(q) if q else self.settings.prior

    def __call__(self, rng) -> tuple[str, int]:
        weights = [max(self.settings.floor, self.share(cell)) for cell in self.cells]
        return rng.choices(self.cells, weights=weights)[0]

    def record(self, family: str, difficulty: int, rewards: torch.Tensor) -> None:
        cell = (family, difficulty)
        self.recent[cell].append(float(rewards.std()) > 0.0)
        self.pass_rates[cell].append(float(rewards.mean()))

    def report(self) -> dict:
        return {f"{f}/{d}": {"teaching_share": round(self.share((f, d)), 4), "groups_measured": len(self.recent[(f, d)]),
                             "pass_rate": round(statistics.fmean(self.pass_rates[(f, d)]), 4) if self.pass_rates[(f, d)] else None}
                for f, d in self.cells}


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


def reply_rows(prompts: list[bytes], replies: list[bytes], device):
    """prompt + reply rows padded to one width: inputs, next-byte targets and the mask of targets that are reply bytes."""
    seqs = [p + r for p, r in zip(prompts, replies)]
    width = pad_width(max(len(s) for s in seqs) - 1, device)
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    tgt = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        t = torch.tensor(list(s), dtype=torch.long)
        x[i, : len(s) - 1], tgt[i, : len(s) - 1] = t[:-1], t[1:]
        mask[i, len(p) - 1 : len(s) - 1] = True  # targets that are reply bytes
    return x.to(device), tgt.to(device), mask.to(device)


def reply_logprobs(model, prompts: list[bytes], replies: list[bytes], temperature: float, device, counters=None):
    """Per reply byte, log p(byte | prompt + reply so far) at the sampling temperature: [N, L] and a mask."""
    x, tgt, mask = reply_rows(prompts, replies, device)
    logits, _ = model(x, counters=counters)
    lp = F.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return lp, mask


@dataclass(frozen=True, slots=True, kw_only=True)
class GRPOSettings:
    """What one rl step and its update read, built once from the stage's params (rl's section with
    RL_LATER_DEFAULTS filled in as `later`)."""

    steps: int
    warmup_steps: int
    seed: int
    prompts_per_step: int
    oversample: int
    top_k: int | None
    group_size: int
    temperature: float
    ppo_epochs: int
    clip_eps: float
    kl_coef: float
    grad_clip: float
    advantage: str
    loss_norm: str
    shuffle_rewards: bool
    dtype: str
    moe_aux_coef: float | None
    replay_weight: float
    anchor_weight: float

    @classmethod
    def of(cls, section: dict, later: dict, params: dict) -> GRPOSettings:
        rl = section
        return cls(steps=rl["steps"], warmup_steps=rl["warmup_steps"], seed=rl["seed"],
                   prompts_per_step=rl["prompts_per_step"], oversample=rl["oversample"], top_k=rl["top_k"],
                   group_size=rl["group_size"], temperature=rl["temperature"], ppo_epochs=rl["ppo_epochs"],
                   clip_eps=rl["clip_eps"], kl_coef=rl["kl_coef"], grad_clip=rl["grad_clip"],
                   advantage=later["advantage"], loss_norm=later["loss_norm"],
                   shuffle_rewards=later["shuffle_rewards"], dtype=params["dtype"],
                   moe_aux_coef=params.get("moe_aux_coef"), replay_weight=later["replay_weight"],
                   anchor_weight=later["anchor_weight"])


def prompt_sampler(families: tuple[str, ...], difficulties: range, seed: int, cur: CurriculumSettings,
                   pass_rate: PassRateSettings | None, skip: frozenset):
    """(item stream, PassRateSampler or None, Curriculum): rl.prompts pass_rate when its settings are given, else the
    curriculum, which is built either way (its levels are reported only when it draws)."""
    families = list(families)
    curriculum = Curriculum(families, cur, difficulties)
    if pass_rate is not None:
        sampler = PassRateSampler(families, difficulties, pass_rate, skip)
        return task_eval.cell_stream("rl", sampler, seed, spread=True), sampler, curriculum
    return task_eval.item_stream("rl", families, curriculum, seed, spread=True, skip=skip), None, curriculum


def tally_groups(c, items: list, rewards: torch.Tensor, sampler: PassRateSampler | None, curriculum: Curriculum,
                 prompts_seen: dict[str, set[str]]) -> list[int]:
    """Count each group (zero variance, per cell, distinct prompts per cell) and feed the prompt sampler; returns the
    groups with a learning signal (rewards that differ), in draw order."""
    signal = []
    for i, it in enumerate(items):
        teaches = float(rewards[i].std()) > 0.0
        c["rl.groups"] += 1
        if teaches:
            signal.append(i)
        else:
            c["rl.groups_zero_variance"] += 1
        cell = f"{it.family}.{it.difficulty}"
        c[f"rl.cell_groups.{cell}"] += 1
        c[f"rl.cell_groups_teaching.{cell}"] += int(teaches)
        if it.prompt not in prompts_seen.setdefault(cell, set()):  # a small cell's few prompts come back
            prompts_seen[cell].add(it.prompt)
            c[f"rl.cell_prompts.{cell}"] += 1
        if sampler is not None:
            sampler.record(it.family, it.difficulty, rewards[i])
        elif curriculum.record(it.family, it.difficulty, float(rewards[i].mean())):
            c[f"rl.promotions.{it.family}"] += 1
    return signal


def frozen_copy(model):
    """The KL reference: the SFT weights as they are, no gradients."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


ANCHOR_PROMPTS_PER_CELL = 64  # rl-split prompts of each skipped cell in the anchor's pool: 8 cells up to 512, one decode


class SkipAnchor:
    """rl.anchor_rows: holds the cells rl skips where the SFT model left them. rl trains none of their prompts, yet its
    updates moved their greedy answers (records/2026-12-08-rl-acceptance-h100: count@1 +12 -27 held-out items in one
    seed, which sank its paired z to 1.3 while the trained cells gave z 3.9). At the start, a pool of each skipped
    cell's rl-split prompts, the SFT model's greedy reply to each and its byte distributions along that reply; each
    update adds anchor_weight x KL(SFT || policy) over the reply bytes of the next `rows` pool prompts (averaged over
    each reply's bytes, then the rows). No reward enters it, so the null arm keeps its meaning. Built inside
    qat.through under rl.qat (eager: fake-quantized weights are new tensors), so the SFT model is the rung there as
    everywhere in the stage and the term starts at 0. Counted
    rl.anchor_prompts (the pool), rl.anchor_rows_trained; `kl` the last term, in nats a byte."""

    def __init__(self, model, cells: frozenset, rows: int, seed: int, max_new: int, device, dtype: str,
                 graphed: bool | None = None):
        items = [it for f, d in sorted(cells) for it in tasks.distinct_items("rl", f, d, ANCHOR_PROMPTS_PER_CELL)]
        if not items:
            raise ValueError(f"rl.anchor_rows: the skipped cells {sorted(cells)} hold no rl prompts")
        prompts = [chat.prompt_bytes(it.prompt) for it in items]
        was_training = model.training
        model.eval()
        with torch.no_grad():
            replies = generate_static(model, prompts, max_new, temperature=0.0, bf16=uses_bf16(dtype), graphed=graphed)
            self.x, _, self.mask = reply_rows(prompts, replies, device)
            with autocast(device, dtype):
                logits, _ = model(self.x)
            self.ref_lp = F.log_softmax(logits.float(), dim=-1)  # [N, W, 256]: the SFT model's bytes, temperature 1
        model.train(was_training)
        self.rows, self.device, self.dtype = min(rows, len(items)), device, dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.kl: torch.Tensor | None = None
        self.counts = Counter({"rl.anchor_prompts": len(items)})  # the pool, for the stage's manifest
        for it in items:
            self.counts[f"rl.anchor_prompts.{it.family}.{it.difficulty}"] += 1

    def next_rows(self) -> torch.Tensor:
        """The next `rows` pool indices: the pool in a seeded order, each prompt once before any comes back."""
        while len(self.order) < self.rows:
            self.order += torch.randperm(len(self.x), generator=self.gen).tolist()
        idx, self.order = self.order[: self.rows], self.order[self.rows :]
        return torch.tensor(idx, device=self.device)

    def term(self, model, c, train_counters) -> torch.Tensor:
        idx = self.next_rows()
        x, mask, ref_lp = self.x[idx], self.mask[idx].float(), self.ref_lp[idx]
        logits, _ = model(x, counters=train_counters)
        lp = F.log_softmax(logits.float(), dim=-1)
        per_byte = (ref_lp.exp() * (ref_lp - lp)).sum(-1)  # KL(SFT || policy) at each position
        kl = ((per_byte * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        c["rl.anchor_rows_trained"] += len(idx)
        self.kl = kl.detach()
        return kl


class GroupUpdate:
    """One step's learning from its kept groups: advantages (rewards permuted within each group first in the null
    arm), the sampling policy's and the reference's log-probs, then `ppo_epochs` clipped updates, each through the
    QAT rung's forward when there is one (entered per update: the weights moved). With a `replay` stream (rl.replay_rows)
    each update also takes the next-byte loss of its next corpus rows, times replay_weight (counted rl.replay_bytes;
    `replay_loss` the last one, in nats)."""

    def __init__(self, model, ref, fq, opts: list, cfg, s: GRPOSettings, device, null_gen: torch.Generator,
                 replay=None, anchor: SkipAnchor | None = None):
        self.model, self.ref, self.fq, self.opts, self.cfg, self.s, self.device = model, ref, fq, opts, cfg, s, device
        self.params, self.null_gen, self.replay, self.anchor = list(model.parameters()), null_gen, replay, anchor
        self.replay_loss: torch.Tensor | None = None  # the last one, read when the step's row is written

    def __call__(self, prompts: list[bytes], replies: list[bytes], rewards: torch.Tensor, step: int, c,
                 train_counters) -> torch.Tensor:
        s, model = self.s, self.model
        if s.shuffle_rewards:
            rewards = rewards.gather(1, torch.rand(rewards.shape, generator=self.null_gen).argsort(1))
            c["rl.null_shuffled_groups"] += rewards.shape[0]
        adv = group_advantages(rewards.reshape(-1), s.group_size, s.advantage).to(self.device).unsqueeze(1)
        with torch.no_grad(), autocast(self.device, s.dtype):
            with qat.through(self.fq):
                old_lp, mask = reply_logprobs(model, prompts, replies, s.temperature, self.device)
            ref_lp = (reply_logprobs(self.ref, prompts, replies, s.temperature, self.device)[0]
                      if self.ref is not None else None)
        model.train()
        for _ in range(s.ppo_epochs):
            with qat.through(self.fq), autocast(self.device, s.dtype):
                new_lp, _ = reply_logprobs(model, prompts, replies, s.temperature, self.device, train_counters)
            loss = grpo_loss(new_lp, old_lp, ref_lp, adv, mask, s.clip_eps, s.kl_coef, s.loss_norm)
            total = with_moe_aux(loss, model, self.cfg, s.moe_aux_coef)  # before the replay's forward moves aux_loss
            if self.replay is not None:
                with qat.through(self.fq), autocast(self.device, s.dtype):
                    total = total + s.replay_weight * self.replay_term(c, train_counters)
            if self.anchor is not None:
                with qat.through(self.fq), autocast(self.device, s.dtype):
                    total = total + s.anchor_weight * with_moe_aux(self.anchor.term(model, c, train_counters), model,
                                                                   self.cfg, s.moe_aux_coef)
            update(total, self.params, self.opts, s.grad_clip, "rl", step)
            c["rl.updates"] += 1
        return loss

    def replay_term(self, c, train_counters) -> torch.Tensor:
        """The next corpus rows' next-byte loss (with an MoE's balancing term), as sft's replay."""
        rx, ry = self.replay.next_batch()
        _, replay_loss = self.model(rx.to(self.device), ry.to(self.device), counters=train_counters)
        c["rl.replay_bytes"] += ry.numel()
        self.replay_loss = replay_loss.detach()
        return with_moe_aux(replay_loss, self.model, self.cfg, self.s.moe_aux_coef)


class GRPOStep:
    """One rl step: sample every prompt's group through the stage's DecodeStep, grade, count, learn from the groups
    that teach, and check dev when due; returns the step's metrics row."""

    def __init__(self, model, fq, decoder, learn: GroupUpdate, stream, sampler, curriculum, select, opts,
                 s: GRPOSettings, max_new: int):
        self.model, self.fq, self.decoder, self.learn, self.stream = model, fq, decoder, learn, stream
        self.sampler, self.curriculum, self.select, self.opts, self.s = sampler, curriculum, select, opts, s
        self.max_new, self.n_prompts = max_new, s.prompts_per_step * s.oversample
        self.gen = torch.Generator().manual_seed(s.seed)  # a CPU generator: the same draws on any device
        self.prompts_seen: dict[str, set[str]] = {}  # per cell: the distinct prompts rl trained on (rl.cell_prompts.*)

    def __call__(self, step: int, c, train_counters) -> dict:
        s, G = self.s, self.s.group_size
        set_lr(self.opts, wsd_multiplier(step, s.steps, s.warmup_steps, 0.0, 1.0))
        items = [next(self.stream) for _ in range(self.n_prompts)]
        unique = [chat.prompt_bytes(it.prompt) for it in items]
        self.model.eval()
        t_step = time.perf_counter()
        seeds = torch.randint(0, 2**63 - 1, (self.n_prompts * G,), generator=self.gen).tolist()
        with torch.no_grad(), qat.through(self.fq):
            replies = generate_static(self.model, unique, self.max_new, temperature=self.s.temperature,
                                      top_k=s.top_k, seeds=seeds, samples_per_prompt=G, step=self.decoder)
        t_decoded = time.perf_counter()
        grades = [task_eval.grade(items[j // G], r) for j, r in enumerate(replies)]
        rewards = torch.tensor([float(g == "correct") for g in grades]).view(-1, G)
        keep = tally_groups(c, items, rewards, self.sampler, self.curriculum, self.prompts_seen)[: s.prompts_per_step]
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
            row["replay_bpb"] = round(self.learn.replay_loss.item() / LN2, 5)
        if keep and self.learn.anchor is not None:
            row["anchor_kl"] = round(self.learn.anchor.kl.item(), 6)
        if self.fq is not None:
            train_counters["qat.steps"] += 1
        if self.select.due(step + 1, s.steps):
            t_dev = time.perf_counter()
            with qat.through(self.fq):
                row["dev_accuracy"] = self.select.check(step + 1)
            row["dev_s"] = round(time.perf_counter() - t_dev, 3)
        return row
