"""A/B experiments: the verdict rule on synthetic numbers, and the plumbing under Snakemake on CPU."""

import json
from pathlib import Path

import pytest
import yaml
from pipeline_util import configure
from test_workflow import job_counts, snakemake

from dormouse.core.config import load_preset
from dormouse.planner.experiments import judge, verdict
from dormouse.planner.registry import stage_params

# a pretrain manifest's train params, as the tiny preset's job digests them
TRAIN_PARAMS = stage_params("pretrain", load_preset("tiny", Path(__file__).resolve().parents[1]))["train"]


def run(bpb: float, engram_rows: int = 10, engram: bool = True, window: int = 1000, shard: str = "s" * 20,
        qat: dict | None = None, qat_steps: int = 0, qat_evals: int = 0) -> dict:
    counters = {"train.kda_path.torch": 4, "eval.kda_path.torch": 2, "train.loop.iterations": 4,
                "eval.loop.iterations": 2, "train.engram.rows_read": engram_rows, "eval.engram.rows_read": engram_rows}
    if qat:
        counters.update({"train.qat.steps": qat_steps, "eval.qat.evals": qat_evals})
    train = {**TRAIN_PARAMS, "steps": 100, **({"qat": qat} if qat else {})}
    return {"digest": f"{int(bpb * 1e4):020d}", "curve": [],
            "manifest": {"params": {"model": {"engram": engram}, "train": train}, "counters": counters,
                         "inputs": {"shard": shard}, "final": {"eval_bpb": bpb, "eval_bytes": window}}}


SPEC = {"base": "tiny", "seeds": [0, 1, 2], "steps": 100, "control": {}, "arms": {"a": {"model": {"engram": False}}}}


@pytest.mark.parametrize("control, arm, expected", [
    ([2.00, 2.02, 2.01], [1.90, 1.91, 1.92], "WIN"),   # lower by 0.10, spreads 0.02
    ([2.00, 2.02, 2.01], [2.10, 2.11, 2.12], "LOSE"),
    ([2.00, 2.10, 2.05], [1.98, 2.00, 2.02], "TIE"),   # lower by 0.05 but the control spreads 0.10
    ([2.00, 2.01, 2.02], [1.80, 2.00, 1.90], "TIE"),   # lower by 0.11 but the arm spreads 0.20
])
def test_verdict_rule_on_synthetic_numbers(control, arm, expected):
    assert judge(control, arm)[0] == expected


def test_delta_is_arm_minus_control_and_one_seed_has_no_spread():
    assert judge([2.0], [1.9]) == ("WIN", pytest.approx(-0.1))
    assert judge([2.0], [2.0]) == ("TIE", 0.0)


def test_an_inert_arm_is_invalid_never_a_verdict():
    runs = {"control": {str(s): run(2.0 + s / 100) for s in range(3)},
            "a": {"0": run(1.5), "1": run(1.5, engram_rows=0), "2": run(1.5)}}  # engram on, never read in seed 1
    spec = {**SPEC, "arms": {"a": {}}}
    out = verdict(spec, runs)
    assert out["arms"]["a"]["verdict"] == "INVALID" and out["arms"]["a"]["delta_bpb"] is None
    assert any("engram enabled but no rows read" in p for p in out["arms"]["a"]["invalid_because"])


def test_a_qat_finish_that_left_no_trace_is_invalid():
    """train.qat's finish must show steps and evals through its rung; a PTQ control (fraction 0) needs only the eval."""
    ptq, finish = {"rung": "ternary", "fraction": 0}, {"rung": "ternary", "fraction": 0.2}
    runs = {"control": {str(s): run(3.0 + s / 100, qat=ptq, qat_evals=1) for s in range(3)},
            "a": {"0": run(2.0, qat=finish, qat_steps=20, qat_evals=2), "1": run(2.0, qat=finish, qat_evals=2),
                  "2": run(2.0, qat=finish, qat_steps=20)}}
    out = verdict({**SPEC, "arms": {"a": {}}}, runs)
    assert "control" not in out["invalid"] and out["arms"]["a"]["verdict"] == "INVALID"
    assert out["arms"]["a"]["invalid_because"] == ["seed 1: train.qat on but no step trained through ternary",
                                                   "seed 2: train.qat on but no eval ran through ternary"]
    runs["a"] = {str(s): run(2.0 + s / 100, qat=finish, qat_steps=20, qat_evals=2) for s in range(3)}
    assert verdict({**SPEC, "arms": {"a": {}}}, runs)["arms"]["a"]["verdict"] == "WIN"


def test_a_qat_verdict_sets_each_rung_against_the_controls_bf16_model():
    """Issue #28's figure: the arm's rung BPB minus the control's bf16 (master) BPB of the same budget, and the
    finish's cost to the bf16 weights."""
    ptq, finish = {"rung": "ternary", "fraction": 0}, {"rung": "ternary", "fraction": 0.2}
    runs = {"control": {str(s): run(4.0, qat=ptq, qat_evals=1) for s in range(2)},
            "a": {str(s): run(1.64, qat=finish, qat_steps=20, qat_evals=2) for s in range(2)}}
    for seed, (ctl_master, arm_master) in enumerate([(1.60, 1.61), (1.62, 1.63)]):
        runs["control"][str(seed)]["manifest"]["final"]["eval_bpb_master"] = ctl_master
        runs["a"][str(seed)]["manifest"]["final"]["eval_bpb_master"] = arm_master
    arm = verdict({**SPEC, "seeds": [0, 1], "arms": {"a": {}}}, runs)["arms"]["a"]
    assert arm["delta_bpb_vs_control_bf16"] == pytest.approx(1.64 - 1.61)
    assert arm["bf16_cost_of_finish"] == pytest.approx(0.01)
    assert arm["seeds"]["1"]["eval_bpb_master"] == 1.63
    plain = verdict({**SPEC, "arms": {"a": {}}}, {k: {str(s): run(2.0) for s in range(3)} for k in ("control", "a")})
    assert "delta_bpb_vs_control_bf16" not in plain["arms"]["a"]  # not a QAT experiment


@pytest.mark.parametrize("arm_bpb, expected", [
    ((1.64, 1.64), "PASS"),           # +0.03 over the control's bf16 against a limit of 0.05; spreads 0.01
    ((1.70, 1.70), "FAIL"),           # +0.09
    ((1.655, 1.665), "WITHIN_SPREAD"),  # +0.05: at the limit, inside the spread
])
def test_a_qat_acceptance_judges_each_rung_against_its_limit_by_the_spread_rule(arm_bpb, expected):
    """Issue #28's pass criterion: the arm's rung BPB minus the control's bf16 (master) BPB, at most the limit (ternary
    0.05), judged by the larger of the control's bf16 spread and the arm's own, as the verdict is. The WIN against the
    PTQ control says nothing about it: an arm 10x over the limit still beats +2.98."""
    ptq, finish = {"rung": "ternary", "fraction": 0}, {"rung": "ternary", "fraction": 0.2}
    runs = {"control": {str(s): run(4.0, qat=ptq, qat_evals=1) for s in range(2)},
            "a": {str(s): run(b, qat=finish, qat_steps=20, qat_evals=2) for s, b in enumerate(arm_bpb)}}
    for seed, (ctl_master, arm_master) in enumerate([(1.60, 1.61), (1.62, 1.63)]):
        runs["control"][str(seed)]["manifest"]["final"]["eval_bpb_master"] = ctl_master
        runs["a"][str(seed)]["manifest"]["final"]["eval_bpb_master"] = arm_master
    spec = {**SPEC, "seeds": [0, 1], "arms": {"a": {}}, "qat_acceptance": {"max_delta_bpb_vs_bf16": 0.05, "max_finish_fraction": 0.2}}
    out = verdict(spec, runs)
    arm = out["arms"]["a"]
    assert arm["verdict"] == "WIN" and arm["qat_acceptance"]["verdict"] == expected
    assert arm["qat_acceptance"]["margin"] == pytest.approx(max(0.02, abs(arm_bpb[1] - arm_bpb[0])))
    assert out["qat_acceptance"]["max_delta_bpb_vs_bf16"] == 0.05 and "qat_acceptance" not in out["arms"]["control"]


def test_a_qat_acceptance_refuses_a_finish_longer_than_its_fraction(tmp_path):
    from dormouse.core.config import ConfigError
    from dormouse.planner.experiments import load_experiments

    root = tmp_path
    (root / "config" / "experiments").mkdir(parents=True)
    spec = {"base": "small", "seeds": [0], "steps": 100, "control": {"train": {"qat": {"rung": "ternary", "fraction": 0}}},
            "arms": {"long": {"train": {"qat": {"rung": "ternary", "fraction": 0.3}}}},
            "qat_acceptance": {"max_delta_bpb_vs_bf16": 0.05}}
    (root / "config" / "experiments" / "x.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="arm long finishes 0.3 of the steps through its rung, more than "
                                          r"qat_acceptance.max_finish_fraction 0.2"):
        load_experiments(root)
    spec["arms"]["long"]["train"]["qat"]["fraction"] = 0.2
    (root / "config" / "experiments" / "x.yaml").write_text(yaml.safe_dump(spec))
    assert load_experiments(root)[0].spec["qat_acceptance"]["max_finish_fraction"] == 0.2


def ptq_control(bpb: float, master: float, ptq: dict[str, float], evals: bool = True) -> dict:
    """A control trained as usual whose final weights were also measured through `ptq`'s rungs (train.ptq_rungs)."""
    r = run(master)
    r["manifest"]["params"]["train"]["ptq_rungs"] = sorted(ptq)
    r["manifest"]["final"]["eval_bpb_ptq"] = ptq
    r["manifest"]["counters"].update({f"eval.ptq.{k}.evals": 1 for k in ptq} if evals else {})
    return r


def qat_arm(bpb: float, master: float, rung: str) -> dict:
    r = run(bpb, qat={"rung": rung, "fraction": 0.2}, qat_steps=20, qat_evals=2)
    r["manifest"]["final"]["eval_bpb_master"] = master
    return r


def test_one_control_serves_every_rung_through_its_ptq():
    """small_qat's shape: the control measures each rung after training (train.ptq_rungs), each arm finishes through
    one; the verdict sets an arm against the control's PTQ of its own rung, the acceptance against the control's bf16
    BPB with that rung's limit."""
    ptq = {"ternary": 4.6, "mxfp4": 1.64, "nvfp4": 1.63}
    runs = {"control": {"0": ptq_control(1.60, 1.60, {k: v for k, v in ptq.items()}),
                        "1": ptq_control(1.61, 1.61, {k: v + 0.01 for k, v in ptq.items()})},
            "t": {str(s): qat_arm(1.64 + s / 1000, 1.605, "ternary") for s in range(2)},   # +0.04 vs bf16: limit 0.05
            "m": {str(s): qat_arm(1.625 + s / 1000, 1.605, "mxfp4") for s in range(2)},     # +0.02: limit 0.01
            "n": {str(s): qat_arm(1.66 + s / 1000, 1.605, "nvfp4") for s in range(2)}}      # worse than its PTQ
    spec = {**SPEC, "seeds": [0, 1], "arms": {"t": {}, "m": {}, "n": {}},
            "qat_acceptance": {"max_delta_bpb_vs_bf16": {"ternary": 0.05, "mxfp4": 0.01, "nvfp4": 0.01}}}
    out = verdict(spec, runs)
    arms = out["arms"]
    assert arms["control"]["mean_bpb"] == pytest.approx(1.605)  # the control's own eval: bf16
    assert arms["control"]["mean_bpb_ptq"] == {"mxfp4": 1.645, "nvfp4": 1.635, "ternary": 4.605}
    assert [arms[a]["rung"] for a in "tmn"] == ["ternary", "mxfp4", "nvfp4"]
    assert arms["t"]["control_mean_bpb"] == pytest.approx(4.605) and arms["t"]["verdict"] == "WIN"
    assert arms["m"]["delta_bpb"] == pytest.approx(1.6255 - 1.645) and arms["m"]["verdict"] == "WIN"
    assert arms["n"]["delta_bpb"] == pytest.approx(1.6605 - 1.635) and arms["n"]["verdict"] == "LOSE"
    assert [arms[a]["qat_acceptance"]["limit"] for a in "tmn"] == [0.05, 0.01, 0.01]
    assert [arms[a]["qat_acceptance"]["verdict"] for a in "tmn"] == ["PASS", "FAIL", "FAIL"]
    assert arms["t"]["delta_bpb_vs_control_bf16"] == pytest.approx(1.6405 - 1.605)
    assert arms["t"]["bf16_cost_of_finish"] == pytest.approx(0.0)

    runs["control"]["1"] = ptq_control(1.61, 1.61, {"ternary": 4.61})  # seed 1 never measured mxfp4
    with pytest.raises(ValueError, match="the control never measured mxfp4"):
        verdict(spec, runs)
    runs["control"]["1"] = ptq_control(1.61, 1.61, {k: v + 0.01 for k, v in ptq.items()}, evals=False)
    out = verdict(spec, runs)
    assert all(out["arms"][a]["verdict"] == "INVALID" for a in "tmn")
    assert "control: seed 1: train.ptq_rungs lists mxfp4 but no eval ran through it" in out["arms"]["m"]["invalid_because"]


def test_a_qat_acceptance_plans_only_arms_with_a_rung_the_control_measures():
    """The plan (Experiment.runs) refuses what the verdict could not judge, before any GPU minute: an arm without a
    rung, a rung without a limit, a control that never measures an arm's rung or that finishes through one."""
    from dormouse.core.config import ConfigError, validate
    from dormouse.planner.experiments import Experiment

    root = Path(__file__).resolve().parents[1]

    def plan(control: dict, arms: dict, limit=0.05):
        spec = validate({"base": "tiny", "seeds": [0], "steps": 10, "control": control, "arms": arms,
                         "qat_acceptance": {"max_delta_bpb_vs_bf16": limit}}, "experiment.schema.yaml", "x.yaml")
        return Experiment("x", "x.yaml", spec).runs(root)

    finish = {"train": {"qat": {"rung": "mxfp4", "fraction": 0.2}}}
    assert len(plan({"train": {"ptq_rungs": ["mxfp4"]}}, {"a": finish})) == 2
    assert len(plan({"train": {"qat": {"rung": "mxfp4", "fraction": 0}}}, {"a": finish}, {"mxfp4": 0.01})) == 2
    with pytest.raises(ConfigError, match="arm a sets no train.qat"):
        plan({"train": {"ptq_rungs": ["mxfp4"]}}, {"a": {}})
    with pytest.raises(ConfigError, match="has no limit for arm a's rung mxfp4"):
        plan({"train": {"ptq_rungs": ["mxfp4"]}}, {"a": finish}, {"ternary": 0.05})
    with pytest.raises(ConfigError, match=r"the control never measures mxfp4 \(arm a's rung\)"):
        plan({"train": {"ptq_rungs": ["nvfp4"]}}, {"a": finish})
    with pytest.raises(ConfigError, match="the control trains through ternary"):
        plan({"train": {"qat": {"rung": "ternary", "fraction": 0.1}}}, {"a": finish})


def test_a_branching_experiment_plans_arms_that_continue_their_seeds_control():
    """branch: the control keeps a checkpoint at every arm's finish start and each arm's pretrain takes its seed's
    control as its trunk; an arm that is more than its control plus a finish, or has no finish, is refused."""
    from dormouse.core.config import ConfigError, validate
    from dormouse.planner.experiments import Experiment

    root = Path(__file__).resolve().parents[1]

    def runs(arms: dict):
        spec = validate({"base": "tiny", "seeds": [0, 1], "steps": 100, "branch": True,
                         "control": {"train": {"ptq_rungs": ["mxfp4", "ternary"]}}, "arms": arms}, "experiment.schema.yaml", "x.yaml")
        exp = Experiment("x", "x.yaml", spec)
        return exp, exp.runs(root)

    exp, out = runs({"a": {"train": {"qat": {"rung": "mxfp4", "fraction": 0.2}}},
                     "b": {"train": {"qat": {"rung": "ternary", "fraction": 0.1}}}})
    assert out["ab/x/control/s1"][2]["train"]["keep_checkpoints"] == [80, 90]
    assert "keep_checkpoints" not in out["ab/x/a/s1"][2]["train"] or out["ab/x/a/s1"][2]["train"]["keep_checkpoints"] == []
    assert exp.trunk("a", 1) == "ab/x/control/s1" and exp.trunk("control", 1) is None
    with pytest.raises(ConfigError, match=r"arm a differs from the control in \['train.lr'\] besides its finish"):
        runs({"a": {"train": {"qat": {"rung": "mxfp4", "fraction": 0.2}, "lr": 0.5}}})
    with pytest.raises(ConfigError, match="arm a has no finish"):
        runs({"a": {"train": {"qat": {"rung": "mxfp4", "fraction": 0}}}})


def test_a_branch_trunk_trains_as_usual_and_a_rung_arm_needs_a_control_that_measures_it():
    """Without qat_acceptance too: an arm through a rung against a control that never measured it would fail only at
    the verdict, after every GPU run; a branched arm's trunk that itself trains through a rung is no trunk."""
    from dormouse.core.config import ConfigError, validate
    from dormouse.planner.experiments import Experiment

    root = Path(__file__).resolve().parents[1]

    def runs(control: dict, branch: bool = False):
        spec = validate({"base": "tiny", "seeds": [0], "steps": 100, "branch": branch, "control": control,
                         "arms": {"a": {"train": {"qat": {"rung": "mxfp4", "fraction": 0.2}}}}}, "experiment.schema.yaml", "x")
        return Experiment("x", "x.yaml", spec).runs(root)

    with pytest.raises(ConfigError, match=r"the control never measures mxfp4 \(arm a's rung\)"):
        runs({})
    assert len(runs({"train": {"ptq_rungs": ["mxfp4"]}})) == 2
    with pytest.raises(ConfigError, match="branch: the control trains through mxfp4"):
        runs({"train": {"qat": {"rung": "mxfp4", "fraction": 0.5}}}, branch=True)


def test_an_arm_branched_from_another_build_of_its_control_is_invalid():
    """A control rebuilt on another GPU keeps its digest, not its weights: an arm that continued the earlier build
    (final.branched_from) is no finish of the control the verdict reads."""
    ptq = {"ternary": 4.0}
    runs = {"control": {str(s): ptq_control(1.6, 1.6, ptq) for s in range(2)},
            "a": {str(s): qat_arm(1.64, 1.6, "ternary") for s in range(2)}}
    for s in ("0", "1"):
        ctl = runs["control"][s]
        ctl["digest"] = f"c{s}" * 10
        ctl["manifest"]["files"] = {"checkpoints/step-00000080/model.safetensors": {"sha256": f"{s}" * 64, "size": 1}}
        runs["a"][s]["manifest"]["final"]["branched_from"] = {"digest": ctl["digest"], "step": 80, "weights_sha256": f"{s}" * 64}
    spec = {**SPEC, "seeds": [0, 1], "arms": {"a": {}}}
    assert verdict(spec, runs)["arms"]["a"]["verdict"] == "WIN"
    runs["a"]["1"]["manifest"]["final"]["branched_from"]["weights_sha256"] = "f" * 64
    arm = verdict(spec, runs)["arms"]["a"]
    assert arm["verdict"] == "INVALID" and arm["invalid_because"][0].startswith(
        f"seed 1: branched from another build of its control {'c1' * 10}")


def test_a_retracted_trunk_supersedes_its_branches_whatever_their_digests_sort():
    """dormouse retractions: pretrain depends on pretrain now (a branch's trunk); the trunk's replacement must be known
    before its branch's, which sorting by digest alone does not give."""
    from dormouse.planner.retractions import superseded
    from dormouse.core.store import artifact_digest

    arm_params = {"model": {"d": 1}, "train": {"qat": {"rung": "ternary", "fraction": 0.2}}}
    for lr in range(500):
        ctl_params = {"model": {"d": 1}, "train": {"keep_checkpoints": [80], "lr": lr}}
        ctl = artifact_digest("pretrain", 1, ctl_params, {"shard": "s" * 20}, [])
        arm = artifact_digest("pretrain", 1, arm_params, {"shard": "s" * 20, "trunk": ctl}, [])
        if arm < ctl:
            break
    manifests = {("pretrain", ctl): {"params": ctl_params, "inputs": {"shard": "s" * 20}, "retractions": [], "format_version": 1},
                 ("pretrain", arm): {"params": arm_params, "inputs": {"shard": "s" * 20, "trunk": ctl}, "retractions": [],
                                     "format_version": 1}}
    rows = superseded({"id": "R9", "stage": "pretrain", "match": {"train.lr": lr}}, manifests)
    assert [(r["old"], r["why"]) for r in rows] == [(ctl, "matched"), (arm, "upstream")]


def test_verdict_names_window_budget_seeds_and_digests():
    runs = {"control": {str(s): run(2.0 + s / 100) for s in range(3)},
            "a": {str(s): run(1.8 + s / 100, engram=False, engram_rows=0) for s in range(3)}}
    out = verdict(SPEC, runs)
    assert out["arms"]["a"]["verdict"] == "WIN" and out["arms"]["a"]["delta_bpb"] == pytest.approx(-0.2)
    assert out["eval_window_bytes"] == 1000 and out["budget"]["steps"] == 100 and out["seeds"] == [0, 1, 2]
    assert out["arms"]["control"]["seeds"]["0"]["digest"] == run(2.0)["digest"]


def test_runs_on_different_windows_are_refused():
    runs = {"control": {"0": run(2.0)}, "a": {"0": run(1.9, window=999)}}
    with pytest.raises(ValueError, match="different eval windows"):
        verdict({**SPEC, "seeds": [0]}, runs)
    # as many bytes, but of another eval tail (an arm that changes data.filter or data.shard)
    runs = {"control": {"0": run(2.0)}, "a": {"0": run(1.9, shard="t" * 20)}}
    with pytest.raises(ValueError, match="different eval windows"):
        verdict({**SPEC, "seeds": [0]}, runs)


@pytest.mark.slow
def test_experiment_expands_arms_by_seeds_shares_stages_and_never_reruns(workdir, small_corpus, quality_examples):
    configure(workdir, small_corpus, *quality_examples)
    exp = {"base": "tiny", "seeds": [0, 1], "steps": 12, "control": {},
           "arms": {"no_engram": {"model": {"engram": False}}}}
    overrides = {"model": {"d_model": 32, "n_heads": 2, "head_dim": 16, "ffn_hidden": 64, "n_core": 1,
                           "engram": True, "engram_rows": 512, "engram_dim": 8},
                 "train": {"batch_size": 2, "seq_len": 32, "eval_every": 6, "eval_bytes": 1024, "ckpt_every": 6,
                           "log_every": 3, "warmup_steps": 2}}
    exp["control"] = overrides
    exp["arms"]["no_engram"] = {**overrides, "model": {**overrides["model"], "engram": False}}
    (workdir / "config" / "experiments" / "tiny_ab.yaml").write_text(yaml.safe_dump(exp))
    target = "results/ab/tiny_ab/verdict.json"
    counts = job_counts(snakemake(workdir, "-n", target).stdout)
    assert counts == {"filter": 1, "shard": 1, "pretrain": 4, "verdict": 1, "total": 7}, counts
    snakemake(workdir, target)
    out = json.loads((workdir / target).read_text())
    assert set(out["arms"]) == {"control", "no_engram"}
    assert out["arms"]["no_engram"]["verdict"] in ("WIN", "LOSE", "TIE")
    assert len(out["arms"]["control"]["seeds"]) == 2 and out["eval_window_bytes"] > 0
    assert (workdir / "results" / "ab" / "tiny_ab" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    again = snakemake(workdir, "-n", target)
    assert "Nothing to be done" in again.stdout + again.stderr
