"""The stages: one torch-free table that the planner (digests, inputs), the CLI (`dormouse <stage>`) and the tests
of the rules (workflow/rules/*.smk: one rule per stage, its docstring the help line) read.

A stage's `format_version` changes when its output changes for the same params and inputs (a new layout or a fix
that changes the numbers: the digest then moves and the stage and everything downstream rebuild); each bump
gets a line in its changelog. `params` cuts the resolved preset down to what can change the stage's output,
and nothing else: it is digested.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dormouse.data.shards import SHARD_DEFAULTS_NOT_DIGESTED
from dormouse.core.config import ConfigError
from dormouse.train.settings import TRAIN_LATER_DEFAULTS


@dataclass(frozen=True)
class Stage:
    name: str
    help: str  # the CLI's help line and the rule's docstring
    format_version: int
    upstream: tuple[str, ...]  # artifact inputs, by stage name
    params: Callable[[dict], dict]  # resolved preset -> the digested params slice
    changelog: tuple[str, ...]  # "N: what changed", one per version from 2 on

    @property
    def module(self) -> str:  # the entry point: main(argv) in it
        return f"dormouse.stages.{self.name}"


def _filter(preset: dict) -> dict:
    data = preset["data"]
    quality = dict(data["filter"]["quality"])
    if quality["model"] != "train":  # a user-supplied model: its file is an input, not a param
        quality = {k: v for k, v in quality.items() if k not in ("train", "positive", "negative")}
        quality["model"] = "file"
    else:  # example sets are inputs (fingerprinted), not params
        quality = {k: v for k, v in quality.items() if k not in ("positive", "negative")}
    return {"reader": data["reader"], **{k: v for k, v in data["filter"].items() if k != "quality"}, "quality": quality}


def omit_defaults(section: dict, defaults: dict) -> dict:
    """A section without the keys that sit at their `defaults` (keys added after digests were pinned)."""
    return {k: v for k, v in section.items() if not (k in defaults and v == defaults[k])}


def _shard(preset: dict) -> dict:
    return omit_defaults(preset["data"]["shard"], SHARD_DEFAULTS_NOT_DIGESTED)


def _anchors(preset: dict) -> dict:  # the ladder scores the model's eval window: its size is a param
    return {**preset["anchors"], "eval": {k: preset["train"][k] for k in ("eval_bytes", "seq_len")}}


# Keys added to a section after digests were pinned, with the default that runs the code as it was: at that value
# they stay out of the params, so adding them rebuilt nothing (the stage reads them with these defaults; the schema
# holds the same, tested). train's: dormouse/train/settings.py.
POSTTRAIN_LATER_DEFAULTS = {"qat": None}  # sft and rl
QAT_SECTIONS = ("train", "sft", "rl")


def ptq_twin(preset: dict) -> dict | None:
    """The preset with every qat key off: the chain whose rungs are quantized after training, which bench scores
    beside a QAT chain's; None when no qat key is on."""
    if not any(preset[s].get("qat") for s in QAT_SECTIONS):
        return None
    return {**preset, **{s: {**preset[s], "qat": None} for s in QAT_SECTIONS}}


def _pretrain(preset: dict) -> dict:
    from dormouse.model.config import ModelConfig  # torch-free

    try:
        model = ModelConfig.from_dict(preset["model"]).to_dict()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None
    train = preset["train"]
    micro = train.get("micro_batch_size")
    if micro and micro < train["batch_size"] and train["batch_size"] % micro:
        raise ConfigError(f"train.micro_batch_size {micro} does not divide train.batch_size {train['batch_size']}")
    rungs, qat = train.get("ptq_rungs") or [], train.get("qat")
    if qat and qat["rung"] in rungs:
        raise ConfigError(f"train.ptq_rungs lists {qat['rung']}, the rung of train.qat: its final eval already measures it")
    outside = [k for k in train.get("keep_checkpoints") or () if not 0 < k < train["steps"]]
    if outside:
        raise ConfigError(f"train.keep_checkpoints {outside}: a kept checkpoint is a step inside the run (1 .. train.steps - 1)")
    return {"model": model, "train": omit_defaults(train, TRAIN_LATER_DEFAULTS)}


def _run(preset: dict) -> dict:
    """After pretrain the model is implied by the upstream digest; what else runs it is explicit."""
    train = preset["train"]
    return {"device": train["device"], "dtype": train["dtype"],
            "eval": {k: train[k] for k in ("eval_bytes", "seq_len", "batch_size")}}


# rl keys added after format 9 whose defaults run format 9's algorithm: at these values they stay out of the params,
# so adding them rebuilt nothing (the stage reads them with these defaults; the schema holds the same, tested).
RL_LATER_DEFAULTS = {"advantage": "mean_std", "loss_norm": "reply", "prompts": "curriculum", "shuffle_rewards": False,
                     "skip_cells": [], "replay_rows": 0, "replay_seq_len": 256, "replay_weight": 1.0,
                     "anchor_rows": 0, "anchor_weight": 1.0}


def rl_skip_cells(rl: dict, task_params: dict) -> set[tuple[str, int]]:
    """rl.skip_cells as (family, difficulty) pairs: cells rl's prompts never come from (dev, held-out and bench still
    ask them). Each must be a cell rl would train, and at least one cell must remain."""
    difficulties = rl_difficulties(rl["curriculum"], task_params)
    trained = {(f, d) for f in task_params["families"] for d in difficulties}
    skip = set()
    for cell in rl.get("skip_cells", []):
        family, _, level = cell.partition("@")
        if (family, int(level)) not in trained:
            raise ConfigError(f"rl.skip_cells: {cell!r} is no cell rl trains (families {task_params['families']}, "
                              f"difficulties {list(difficulties)})")
        skip.add((family, int(level)))
    if skip >= trained:
        raise ConfigError(f"rl.skip_cells {sorted(rl['skip_cells'])} leaves rl no cell to train")
    if rl.get("anchor_rows") and not skip:
        raise ConfigError("rl.anchor_rows holds the cells rl skips at the SFT model's answers: rl.skip_cells names none")
    if rl.get("prompts", "curriculum") == "curriculum":
        # a family moves up only after groups at its frontier: a skipped cell below an open one would freeze it there
        for family in task_params["families"]:
            open_levels = [d for d in difficulties if (family, d) not in skip]
            frozen = [d for d in difficulties if (family, d) in skip and open_levels and d < max(open_levels)]
            if frozen:
                raise ConfigError(f"rl.skip_cells: {family}@{frozen[0]} lies below {family}@{max(open_levels)}, which "
                                  "the curriculum reaches only through it: skip a family's top cells only (or use "
                                  "rl.prompts: pass_rate)")
    return skip


def rl_difficulties(cur: dict, task_params: dict) -> range:
    """The difficulties rl trains: curriculum.start to curriculum.max, where a null max is the largest of
    tasks.difficulties. At max 3 over small's [1, 2], a quarter of rl's groups went to difficulty 3, which sft never
    taught and no dev or held-out item asks, and each promoted family stopped training the cells they do ask."""
    top = cur["max"] if cur["max"] is not None else max(task_params["difficulties"])
    if top < cur["start"]:
        raise ConfigError(f"rl.curriculum: max {top}{'' if cur['max'] is not None else ' (the largest of tasks.difficulties)'} "
                          f"is below start {cur['start']}")
    unasked = sorted(set(range(cur["start"], top + 1)) - set(task_params["difficulties"]))
    if unasked and cur["max"] is None:  # an explicit max asks for unmeasured cells on purpose
        raise ConfigError(f"rl.curriculum: start {cur['start']}..max {top} (the largest of tasks.difficulties) holds "
                          f"difficulties {unasked} that tasks.difficulties {task_params['difficulties']} does not ask: set "
                          "rl.curriculum.start to the smallest asked, or max explicitly")
    return range(cur["start"], top + 1)


def _posttrain(stage: str) -> Callable[[dict], dict]:
    def params(preset: dict) -> dict:
        # an MoE keeps pretrain's balancing loss while it trains on (a param only then: other digests stay)
        moe = {"moe_aux_coef": preset["train"]["moe_aux_coef"]} if preset["model"].get("moe") else {}
        section = omit_defaults(preset[stage], POSTTRAIN_LATER_DEFAULTS)
        if stage == "rl":
            rl_skip_cells(section, preset["tasks"])  # a curriculum with no difficulty, or a skip of no cell, fails the plan
            section["skip_cells"] = sorted(section.get("skip_cells", []))  # one digest whatever the order written
            section = omit_defaults(section, RL_LATER_DEFAULTS)
            if "prompts" not in section:  # pass_rate settings only matter when rl.prompts is pass_rate
                section.pop("pass_rate", None)
        return {"tasks": dict(preset["tasks"]), stage: section, **_run(preset), **moe}
    return params


def _export(preset: dict) -> dict:
    return {"export": dict(preset["export"]), **_run(preset)}


def _bench(preset: dict) -> dict:  # a QAT chain's bench also reads its ptq_twin's export (dormouse/planner/plan.py)
    return {"tasks": dict(preset["tasks"]), "bench": dict(preset["bench"]), **_run(preset)}


# The chain, in order.
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("filter", "quality-filter the raw corpus", 2, (), _filter, (
        "2: documents holding the chat template bytes 0x01-0x03 are dropped (fastText's NaN retries add manifest keys "
        "only: the documents are the same, so no bump)",)),
    Stage("shard", "route documents into train shards and the eval tail", 4, ("filter",), _shard, (
        "2: documents in hash order",
        "3: the hash mixed (fnv.doc_hash): a uniform eval tail",
        "4: the tail held out by group (part_pattern)")),
    Stage("anchors", "n-gram anchor ladder (bits per byte) on the eval window and the whole eval tail", 2,
          ("shard",), _anchors, (
        "2: the ladder scores the model's eval window; ladder_tail the whole tail",)),
    Stage("pretrain", "train the byte LM; eval BPB on a fixed window of the eval tail", 8, ("shard",), _pretrain, (
        "2: batch rows from B lanes",
        "3: epochs exclude lane tails",
        "4: StackedMuon, compiled regions, shifted-sum convs",
        "5: those convs sum in fp32",
        "6: FLA's conv kernel on CUDA, CUDA graphs by default",
        "7: the mixer's input projections as one matmul, its activations inside chunk_kda on CUDA, no recompute in "
        "FLA's backward",
        "8: our Triton short conv on CUDA from the sequence start")),
    Stage("sft", "fine-tune on the verifiable tasks (loss on assistant bytes only)", 7, ("pretrain", "shard"),
          _posttrain("sft"), (
        "2: held-out accuracy with the constant-reply baseline",
        "3: StackedMuon",
        "4: convs sum in fp32",
        "5: FLA's conv kernel on CUDA",
        "6: one input matmul",
        "7: our Triton conv")),
    Stage("rl", "GRPO on the verifiable tasks with exact-verifier rewards", 11, ("sft", "shard"), _posttrain("rl"), (
        "2: no dev-split prompt in training",
        "3: as sft 2",
        "4: paired selection",
        "5: StackedMuon",
        "6: as sft 4",
        "7: as sft 5",
        "8: as sft 6",
        "9: as sft 7",
        "10: the curriculum draws every unlocked difficulty, within tasks.difficulties by default; each rl seed starts "
        "its own place in every cell's prompts; selection's sign test counts each distinct dev prompt once",
        "11: select.rule (bonferroni by default: each checkpoint against step 0, exact sign test at p <= alpha over "
        "the planned checkpoints; select_then_confirm: a select half, then a confirm half at min_z 1.7; "
        "dormouse/posttrain/selection.py); rl stops at the dev plateau (select.plateau)")),
    Stage("export", "quantized rungs (bf16 .. ternary) with bytes on disk and their BPB", 3, ("rl", "shard"),
          _export, (
        "2: reference_bpb computed in fp32 (it ran under the bf16 autocast on CUDA)",
        "3: ternary's mean |W| summed in fp64 (a scale's last bit moved with the summation order)")),
    Stage("bench", "score every stage and rung: BPB, task accuracy, multiple choice, cloze", 5,
          ("pretrain", "sft", "rl", "export", "anchors", "shard"), _bench, (
        "2: as sft 2",
        "3: per-item greedy correctness and the paired sign tests (bench.json format 2)",
        "4: the sign tests count each distinct prompt once (bench.json format 3)",
        "5: within_one_se; a QAT chain's rungs against its twin's bf16 (bench.json format 4)")),
)}


def stage_params(stage: str, preset: dict) -> dict:
    """The resolved slice of a preset that can change this stage's output, and nothing else."""
    return STAGES[stage].params(preset)
