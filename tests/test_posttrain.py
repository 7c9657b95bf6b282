"""pretrain -> sft -> rl -> export -> bench on the fixture corpus, through the stages' job JSON, and
the pieces of each stage that a wrong line would break (loss mask, GRPO advantage, curriculum)."""

import copy
import json
import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from pipeline_util import configure, manifest, run_chain

from dormouse.core.config import validate
from dormouse.tools.views import main as view_main
from dormouse.data import chat
from dormouse.posttrain import task_eval, tasks
from dormouse.posttrain.grpo import Curriculum
from dormouse.posttrain.selection import selection_line
from dormouse.posttrain.chat_batches import sft_batch
from dormouse.posttrain.settings import CurriculumSettings, PassRateSettings, SelectSettings, TaskSettings

TINY = {
    "model": {"d_model": 32, "n_heads": 2, "head_dim": 16, "ffn_hidden": 64, "n_core": 1, "kda_chunk_size": 16,
              "engram": True, "engram_rows": 512, "engram_dim": 32},
    "train": {"device": "cpu", "steps": 30, "batch_size": 4, "seq_len": 64, "eval_every": 30, "eval_bytes": 1024,
              "ckpt_every": 30, "log_every": 10, "warmup_steps": 5},
    "tasks": {"families": ["add", "reverse"], "difficulties": [1], "heldout_items": 4, "max_new_bytes": 8},
    "sft": {"steps": 6, "batch_size": 4, "log_every": 2},
    "rl": {"steps": 3, "prompts_per_step": 2, "group_size": 3, "curriculum": {"window": 2, "promote_at": 0.0, "max": 2}},
    "export": {"rungs": ["bf16", "int8", "mxfp4", "ternary"], "quantize_tables": True},  # tables dominate this model
    "bench": {"cloze": {"items": 6, "context_bytes": 24, "span_bytes": 8}},
}
STAGES = ("filter", "shard", "anchors", "pretrain", "sft", "rl", "export", "bench")


def build_chain(work: Path, small_corpus, quality_examples, preset_update: dict):
    """The tiny preset with `preset_update` over it, through every stage in `work` (a copy of config/ and workflow/)."""
    import shutil

    root = Path(__file__).resolve().parents[1]
    for d in ("config", "workflow"):
        shutil.copytree(root / d, work / d)
    config = configure(work, small_corpus, *quality_examples)
    path = work / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(path.read_text())
    preset.update(preset_update)
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    bench_dir = work / "corpus" / "bench"
    bench_dir.mkdir(parents=True)
    (bench_dir / "capitals.jsonl").write_text(
        json.dumps({"question": "The capital of France is", "choices": ["Paris", "Lyon"], "answer": 0}) + "\n")
    config["bench_tasks"] = str(bench_dir)
    return work, run_chain(work, config, stages=STAGES)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, small_corpus, quality_examples):
    return build_chain(tmp_path_factory.mktemp("posttrain"), small_corpus, quality_examples, TINY)


def test_sft_loss_counts_only_assistant_bytes():
    items = [tasks.make_item("add", 1, 5), tasks.make_item("reverse", 2, 7)]
    x, y, n = sft_batch(items, "cpu")
    for i, it in enumerate(items):
        b, mask = chat.sft_example(it.prompt, it.answer)
        scored = bytes(int(v) for v in y[i] if v >= 0)
        assert scored == it.answer.encode() + bytes([chat.END])  # the reply and its END, nothing else
        assert (y[i] >= 0).sum() == sum(mask)
        assert bytes(x[i, : len(b) - 1].tolist()) == b[:-1]
    assert n == sum(len(it.answer) + 1 for it in items)


def test_curriculum_promotes_on_the_frontier_mean_draws_every_unlocked_level_and_stops_at_max():
    import random

    cur = Curriculum(["add"], CurriculumSettings(start=1, max=2, window=2, promote_at=0.5), range(1, 3))
    rng = random.Random(0)
    assert {cur("add", rng) for _ in range(50)} == {1}
    assert not cur.record("add", 1, 1.0)  # window not full yet
    assert not cur.record("add", 2, 1.0)  # not the frontier: does not count
    assert cur.record("add", 1, 0.0)  # the frontier's mean 0.5 reaches promote_at
    assert {cur("add", rng) for _ in range(50)} == {1, 2}  # the level below keeps training
    assert not cur.record("add", 2, 1.0) and not cur.record("add", 2, 1.0)  # at max: stays
    assert cur.level["add"] == 2


def test_rl_difficulties_default_to_what_the_sets_ask():
    from dormouse.core.config import ConfigError, load_preset
    from dormouse.planner.registry import rl_difficulties, stage_params

    tasks_ = {"difficulties": [1, 2]}
    assert rl_difficulties({"start": 1, "max": None}, tasks_) == range(1, 3)
    assert rl_difficulties({"start": 1, "max": 3}, tasks_) == range(1, 4)  # asked for: trains cells no set measures
    with pytest.raises(ConfigError, match=r"difficulties \[1\] that tasks.difficulties \[2, 3\] does not ask"):
        rl_difficulties({"start": 1, "max": None}, {"difficulties": [2, 3]})
    assert rl_difficulties({"start": 1, "max": 3}, {"difficulties": [2, 3]}) == range(1, 4)  # explicit: on purpose
    preset = load_preset("small", Path(__file__).resolve().parents[1])
    preset["rl"]["curriculum"] = {**preset["rl"]["curriculum"], "start": 3}
    with pytest.raises(ConfigError, match=r"max 2 \(the largest of tasks.difficulties\) is below start 3"):
        stage_params("rl", preset)


def test_sft_and_rl_report_accuracy_and_bpb_at_start_and_end(chain):
    work, plan = chain
    for stage in ("sft", "rl"):
        final = manifest(work, plan, stage)["final"]
        for when in ("start", "end"):
            r = final[when]
            assert r["n"] == 8 and 0 <= r["accuracy"] <= 1 and r["corpus_bpb"] > 0
            assert set(r["by_cell"]) == {"add@1", "reverse@1"}
            assert r["sampled"]["samples_per_item"] == 4 and 0 <= r["sampled"]["accuracy"] <= 1
    sft_final = manifest(work, plan, "sft")["final"]
    rl_final = manifest(work, plan, "rl")["final"]
    start_of_sft = {k: v for k, v in sft_final["end"].items() if k != "vs_start"}
    assert rl_final["start"] == start_of_sft  # rl starts from exactly the sft model
    for final in (sft_final, rl_final):  # each stage's end against its start, item by item over distinct prompts
        v, a, b = final["end"]["vs_start"], final["start"]["items_correct"], final["end"]["items_correct"]
        assert v["gained"] == sum(x == "0" and y == "1" for x, y in zip(a, b)) and v["units"] == len(a) == 8


def test_rl_counts_groups_samples_and_signal(chain):
    work, plan = chain
    c = manifest(work, plan, "rl")["counters"]
    assert c["rl.groups"] == 3 * 2 * 2  # steps x prompts_per_step x oversample
    assert sum(c.get(f"rl.samples_{k}", 0) for k in ("correct", "wrong", "malformed")) == 3 * 2 * 2 * 3
    zero = c.get("rl.groups_zero_variance", 0)
    assert c.get("rl.groups_trained", 0) <= min(c["rl.groups"] - zero, 3 * 2)
    assert c.get("rl.updates", 0) == 2 * (3 - c.get("rl.steps_without_signal", 0))  # ppo_epochs (2) per step with signal
    assert c["eval.engram.rows_read"] > 0
    assert c["rl.decode_graphed"] == 0  # the CPU samples through the eager DecodeStep
    rows = [json.loads(line) for line in (work / plan.artifact_dir("rl", plan.chain["tiny"]["rl"]) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["decode_s"] > 0 and r["train_s"] >= 0 for r in rows)
    # promote_at 0 promotes a family as soon as its window (2 groups) fills; 6 groups fill at least one
    levels = manifest(work, plan, "rl")["final"]["curriculum_levels"]
    assert all(levels[f] == 1 + c.get(f"rl.promotions.{f}", 0) for f in ("add", "reverse"))
    assert max(levels.values()) == 2


def test_export_rungs_load_back_and_shrink(chain):
    work, plan = chain
    rungs = manifest(work, plan, "export")["final"]["rungs"]
    assert list(rungs) == ["bf16", "int8", "mxfp4", "ternary"]
    assert rungs["bf16"]["delta_bpb_vs_bf16"] == 0
    sizes = [rungs[r]["bytes"] for r in ("bf16", "int8", "mxfp4", "ternary")]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4
    assert all(r["bpb"] > 0 for r in rungs.values())


@pytest.fixture(scope="module")
def bench_view(chain) -> dict:
    work, plan = chain
    cwd = os.getcwd()
    os.chdir(work)
    try:
        art = plan.artifact_dir("bench", plan.chain["tiny"]["bench"])
        assert view_main(["bench", "--preset", "tiny", "--artifact", art, "--out", "results/tiny/bench.json"]) == 0
        return json.loads(Path("results/tiny/bench.json").read_text())
    finally:
        os.chdir(cwd)


def test_bench_json_matches_its_schema_and_names_the_chain(chain, bench_view):
    work, plan = chain
    view = bench_view
    validate(view, "bench.schema.yaml", "results/tiny/bench.json")
    assert {link["stage"] for link in view["digest_chain"]} == {"filter", "shard", "anchors", "pretrain", "sft", "rl", "export", "bench"}
    assert set(view["rungs"]) == {"bf16", "int8", "mxfp4", "ternary"}
    assert view["suites"]["file:capitals.jsonl"]["items"] == 1
    assert view["stages"]["rl"]["file:capitals.jsonl"]["n_scored"] == 1
    assert view["stages"]["pretrain"]["eval_bytes"] == view["eval_window"]["bytes"]
    # the same held-out items: bench's greedy exact match equals what rl reported at its end (bench adds items_correct)
    rl_gen, rl_end = view["stages"]["rl"]["tasks_gen"], manifest(work, plan, "rl")["final"]["end"]
    assert rl_gen == {k: v for k, v in rl_end.items() if k not in ("corpus_bpb", "vs_start")}
    items = rl_gen["items_correct"]
    assert len(items) == rl_gen["n"] and items.count("1") == rl_gen["correct"]
    # paired: rl against sft item by item; the net gain is the difference of the correct counts, and the sign test is
    # the one rl's own log printed against its start (the sft model)
    p, sft_gen = view["paired"]["rl_vs_sft"], view["stages"]["sft"]["tasks_gen"]
    assert {k: p[k] for k in ("gained", "lost", "units", "z")} == rl_end["vs_start"]
    assert p["delta_accuracy"] == round((rl_gen["correct"] - sft_gen["correct"]) / rl_gen["n"], 5) and p["n"] == rl_gen["n"]
    task_params = plan.job("bench", plan.chain["tiny"]["bench"]).spec(plan.store)["params"]["tasks"]
    assert p["units"] == len({it.prompt for it in task_eval.heldout_items(TaskSettings.of(task_params))}) and p["gained"] + p["lost"] <= p["units"]
    assert set(view["paired"]["rungs_vs_bf16"]) == {"int8", "mxfp4", "ternary"} and "rungs_vs_twin_bf16" not in view["paired"]
    assert all(r["within_one_se"] == (abs(r["delta_accuracy"]) <= r["se_base"]) for r in view["paired"]["rungs_vs_bf16"].values())


def test_paired_sign_counts_gains_and_losses_item_by_item():
    from dormouse.posttrain.task_eval import paired_sign

    base = [True, True, False, False, True, False]
    new = [True, False, True, True, True, True]  # gains items 2, 3, 5; loses item 1
    assert paired_sign(base, new) == {"gained": 3, "lost": 1, "z": 2 / 4 ** 0.5, "units": 6}
    assert paired_sign(base, base)["z"] == 0.0
    with pytest.raises(ValueError, match="not the same items"):
        paired_sign(base, new[:-1])
    # items 2, 3 and 5 ask one prompt: it counts once (its first item), so one gain, not three
    keys = ["a", "b", "c", "c", "d", "c"]
    assert paired_sign(base, new, keys) == {"gained": 1, "lost": 1, "z": 0.0, "units": 4}
    with pytest.raises(ValueError, match="with 5 keys"):
        paired_sign(base, new, keys[:-1])


def test_bench_schema_rejects_a_missing_stage(chain, bench_view):
    from dormouse.core.config import ConfigError

    work, _ = chain
    view = json.loads(json.dumps(bench_view))
    del view["stages"]["sft"]
    with pytest.raises(ConfigError, match="sft"):
        validate(view, "bench.schema.yaml", "bench.json")


def test_group_advantages_are_relative_and_zero_without_variance():
    from dormouse.posttrain.grpo import group_advantages

    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()  # unbiased: 0.5
    assert torch.allclose(adv[:4], (torch.tensor([1.0, 0.0, 0.0, 0.0]) - 0.25) / (std + 1e-4))
    assert torch.equal(adv[4:], torch.zeros(4))  # all correct: no signal


def test_grpo_loss_clips_the_ratio_per_sign_of_the_advantage_and_adds_k3():
    from dormouse.posttrain.grpo import grpo_loss

    old = torch.zeros(2, 3)
    new = torch.full((2, 3), math.log(1.5)).requires_grad_()  # ratio 1.5 everywhere
    adv = torch.tensor([[1.0], [-1.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])  # padding never counts
    loss = grpo_loss(new, old, None, adv, mask, 0.2, 0.0)
    # A > 0: min(1.5 A, 1.2 A) = 1.2 (clipped, no gradient); A < 0: min(-1.5, -1.2) = -1.5
    assert loss.item() == pytest.approx((-1.2 + 1.5) / 2)
    loss.backward()
    assert torch.equal(new.grad[0], torch.zeros(3)) and new.grad[1, 0] != 0 and new.grad[1, 1:].eq(0).all()
    same = grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[2.0]]),
                     torch.ones(1, 2, dtype=torch.bool), 0.2, 0.5)
    assert same.item() == pytest.approx(-2.0)  # ratio 1, KL 0 at the reference
    d = math.log(0.5)  # reference half as likely as the policy: k3 = e^d - d - 1 > 0
    kl = grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.full((1, 1), d), torch.zeros(1, 1),
                   torch.ones(1, 1, dtype=torch.bool), 0.2, 1.0)
    assert kl.item() == pytest.approx(math.exp(d) - d - 1) and kl.item() > 0


@pytest.mark.parametrize("rule,shuffle", [("bonferroni", False), ("select_then_confirm", True)])
def test_rl_trains_on_signal_groups_and_ships_the_selected_checkpoint(chain, monkeypatch, rule, shuffle):
    """The tiny chain model earns no reward, so a stand-in verifier (correct iff the reply's first byte
    is even) gives groups mixed rewards: rl must train on them, and the artifact must hold the weights of
    the checkpoint its dev curve selected, under either rule. The null arm (shuffle_rewards) trains the same groups
    on permuted rewards."""
    from safetensors.torch import load_file

    from dormouse.cli import main as dormouse_main
    from dormouse.core.store import artifact_digest
    from dormouse.posttrain import task_eval

    work, plan = chain
    job = json.loads(plan.job_json("rl", plan.chain["tiny"]["rl"]))
    rl = job["params"]["rl"]
    rl.update({"steps": 4, "prompts_per_step": 3, "group_size": 4, "warmup_steps": 1, "lr": 0.01,
               "select": {**rl["select"], "every": 2, "items_per_cell": 4, "min_z": 2.0, "rule": rule},
               **({"shuffle_rewards": True, "skip_cells": [f"{job['params']['tasks']['families'][-1]}@2"]}
                  if shuffle else {})})  # the fixture's curriculum climbs to 2: a family's top cell may be skipped
    digest = artifact_digest("rl", job["format_version"], job["params"],
                             {k: v["digest"] for k, v in job["inputs"].items()}, job["retractions"])
    out = Path(job["out"]).parent / digest
    job.update(digest=digest, out=str(out))
    monkeypatch.setattr(task_eval, "grade", lambda item, g: "correct" if g and g[0] % 2 == 0 else "wrong")
    monkeypatch.chdir(work)
    assert dormouse_main(["rl", "--job", json.dumps(job)]) == 0
    m = json.loads((work / out / "manifest.json").read_text())
    c = m["counters"]
    trained_steps = 4 - c.get("rl.steps_without_signal", 0)
    assert trained_steps > 0 and c["rl.updates"] == 2 * trained_steps
    assert 0 < c["rl.groups_trained"] <= 3 * trained_steps  # at most prompts_per_step of the 6 drawn groups
    assert c["rl.groups_trained"] <= c["rl.groups"] - c.get("rl.groups_zero_variance", 0)
    assert c["train.engram.rows_read"] > 0 and c["train.kda_path.torch"] > 0
    assert c.get("rl.null_shuffled_groups", 0) == (c["rl.groups_trained"] if shuffle else 0)
    skipped = job["params"]["tasks"]["families"][-1]
    assert c["rl.skipped_cells"] == int(shuffle) and (c.get(f"rl.cell_groups.{skipped}.2", 0) == 0) == shuffle
    drawn = {k.removeprefix("rl.cell_groups."): v for k, v in c.items() if k.startswith("rl.cell_groups.")}
    distinct = {k.removeprefix("rl.cell_prompts."): v for k, v in c.items() if k.startswith("rl.cell_prompts.")}
    assert distinct.keys() == drawn.keys() and all(0 < distinct[k] <= drawn[k] for k in drawn)
    sel = m["final"]["selection"]
    assert [s for s, _ in sel["curve"]] == [0, 2, 4] and sel["dev_items"] == 2 * 1 * 4
    assert [p["step"] for p in sel["vs_step0"]] == [2, 4] and sel["rule"] == rule and c["rl.steps_run"] == 4
    if rule == "select_then_confirm":
        assert [h["step"] for h in sel["halves"]] == [0, 2, 4] and sel["min_z"] == 2.0
        best = max(h["select"] or 0 for h in sel["halves"][1:])
        assert sel["candidate_step"] == min(h["step"] for h in sel["halves"][1:] if (h["select"] or 0) == best)
        assert sel["selected_step"] == (sel["candidate_step"] if sel["confirm"]["z"] >= sel["min_z"] else 0)
    else:
        assert sel["planned_checkpoints"] == 2 and sel["p_crit"] == 0.025 and [t["step"] for t in sel["tests"]] == [2, 4]
        passing = [t["step"] for t in sel["tests"] if t["p"] <= sel["p_crit"]]
        assert (sel["selected_step"] in passing) if passing else sel["selected_step"] == 0
    sft_dir = work / plan.artifact_dir("sft", plan.chain["tiny"]["sft"])
    shipped, sft_w = load_file(work / out / "model.safetensors"), load_file(sft_dir / "model.safetensors")
    same = all(torch.equal(shipped[k], sft_w[k]) for k in sft_w)
    assert same == (sel["selected_step"] == 0)  # step 0 ships the sft weights; a later step does not


def run_selection(monkeypatch, rows: list[list[bool]], min_z: float, rule: str = "select_then_confirm",
                  plateau: dict | None = None, steps: int | None = None):
    """Selection over steps 0, 2, 4, ... whose dev correctness is `rows` (run as the stage runs it: `steps` planned, a
    stop at the plateau); the weights move every step. Returns the selection and the weights of each step."""
    from dormouse.posttrain import task_eval
    from dormouse.posttrain.selection import Selection

    it = iter(rows)
    monkeypatch.setattr(task_eval, "correct", lambda *a, **k: next(it))
    model = torch.nn.Linear(2, 2)
    weights = {0: model.weight.detach().clone()}
    dev = [tasks.Item("add", 1, i, f"prompt {i}", "0") for i in range(len(rows[0]))]
    select = SelectSettings.of({"every": 2, "items_per_cell": 1, "rule": rule, "alpha": 0.05, "min_z": min_z,
                                "plateau": plateau})
    ran = 2 * (len(rows) - 1)  # the rows run out here: a run planned to `steps` that ended early
    steps = steps or ran
    sel = Selection(model, dev, 4, "cpu", "float32", select, steps)
    for step in range(1, ran + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights[step] = model.weight.detach().clone()
        if sel.due(step, steps):
            sel.check(step)
            if sel.stop():
                break
    sel.restore()
    return sel, model, weights


def test_selection_ships_the_select_halfs_best_when_the_confirm_half_confirms(monkeypatch):
    from dormouse.posttrain import selection

    sel_half, conf = selection.halves([f"prompt {i}" for i in range(40)])
    def row(right):
        return [i in right for i in range(40)]
    good = set(sel_half[:6]) | set(conf[:6])
    rows = [row(set()), row(set(sel_half[:3])), row(good), row(good | set(conf[6:9]))]  # steps 0, 2, 4, 6
    sel, model, weights = run_selection(monkeypatch, rows, min_z=1.7)
    assert torch.equal(model.weight, weights[4])  # 4 and 6 tie on the select half: the earlier ships
    r = sel.report()
    assert r["curve"] == [(0, 0.0), (2, 0.075), (4, 0.3), (6, 0.375)] and r["candidate_step"] == 4
    assert r["selected_step"] == 4 and r["confirm"] == {"gained": 6, "lost": 0, "z": 2.449, "units": len(conf)}
    assert r["vs_step0"][1] == {"step": 4, "gained": 12, "lost": 0, "z": 3.464, "units": 40}  # all the prompts
    assert r["dev_items"] == 40 and (r["select_items"], r["confirm_items"]) == (len(sel_half), len(conf))
    assert [h["step"] for h in r["halves"]] == [0, 2, 4, 6] and r["rule"] == "select_then_confirm"


def test_each_dev_check_reports_its_accuracy_per_cell_on_distinct_prompts(monkeypatch, capsys):
    """Which cells rl moves (a flat dev curve can hide a gain in one cell and a loss in another): each check's
    accuracy per family.difficulty counts each distinct prompt once, and the log says it at step 0 too."""
    from dormouse.posttrain import task_eval, tasks
    from dormouse.posttrain.selection import Selection

    dev = [tasks.Item("add", 1, 0, "1+1", "2"), tasks.Item("add", 1, 1, "1+1", "2"),  # a repeat: counted once
           tasks.Item("add", 1, 2, "2+2", "4"), tasks.Item("sort", 2, 3, "ba", "ab"), tasks.Item("sort", 2, 4, "dc", "cd")]
    rows = iter([[True, False, False, False, False], [True, True, True, True, False]])
    monkeypatch.setattr(task_eval, "correct", lambda *a, **k: next(rows))
    select = SelectSettings(every=2, items_per_cell=1, rule="bonferroni", alpha=0.05, min_z=1.7, plateau=None)
    sel = Selection(torch.nn.Linear(2, 2), dev, 4, "cpu", "float32", select, 2)
    sel.check(2)
    r = sel.report()
    assert r["cell_curve"] == [{"step": 0, "add.1": 0.5, "sort.2": 0.0}, {"step": 2, "add.1": 1.0, "sort.2": 0.5}]
    assert r["curve"] == [(0, 0.25), (2, 0.75)]  # 4 distinct prompts
    assert "[rl] dev@0: accuracy 0.25 over 4 distinct prompts; per cell add.1 0.5 sort.2 0.0" in capsys.readouterr().out


def test_selection_ships_step0_when_the_gain_is_on_the_select_half_alone(monkeypatch):
    from dormouse.posttrain import selection

    sel_half, conf = selection.halves([f"prompt {i}" for i in range(40)])
    base = [i in conf[:4] for i in range(40)]
    lucky = [i in sel_half or i in conf[:4] for i in range(40)]  # every select prompt, the confirm half unchanged
    sel, model, weights = run_selection(monkeypatch, [base, lucky, [False] * 40], min_z=1.7)
    r = sel.report()
    assert r["candidate_step"] == 2 and r["selected_step"] == 0 and torch.equal(model.weight, weights[0])
    assert r["confirm"] == {"gained": 0, "lost": 0, "z": 0.0, "units": len(conf)}
    assert r["vs_step0"][0]["z"] >= 4  # on all the prompts step 2 passes: what the old rule shipped
    # a min_z below any z ships the candidate
    sel, model, weights = run_selection(monkeypatch, [base, lucky, [False] * 40], min_z=-10.0)
    assert sel.report()["selected_step"] == 2 and torch.equal(model.weight, weights[2])


def test_bonferroni_ships_the_most_accurate_checkpoint_past_the_corrected_z(monkeypatch):
    """Checks at steps 2..8 of a run planned to 20 (10 checks at every 2): p_crit is 0.05 / 10. Step 4 passes (8
    gained, none lost: the exact sign test's p = 1/256) and step 6 ties it; step 8 is more accurate but p 0.0207 (15
    gained, 5 lost): step 4 ships."""
    n = 60
    def row(right):
        return [i in right for i in range(n)]
    base = set(range(40, 55))
    rows = [row(base), row(base | set(range(3))), row(base | set(range(8))), row(base | set(range(8))),
            row(set(range(45, 55)) | set(range(15)))]
    sel, model, weights = run_selection(monkeypatch, rows, 1.7, rule="bonferroni", steps=20)
    r = sel.report()
    assert r["planned_checkpoints"] == 10 and r["p_crit"] == 0.005 and r["selected_step"] == 4
    assert [t["p"] for t in r["tests"]] == [0.125, 0.003906, 0.003906, 0.02069] and torch.equal(model.weight, weights[4])
    # planned to these 4 checks only: p_crit 0.0125, and step 8's 0.0207 still falls short
    sel, *_ = run_selection(monkeypatch, rows, 1.7, rule="bonferroni")
    assert sel.report()["p_crit"] == 0.0125 and sel.report()["selected_step"] == 4
    # nothing passes: step 0 ships
    sel, model, weights = run_selection(monkeypatch, rows[:2], 1.7, rule="bonferroni", steps=20)
    assert sel.report()["selected_step"] == 0 and torch.equal(model.weight, weights[0])


def test_final_ships_the_weights_rl_ends_with_or_step0(monkeypatch):
    """rule final in the stage: no candidate copy is kept; a last checkpoint that passes ships as the model stands (the
    last step's weights), one that does not gives back step 0's, whatever a mid-run checkpoint scored."""
    n = 60
    def row(right):
        return [i in right for i in range(n)]
    base = set(range(40, 55))
    rows = [row(base), row(base | set(range(12))), row(base | set(range(6)))]  # steps 0, 2 (the peak), 4
    sel, model, weights = run_selection(monkeypatch, rows, 1.7, rule="final", steps=4)
    r = sel.report()
    assert r["rule"] == "final" and r["selected_step"] == 4 and sel.cand_state is None
    assert torch.equal(model.weight, weights[4])
    rows[2] = row(base | {0})
    sel, model, weights = run_selection(monkeypatch, rows, 1.7, rule="final", steps=4)
    assert sel.report()["selected_step"] == 0 and torch.equal(model.weight, weights[0])
    assert "final: the last checkpoint against step 0, p <= 0.05; step 4 gained 1 lost 0 p 0.5" in selection_line(sel.report())


def test_rl_stops_when_dev_accuracy_stops_rising(monkeypatch):
    """select.plateau {checkpoints: 3, min_rise: 0.01}: checks at 0.10, 0.20, 0.205, 0.20, 0.205 -> the last three
    (0.205, 0.20, 0.205) are not a point above the best before them (0.20): stopped after step 8 of a planned 40."""
    from dormouse.posttrain import selection

    n = 200
    accs = [0.10, 0.20, 0.205, 0.20, 0.205, 0.5]
    rows = [[i < round(a * n) for i in range(n)] for a in accs]
    sel, _, _ = run_selection(monkeypatch, rows, 1.7, rule="bonferroni", plateau={"checkpoints": 3, "min_rise": 0.01},
                              steps=40)
    assert [s for s, _ in sel.report()["curve"]] == [0, 2, 4, 6, 8]
    assert not selection.plateaued([0.1, 0.2, 0.21, 0.2], 3, 0.01)  # 0.21 rose a point over 0.1
    assert selection.plateaued([0.1, 0.2, 0.205, 0.2, 0.209], 3, 0.01)
    assert not selection.plateaued([0.1, 0.2, 0.205, 0.2, 0.21], 3, 0.01)


def test_selection_off_reports_no_step(monkeypatch):
    from dormouse.posttrain.selection import Selection

    sel = Selection(torch.nn.Linear(2, 2), [], 4, "cpu", "float32",
                    SelectSettings(every=0, items_per_cell=1, rule="bonferroni", alpha=0.05, min_z=1.7, plateau=None), 10)
    sel.restore()
    assert sel.report()["selected_step"] is None and sel.report()["dev_items"] == 0


def test_rl_diagnosis_cell_arithmetic():
    """Per-prompt successes k out of G: pass@1 is their mean rate, pass@G the share with any success, and only
    groups with 0 < k < G teach; a cell of equal prompts at the same mean would teach more often."""
    rd = _rl_diagnosis()
    r = rd.cell_row("add", 2, [0, 3, 1, 2], 3, [False, True, False, True], malformed=3)
    assert (r["pass1"], r["passG"], r["informative"], r["greedy"], r["malformed"]) == (0.5, 0.75, 0.5, 0.5, 0.25)
    assert r["informative_if_uniform"] == 0.75 and r["k_hist"] == "1,1,1,1"


def test_rl_diagnosis_runs_on_an_sft_artifact(chain, tmp_path):
    work, plan = chain
    art = work / plan.artifact_dir("sft", plan.chain["tiny"]["sft"])
    out, js = tmp_path / "d.tsv", tmp_path / "d.json"
    assert _rl_diagnosis().main(["--artifact", str(art), "--group-size", "3", "--prompts-per-cell", "3",
                                 "--device", "cpu", "--out", str(out), "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert [(r["family"], r["difficulty"]) for r in rows] == [("add", 1), ("reverse", 1), ("all", "all")]
    for r in rows:
        hist = [int(v) for v in r["k_hist"].split(",")]
        assert len(hist) == 4 and sum(hist) == r["prompts"]
        assert r["informative"] == round(sum(hist[1:3]) / r["prompts"], 4)
        assert r["pass1"] == round(sum(k * n for k, n in enumerate(hist)) / (3 * r["prompts"]), 4)
    assert rows[-1]["prompts"] == 6 and out.read_text().count("\n") == 4


def _rl_diagnosis():
    import benchmarks.rl_diagnosis as mod

    return mod


def test_advantages_with_and_without_the_std():
    from dormouse.posttrain.grpo import group_advantages

    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    mean = group_advantages(r, 4, "mean")
    torch.testing.assert_close(mean, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))
    std = group_advantages(r, 4, "mean_std")
    torch.testing.assert_close(std[:4], mean[:4] / (0.5 + 1e-4))  # the rare success magnified by 1/std
    assert not std[4:].any()


def test_token_norm_weighs_long_replies_by_their_length():
    from dormouse.posttrain.grpo import grpo_loss

    lp = torch.zeros(2, 4)
    mask = torch.tensor([[True, False, False, False], [True, True, True, True]])
    adv = torch.tensor([[1.0], [-1.0]])  # per byte -1 for reply 0, +1 for reply 1 (ratio 1)
    assert float(grpo_loss(lp, lp, None, adv, mask, 0.2, 0.0, "reply")) == 0.0  # (-1 + 1) / 2
    assert float(grpo_loss(lp, lp, None, adv, mask, 0.2, 0.0, "token")) == pytest.approx(3 / 5)  # (-1 + 4) / 5


def test_pass_rate_sampler_follows_the_cells_that_teach():
    import random

    from dormouse.posttrain.grpo import PassRateSampler

    s = PassRateSampler(["add", "sort"], range(1, 3), PassRateSettings(window=4, floor=0.05, prior=1.0))
    for _ in range(4):
        s.record("add", 1, torch.tensor([1.0, 1.0, 1.0]))  # always right: teaches nothing
        s.record("sort", 2, torch.tensor([0.0, 1.0, 0.0]))  # mixed: teaches
    assert s.share(("add", 1)) == 0.0 and s.share(("sort", 2)) == 1.0 and s.share(("add", 2)) == 1.0  # prior
    rng = random.Random(0)
    draws = Counter(s(rng) for _ in range(3000))
    assert draws[("add", 1)] / 3000 == pytest.approx(0.05 / 3.05, abs=0.01)  # only the floor keeps it
    assert draws[("sort", 2)] > 900 and draws[("add", 2)] > 900
    rep = s.report()
    assert rep["add/1"] == {"teaching_share": 0.0, "groups_measured": 4, "pass_rate": 1.0}


def test_new_rl_keys_at_their_defaults_leave_the_digest_alone():
    """rl.advantage, loss_norm and prompts came after rl format 9: at the values that run format 9's algorithm they
    stay out of the params (the pinned digests hold); any other value is a param."""
    from dormouse.core.config import load_preset, load_yaml
    from dormouse.planner.registry import RL_LATER_DEFAULTS, stage_params

    root = Path(__file__).resolve().parents[1]
    schema = load_yaml(root / "dormouse" / "schemas" / "preset.schema.yaml")["properties"]["rl"]["properties"]
    assert {k: schema[k]["default"] for k in RL_LATER_DEFAULTS} == RL_LATER_DEFAULTS
    preset = load_preset("tiny", root)
    base = stage_params("rl", preset)["rl"]
    assert not set(RL_LATER_DEFAULTS) & set(base) and "pass_rate" not in base
    preset["rl"] = {**preset["rl"], "prompts": "pass_rate", "advantage": "mean"}
    moved = stage_params("rl", preset)["rl"]
    assert moved["prompts"] == "pass_rate" and moved["advantage"] == "mean" and "pass_rate" in moved


def run_rl_variant(chain, rl_update) -> dict:
    """The tiny chain's rl job with rl_update(its rl params) -> new rl params, run under its own digest; the manifest,
    with the artifact's folder (relative to the chain's work dir) under "out"."""
    from dormouse.cli import main as dormouse_main
    from dormouse.core.store import artifact_digest

    work, plan = chain
    spec = copy.deepcopy(plan.job("rl", plan.chain["tiny"]["rl"]).spec(plan.store))  # the plan's own stays as planned
    spec["params"]["rl"] = rl_update(spec["params"]["rl"])
    spec["digest"] = artifact_digest("rl", spec["format_version"], spec["params"],
                                     {k: v["digest"] for k, v in spec["inputs"].items()}, spec["retractions"])
    spec["out"] = f"{plan.store}/rl/{spec['digest']}"
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert dormouse_main(["rl", "--job", json.dumps(spec)]) == 0
    finally:
        os.chdir(cwd)
    return {**json.loads((work / spec["out"] / "manifest.json").read_text()), "out": spec["out"]}


def test_rl_replays_corpus_rows_in_every_update(chain, monkeypatch):
    """rl.replay_rows: every update adds the next-byte loss of that many train-shard rows (counted, logged as replay_bpb
    per step), so the weights differ from the same run without it; 0 rows (the default) leaves the run as it was."""
    from safetensors.torch import load_file

    from dormouse.posttrain import task_eval

    monkeypatch.setattr(task_eval, "grade", lambda item, g: "correct" if g and g[0] % 2 == 0 else "wrong")
    work, _ = chain
    runs = {}
    for rows in (0, 2):
        m = run_rl_variant(chain, lambda rl, rows=rows: {**rl, "steps": 3, "prompts_per_step": 3, "group_size": 4,
                                                         "select": {**rl["select"], "every": 0},
                                                         **({"replay_rows": rows, "replay_seq_len": 32} if rows else {})})
        c, metrics = m["counters"], (work / m["out"] / "metrics.jsonl").read_text().splitlines()
        assert c["rl.updates"] > 0 and c.get("rl.replay_bytes", 0) == c["rl.updates"] * rows * 32
        assert m["final"]["algorithm"]["replay_rows"] == rows
        trained = [json.loads(line) for line in metrics if json.loads(line)["groups_trained"]]
        assert trained and all(("replay_bpb" in r) == bool(rows) for r in trained)
        runs[rows] = load_file(work / m["out"] / "model.safetensors")
    weights = list(runs.values())
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_skip_anchor_holds_the_skipped_cells_at_the_sft_models_bytes():
    """grpo.SkipAnchor: a pool of the skipped cells' rl-split prompts only, each drawn once before any comes back; its
    KL is zero for the SFT weights themselves and grows, with a gradient, once the weights move."""
    from dormouse.model.config import ModelConfig
    from dormouse.model.gpt import ByteLM
    from dormouse.posttrain.grpo import ANCHOR_PROMPTS_PER_CELL, SkipAnchor

    torch.manual_seed(0)
    model = ByteLM(ModelConfig.from_dict(TINY["model"]))
    c = Counter()
    cells = frozenset({("add", 1), ("reverse", 2)})
    anchor = SkipAnchor(model, cells, 5, 0, 8, torch.device("cpu"), "float32")
    c.update(anchor.counts)
    for f, d in cells:
        want = tasks.distinct_items("rl", f, d, ANCHOR_PROMPTS_PER_CELL)
        assert c[f"rl.anchor_prompts.{f}.{d}"] == len(want) > 0
    assert c["rl.anchor_prompts"] == len(anchor.x) == sum(c[f"rl.anchor_prompts.{f}.{d}"] for f, d in cells)
    drawn = [i for _ in range(len(anchor.x) // 5) for i in anchor.next_rows().tolist()]
    assert len(set(drawn)) == len(drawn)  # one pass through the pool: no prompt twice
    model.train()
    assert anchor.term(model, c, Counter()).item() < 1e-5  # the SFT weights: nothing to hold
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    kl = anchor.term(model, c, Counter())
    kl.backward()
    assert kl.item() > 1e-3 and any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert c["rl.anchor_rows_trained"] == 10  # the two terms taken


def test_skip_anchor_term_is_the_masked_kl_from_the_sft_bytes():
    """The term against torch's own KL (F.kl_div with log targets): over reply positions only, each row's mean, then
    the rows'; logits at prompt and padding positions change nothing."""
    import torch.nn.functional as F

    from dormouse.posttrain.grpo import SkipAnchor

    torch.manual_seed(1)
    n, w, v = 3, 7, 256
    anchor = SkipAnchor.__new__(SkipAnchor)
    anchor.x = torch.zeros(n, w, dtype=torch.long)
    anchor.mask = torch.zeros(n, w, dtype=torch.bool)
    for i, (a, b) in enumerate([(2, 5), (0, 7), (4, 5)]):
        anchor.mask[i, a:b] = True
    anchor.ref_lp = F.log_softmax(torch.randn(n, w, v), -1)
    anchor.rows, anchor.device, anchor.order, anchor.gen = n, torch.device("cpu"), [0, 1, 2], torch.Generator()
    logits = torch.randn(n, w, v)

    class Fixed(torch.nn.Module):
        def forward(self, x, counters=None):
            return logits, None

    kl = anchor.term(Fixed(), Counter(), Counter())
    per = F.kl_div(F.log_softmax(logits, -1), anchor.ref_lp, log_target=True, reduction="none").sum(-1)
    want = torch.stack([per[i][anchor.mask[i]].mean() for i in range(n)]).mean()
    assert torch.allclose(kl, want, atol=1e-6)
    logits[~anchor.mask] = torch.randn(int((~anchor.mask).sum()), v)  # outside the replies: the same term
    anchor.order = [0, 1, 2]
    assert torch.allclose(anchor.term(Fixed(), Counter(), Counter()), want, atol=1e-6)


def test_rl_anchor_rows_need_skipped_cells():
    from dormouse.core.config import ConfigError, load_preset
    from dormouse.planner.registry import stage_params

    preset = load_preset("tiny", Path(__file__).resolve().parents[1])
    preset["rl"] = {**preset["rl"], "anchor_rows": 8}
    with pytest.raises(ConfigError, match="rl.anchor_rows .* rl.skip_cells names none"):
        stage_params("rl", preset)
    preset["rl"]["skip_cells"] = ["reverse@2"]
    assert stage_params("rl", preset)["rl"]["anchor_rows"] == 8


def test_rl_anchors_the_skipped_cells_in_every_update(chain, monkeypatch):
    """rl.anchor_rows: every update adds the anchor's KL over that many skipped-cell prompts (counted, logged as
    anchor_kl per step), so the weights differ from the same run without it."""
    from safetensors.torch import load_file

    monkeypatch.setattr(task_eval, "grade", lambda item, g: "correct" if g and g[0] % 2 == 0 else "wrong")
    work, _ = chain
    runs = {}
    for rows in (0, 3):
        m = run_rl_variant(chain, lambda rl, rows=rows: {**rl, "steps": 3, "prompts_per_step": 3, "group_size": 4,
                                                         "select": {**rl["select"], "every": 0}, "skip_cells": ["reverse@2"],
                                                         **({"anchor_rows": rows} if rows else {})})
        c, metrics = m["counters"], (work / m["out"] / "metrics.jsonl").read_text().splitlines()
        assert c["rl.updates"] > 0 and c.get("rl.anchor_rows_trained", 0) == c["rl.updates"] * rows
        assert (c.get("rl.anchor_prompts.reverse.2", 0) > 0) == bool(rows) and "rl.anchor_prompts.add.1" not in c
        trained = [json.loads(line) for line in metrics if json.loads(line)["groups_trained"]]
        assert trained and all(("anchor_kl" in r) == bool(rows) for r in trained)
        runs[rows] = load_file(work / m["out"] / "model.safetensors")
    weights = list(runs.values())
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_rl_with_pass_rate_prompts_and_dr_grpo_runs(chain):
    """The rl stage under prompts: pass_rate, advantage: mean, loss_norm: token: it trains, counts every cell and
    reports the sampler's view of each."""
    m = run_rl_variant(chain, lambda rl: {**rl, "prompts": "pass_rate", "advantage": "mean", "loss_norm": "token",
                                          "pass_rate": {"window": 4, "floor": 0.05, "prior": 1.0}, "steps": 4})
    final, c = m["final"], m["counters"]
    assert final["algorithm"] == {"advantage": "mean", "loss_norm": "token", "prompts": "pass_rate", "shuffle_rewards": False,
                                  "skip_cells": [], "replay_rows": 0, "replay_seq_len": 256, "replay_weight": 1.0,
                                  "anchor_rows": 0, "anchor_weight": 1.0}
    assert set(final["pass_rate_cells"]) == {"add/1", "add/2", "reverse/1", "reverse/2"}
    groups = {k: v for k, v in c.items() if k.startswith("rl.cell_groups.")}
    assert sum(groups.values()) == c["rl.groups"] == 4 * 2 * 2  # steps x prompts_per_step x oversample


def test_rl_in_smalls_shape_runs_skipping_cells_and_testing_the_last_checkpoint(chain):
    """small's recipe on the tiny chain: pass-rate prompts over the cells left after skip_cells, dev checks that only
    draw the curve and the final rule's one test; the skipped cells are never drawn."""
    m = run_rl_variant(chain, lambda rl: {**rl, "prompts": "pass_rate", "skip_cells": ["add@1", "reverse@2"],
                                          "pass_rate": {"window": 4, "floor": 0.05, "prior": 1.0}, "steps": 4,
                                          "select": {**rl["select"], "every": 2, "rule": "final", "plateau": None}})
    final, c = m["final"], m["counters"]
    assert set(final["pass_rate_cells"]) == {"add/2", "reverse/1"} and c["rl.skipped_cells"] == 2
    assert not any(k in c for k in ("rl.cell_groups.add.1", "rl.cell_groups.reverse.2"))
    sel = final["selection"]
    assert sel["rule"] == "final" and [t["step"] for t in sel["tests"]] == [2, 4] and sel["candidate_step"] == 4
    assert [s for s, _ in sel["curve"]] == [0, 2, 4] and sel["selected_step"] in (0, 4)


@pytest.mark.slow
def test_gpu_rl_acceptance_script_runs_the_arms_side_by_side(chain, tmp_path):
    """benchmarks/gpu_rl_acceptance.sh on CPU with two tiny rl seeds and a null arm (rl.shuffle_rewards): rl, export and
    bench of the arms side by side, then rl_acceptance.py on their bench.json files, the null arm's given as --null;
    called again, it finds every stage built."""
    import subprocess
    import sys

    from pipeline_util import plan_in

    work, plan = chain
    jobs = tmp_path / "jobs"
    for arm, seed, extra in (("a", 1, ""), ("a", 2, ""), ("null", 1, ",rl.shuffle_rewards=true")):  # 0: the fixture's
        arm_plan = plan_in(work, {**plan.config, "set": f"rl.seed={seed}{extra}"})
        d = jobs / f"{arm}_s{seed}"
        d.mkdir(parents=True)
        for stage in ("rl", "export", "bench"):
            (d / f"tiny_{stage}.json").write_text(arm_plan.job_json(stage, arm_plan.chain["tiny"][stage]))
    env = dict(os.environ, PY=sys.executable, PRESET="tiny", ARMS="a_s1 a_s2 null_s1", JOBS=str(jobs), OUT=str(tmp_path / "out"),
               LOGS=str(tmp_path / "logs"), MIN_RL_S="1", MIN_EXPORT_S="1", MIN_BENCH_S="1", DIAG_G="2", DIAG_PROMPTS="2")
    script = [os.environ.get("BASH", "bash"), str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_rl_acceptance.sh")]
    first = subprocess.run(script, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "rl: a_s1 a_s2 null_s1 side by side" in first.stdout and "all arms benched" in first.stdout
    import tarfile

    with tarfile.open(tmp_path / "out" / "rl_acceptance.tar") as tar:  # one file back from the device
        names = {Path(n).name for n in tar.getnames()}
    assert {"a_s1_rl.log", "a_s2_bench.log", "bench_a_s1.json", "rl_acceptance_a.json", "rl_diagnosis.json",
            "rl_dev_curves_a.png"} <= names
    assert "cells where" in first.stdout  # the diagnosis of the sft model ran beside the rl arms
    result = json.loads((tmp_path / "logs" / "rl_acceptance_a.json").read_text())
    assert len(result["seeds"]) == 2 and result["one_sft"] and result["distinct_rl"]
    assert result["null"]["sft"] == result["seeds"][0]["sft"] and not (tmp_path / "logs" / "rl_acceptance_null.json").exists()
    assert f"a: rl_acceptance exit {0 if result['accepted'] else 1}" in first.stdout
    again = subprocess.run(script, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and all(f"{s}: built for every arm" in again.stdout for s in ("rl", "export", "bench"))


def test_gpu_rl_acceptance_script_names_what_the_arms_need_before_any_stage(tmp_path):
    """An arm whose bench reads a pretrain artifact that is not here stops the script at once, naming it (session 25
    spent rl and export of four arms on the GPU, then found bench's pretrain missing)."""
    import subprocess
    import sys

    d = tmp_path / "jobs" / "a_s0"
    d.mkdir(parents=True)
    for stage, inputs in (("rl", {"sft": "s1"}), ("export", {"rl": "r1"}), ("bench", {"pretrain": "p1", "rl": "r1"})):
        job = {"inputs": {k: {"kind": "artifact", "stage": k, "digest": v} for k, v in inputs.items()},
               "out": f"results/store/{stage}/x"}
        (d / f"tiny_{stage}.json").write_text(json.dumps(job))
    (tmp_path / "results/store/sft/s1").mkdir(parents=True)
    (tmp_path / "results/store/sft/s1/manifest.json").write_text("{}")
    cache = tmp_path / "triton" / "K3Y"  # the lease's autotune results come back in the tar, even from a stop
    cache.mkdir(parents=True)
    (cache / "fwd.autotune.json").write_text("{}")
    env = dict(os.environ, PY=sys.executable, PRESET="tiny", ARMS="a_s0", JOBS=str(tmp_path / "jobs"),
               OUT=str(tmp_path / "out"), LOGS=str(tmp_path / "logs"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    script = [os.environ.get("BASH", "bash"), str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_rl_acceptance.sh")]
    r = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "results/store/pretrain/p1" in r.stdout and "sft/s1" not in r.stdout
    assert not (tmp_path / "logs" / "a_s0_rl.log").exists()  # no stage started
    import tarfile

    with tarfile.open(tmp_path / "out" / "rl_acceptance.tar") as tar:
        inner = tarfile.open(fileobj=tar.extractfile("./triton_autotune.tgz"))
        assert inner.getnames() == ["./K3Y/fwd.autotune.json"]
