"""A/B experiments as workflow targets: config/experiments/<name>.yaml -> arms x seeds of pretrain
(optionally the whole chain to bench) through the plan's own digests -> a verdict with its evidence.

    base: tiny                 # the preset every arm starts from
    seeds: [0, 1, 2]
    steps: 2000                # the budget: train.steps of every run
    bench: false               # true: also sft .. bench for every run
    control: {}                # overrides (nested, merged into the base preset)
    arms:
      no_engram: {model: {engram: false}}

A run is the base preset with the arm's overrides and train.seed / train.steps set, so every stage it
shares with another run (corpus, shards, anchors; a finished arm) has the same digest and is built
once. The verdict rule (`verdict`) is stated in docs/experiments-and-history.md and tested on synthetic numbers.
"""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from dormouse.core.config import ConfigError, load_preset, load_yaml, validate
from dormouse.model.config import ModelConfig
from dormouse.train.arms import before_finish, finish_start, inert_arms, inert_qat
from dormouse.train.settings import TrainSettings

EXPERIMENTS_DIR = Path("config/experiments")


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


@dataclass(frozen=True)
class Experiment:
    name: str
    path: str
    spec: dict

    @property
    def bench(self) -> bool:
        return self.spec["bench"]

    @property
    def arms(self) -> dict[str, dict]:
        """Arm name -> overrides; the control first."""
        return {"control": self.spec["control"], **self.spec["arms"]}

    def run_name(self, arm: str, seed: int) -> str:
        return f"ab/{self.name}/{arm}/s{seed}"

    def runs(self, root: Path = Path(".")) -> dict[str, tuple[str, int, dict]]:
        """run name -> (arm, seed, resolved preset)."""
        base = load_preset(self.spec["base"], root)
        out = {}
        for arm, over in self.arms.items():
            for seed in self.spec["seeds"]:
                merged = deep_merge(deep_merge(base, over), {"train": {"seed": seed, "steps": self.spec["steps"]}})
                preset = validate(merged, "preset.schema.yaml", f"{self.path} arm {arm}")
                out[self.run_name(arm, seed)] = (arm, seed, preset)
        check_qat_runs(self.path, self.spec.get("qat_acceptance"), {a: TrainSettings.of(p["train"]) for a, _, p in out.values()})
        if self.spec["branch"]:
            branch_controls(self.path, out)
        return out

    def trunk(self, arm: str, seed: int) -> str | None:
        """The run whose pretrain an arm's finish continues (its seed's control) when the experiment branches."""
        return self.run_name("control", seed) if self.spec["branch"] and arm != "control" else None


def rung_of(train: TrainSettings) -> str | None:
    """The rung a run's final eval BPB is measured through (train.qat's; None: the bf16 weights)."""
    return train.qat.rung if train.qat else None


def run_rung(manifest: dict) -> str | None:
    """rung_of a finished run's train params."""
    return rung_of(TrainSettings.of(manifest["params"]["train"]))


def rungs_measured(train: TrainSettings) -> dict[str, str]:
    """rung -> how a run measures it: "final" (its final eval runs through train.qat's rung) or "ptq"
    (train.ptq_rungs: the final weights through that rung, beside the final eval)."""
    return {**{r: "ptq" for r in train.ptq_rungs}, **({rung_of(train): "final"} if rung_of(train) else {})}


def qat_limit(acceptance: dict, rung: str) -> float:
    limit = acceptance["max_delta_bpb_vs_bf16"]
    return limit[rung] if isinstance(limit, dict) else limit


def check_qat_runs(rel: str, acceptance: dict | None, trains: dict[str, TrainSettings]) -> None:
    """An experiment's runs, resolved (arm -> train section), as the verdict will judge them: an arm measured through a
    rung needs a control that measures that rung after training (its PTQ, which the arm is set against). Under a QAT
    acceptance every arm finishes through a rung that has a limit, and the control trains as usual."""
    control = trains["control"]
    if acceptance and control.qat and control.qat.fraction:
        raise ConfigError(f"{rel}: the control trains through {rung_of(control)}; a QAT acceptance's control trains as usual")
    for arm, train in trains.items():
        if arm == "control":
            continue
        rung = rung_of(train)
        if rung is None and acceptance:
            raise ConfigError(f"{rel}: arm {arm} sets no train.qat; qat_acceptance judges arms that finish through a rung")
        if rung is None:
            continue
        if acceptance and isinstance(acceptance["max_delta_bpb_vs_bf16"], dict) and rung not in acceptance["max_delta_bpb_vs_bf16"]:
            raise ConfigError(f"{rel}: qat_acceptance.max_delta_bpb_vs_bf16 has no limit for arm {arm}'s rung {rung}")
        if rung not in rungs_measured(control):
            raise ConfigError(f"{rel}: the control never measures {rung} (arm {arm}'s rung): set the control's "
                              f"train.ptq_rungs to list it, or train.qat {{rung: {rung}, fraction: 0}}")


def branch_controls(rel: str, runs: dict[str, tuple[str, int, dict]]) -> None:
    """An experiment with `branch`: every arm is its control plus a finish (train.qat with fraction > 0, and
    train.ptq_rungs); the control keeps its checkpoints at the arms' finish starts, where they branch (in place)."""
    strip = lambda preset: before_finish(preset, also=("seed",))  # every seed's arms against seed 0's control
    control = next(p for a, _, p in runs.values() if a == "control")
    if (control["train"]["qat"] or {}).get("fraction"):
        raise ConfigError(f"{rel}: branch: the control trains through {control['train']['qat']['rung']}; the trunk of a "
                          "finish trains as usual")
    starts = set()
    for arm, _, preset in runs.values():
        if arm == "control":
            continue
        qat = preset["train"]["qat"]
        if not qat or not qat["fraction"]:
            raise ConfigError(f"{rel}: branch: arm {arm} has no finish (train.qat with fraction > 0) to branch")
        if strip(preset) != strip(control):
            differ = sorted(f"{sec}.{k}" if isinstance(v, dict) else sec for sec, v in strip(preset).items()
                            for k in (v if isinstance(v, dict) else {}) if strip(control)[sec].get(k) != v.get(k))
            raise ConfigError(f"{rel}: branch: arm {arm} differs from the control in {differ or 'more'} besides its finish; "
                              "a branch shares the control's steps before it")
        starts.add(finish_start(preset["train"]["steps"], qat["fraction"]))
    for arm, _, preset in runs.values():
        if arm == "control":
            preset["train"]["keep_checkpoints"] = sorted(set(preset["train"]["keep_checkpoints"]) | starts)


def load_experiments(root: Path = Path(".")) -> list[Experiment]:
    out = []
    for path in sorted((root / EXPERIMENTS_DIR).glob("*.yaml")):
        rel = str(path.relative_to(root))
        spec = validate(load_yaml(path) or {}, "experiment.schema.yaml", rel)
        if "control" in spec["arms"]:
            raise ConfigError(f"{rel}: 'control' is the control arm's name; rename that arm")
        check_finish_fraction(rel, spec)
        out.append(Experiment(path.stem, rel, spec))
    return out


def check_finish_fraction(rel: str, spec: dict) -> None:
    """A QAT acceptance judges a finish of at most `max_finish_fraction` of the steps (issue #28: 20%)."""
    acc = spec.get("qat_acceptance")
    if not acc:
        return
    for arm, over in {"control": spec["control"], **spec["arms"]}.items():
        fraction = ((over.get("train") or {}).get("qat") or {}).get("fraction", 0)
        if fraction > acc["max_finish_fraction"]:
            raise ConfigError(f"{rel}: arm {arm} finishes {fraction} of the steps through its rung, more than "
                              f"qat_acceptance.max_finish_fraction {acc['max_finish_fraction']}")


# ---------------------------------------------------------------------------------------------
# The verdict rule


def spread(values: list[float]) -> float:
    """max - min over seeds (0 for one seed): with 2-3 seeds a range is the honest width."""
    return max(values) - min(values) if values else 0.0


def judge(control: list[float], arm: list[float]) -> tuple[str, float]:
    """WIN if the arm's mean BPB is lower by more than both the control's and the arm's own seed
    spread, LOSE if higher by more than both, otherwise TIE. Returns (verdict, delta)."""
    delta = statistics.fmean(arm) - statistics.fmean(control)
    margin = max(spread(control), spread(arm))
    if abs(delta) > margin:
        return ("WIN" if delta < 0 else "LOSE"), delta
    return "TIE", delta


def verdict(spec: dict, runs: dict[str, dict[str, dict]]) -> dict:
    """runs: arm -> seed (str) -> {"digest", "manifest", "curve"}; the control under "control"."""
    # one window: the same byte count of the same eval tail (an arm that changes the data changes the shards)
    windows = {(r["manifest"]["inputs"]["shard"], r["manifest"]["final"]["eval_bytes"])
               for seeds in runs.values() for r in seeds.values()}
    if len(windows) != 1:
        raise ValueError(f"runs were scored on different eval windows (shard digest, bytes): {sorted(windows)}")
    arms, invalid = {}, {}
    for arm, seeds in runs.items():
        problems = []
        for seed, r in seeds.items():
            m = r["manifest"]
            for where in ("train.", "eval."):
                problems += [f"seed {seed} {where[:-1]}: {p}" for p in inert_arms(ModelConfig.from_dict(m["params"]["model"]), m["counters"], where)]
            problems += [f"seed {seed}: {p}" for p in inert_qat(TrainSettings.of(m["params"]["train"]), m["counters"])]
            problems += [f"seed {seed}: {p}" for p in other_build(m, runs["control"].get(seed))]
        bpb = [seeds[s]["manifest"]["final"]["eval_bpb"] for s in sorted(seeds, key=int)]
        arms[arm] = {"mean_bpb": round(statistics.fmean(bpb), 5), "spread_bpb": round(spread(bpb), 5),
                     "seeds": {s: {"eval_bpb": seeds[s]["manifest"]["final"]["eval_bpb"], "digest": seeds[s]["digest"]}
                               for s in sorted(seeds, key=int)},
                     "overrides": spec["control"] if arm == "control" else spec["arms"][arm]}
        if problems:
            invalid[arm] = problems
    for arm, a in arms.items():
        if arm == "control":
            continue
        if invalid.get(arm) or invalid.get("control"):
            a["verdict"], a["invalid_because"] = "INVALID", invalid.get(arm, []) + [f"control: {p}" for p in invalid.get("control", [])]
            a["delta_bpb"] = None
            continue
        rung, against = control_for(runs[arm], runs["control"])
        a["rung"] = rung or "bf16"
        a["control_mean_bpb"] = round(statistics.fmean(against), 5)  # the control through the arm's rung
        a["verdict"], delta = judge(against, [v["eval_bpb"] for v in a["seeds"].values()])
        a["delta_bpb"] = round(delta, 5)
    ptq = {r for s in runs["control"].values() for r in s["manifest"]["final"].get("eval_bpb_ptq", {})}
    if ptq:
        arms["control"]["mean_bpb_ptq"] = {r: round(statistics.fmean(bpb_through(s["manifest"], r) for s in runs["control"].values()), 5)
                                           for r in sorted(ptq)}
    quantized_vs_bf16(runs, arms, spec.get("qat_acceptance"))
    return {
        "rule": "per arm: mean and spread (max - min) of final eval BPB over seeds on one eval window; "
                "delta = arm mean - control mean, the control measured through the arm's rung (its final eval, or "
                "train.ptq_rungs) when the arm has one; WIN if delta < 0 and |delta| > control spread and arm spread, "
                "LOSE if delta > 0 likewise, else TIE; INVALID if any run shows an enabled arm inert",
        **({"qat_acceptance": {**spec["qat_acceptance"], "rule": "per arm: delta = its mean rung BPB - the control's "
                               "mean bf16 (master) BPB; PASS if limit - delta > max(control bf16 spread, arm spread), "
                               "FAIL if delta - limit exceeds it, else WITHIN_SPREAD"}} if spec.get("qat_acceptance") else {}),
        "eval_window_bytes": next(iter(windows))[1],
        "eval_window_shard": next(iter(windows))[0],
        "budget": {"steps": spec["steps"], "base": spec["base"]},
        "seeds": spec["seeds"],
        "arms": arms,
        "invalid": invalid,
    }


def bpb_through(manifest: dict, rung: str | None) -> float | None:
    """A run's final BPB through `rung` (None: its bf16 master weights); None when the run did not measure it."""
    final = manifest["final"]
    if rung == run_rung(manifest):
        return final["eval_bpb"]
    if rung is None:
        return final.get("eval_bpb_master")  # a run with train.qat reports its masters' BPB beside the rung's
    return (final.get("eval_bpb_ptq") or {}).get(rung)


def control_for(arm_seeds: dict[str, dict], control_seeds: dict[str, dict]) -> tuple[str | None, list[float]]:
    """(the arm's rung, the control's BPB per seed through it): an arm is judged against the control measured the
    same way, so a QAT arm against the control's post-training quantization of its rung."""
    rungs = {run_rung(r["manifest"]) for r in arm_seeds.values()}
    if len(rungs) != 1:
        raise ValueError(f"an arm's seeds are measured through different rungs: {sorted(map(str, rungs))}")
    rung = rungs.pop()
    against = [bpb_through(control_seeds[s]["manifest"], rung) for s in sorted(control_seeds, key=int)]
    if None in against:
        raise ValueError(f"the control never measured {rung} (its final eval or train.ptq_rungs), the rung of an arm "
                         "judged against it")
    return rung, against


def other_build(manifest: dict, control: dict | None) -> list[str]:
    """A branched run (final.branched_from) must continue the very build of its control the verdict reads: a GPU
    rebuild of the control has the same digest and other weights."""
    b = manifest["final"].get("branched_from")
    if not b or control is None or control["digest"] != b["digest"]:
        return []
    kept = control["manifest"].get("files", {}).get(f"checkpoints/step-{b['step']:08d}/model.safetensors", {}).get("sha256")
    return [] if kept == b["weights_sha256"] else [f"branched from another build of its control {b['digest']} "
                                                   f"(its step-{b['step']} weights {b['weights_sha256'][:12]}, the control's {str(kept)[:12]})"]


def quantized_vs_bf16(runs: dict[str, dict[str, dict]], arms: dict, acceptance: dict | None = None) -> None:
    """QAT experiments (a run evaluated through a rung, final.eval_bpb_master beside): each arm's rung BPB
    against the control's bf16 (master) BPB of the same budget, the figure a quantized rung is judged by, and
    the finish's cost to the bf16 weights themselves (arm master - control master). With `acceptance`
    (the experiment's qat_acceptance) each arm is judged against its limit by the spread rule: PASS when
    delta_bpb_vs_control_bf16 is below max_delta_bpb_vs_bf16 by more than the larger of the control's bf16 spread and
    the arm's rung spread, FAIL when above it by more, else WITHIN_SPREAD."""
    if not any(run_rung(r["manifest"]) for seeds in runs.values() for r in seeds.values()):
        if acceptance:
            raise ValueError("qat_acceptance: no run trained or evaluated through a rung (train.qat)")
        return
    masters = {arm: [bpb_through(r["manifest"], None) for r in seeds.values()] for arm, seeds in runs.items()}
    if any(None in m for m in masters.values()):
        if acceptance:
            raise ValueError("qat_acceptance: a run through a rung reports no final.eval_bpb_master (its bf16 BPB)")
        return
    master = {arm: statistics.fmean(v) for arm, v in masters.items()}
    for arm, a in arms.items():
        a["mean_bpb_master"] = round(master[arm], 5)
        for s, r in runs[arm].items():
            a["seeds"][s]["eval_bpb_master"] = bpb_through(r["manifest"], None)
        delta = a["mean_bpb"] - master["control"]
        a["delta_bpb_vs_control_bf16"] = round(delta, 5)
        a["bf16_cost_of_finish"] = round(master[arm] - master["control"], 5)
        if acceptance and arm != "control" and a.get("verdict") == "INVALID":
            a["qat_acceptance"] = {"verdict": "INVALID"}
        elif acceptance and arm != "control":
            limit = qat_limit(acceptance, a["rung"])
            margin = max(spread(masters["control"]), a["spread_bpb"])
            a["qat_acceptance"] = {
                "limit": limit, "delta_bpb_vs_control_bf16": round(delta, 5), "margin": round(margin, 5),
                "control_bf16_spread": round(spread(masters["control"]), 5),
                "verdict": "PASS" if limit - delta > margin else "FAIL" if delta - limit > margin else "WITHIN_SPREAD"}


def plot_curves(runs: dict[str, dict[str, dict]], path: Path, title: str) -> None:
    from dormouse.core.figures import new_figure, save

    fig, (ax,) = new_figure(8, 4.5)
    colors = {}
    for arm, seeds in runs.items():
        for seed, r in sorted(seeds.items()):
            color = colors.setdefault(arm, f"C{len(colors)}")
            # the line is the bf16 weights' BPB; a point through a rung (eval_rung) is an x, and a control's
            # train.ptq_rungs are + at its last step: a PTQ point is no step of the bf16 curve
            plain = [(m["step"], m["eval_bpb"]) for m in r["curve"] if "eval_bpb" in m and "eval_rung" not in m]
            rung = [(m["step"], m["eval_bpb"]) for m in r["curve"] if "eval_bpb" in m and "eval_rung" in m]
            if plain:
                ax.plot(*zip(*plain), marker="o", color=color, alpha=0.8, label=f"{arm} seed {seed}")
            if rung:
                ax.plot(*zip(*rung), marker="x", linestyle=":", color=color, alpha=0.8,
                        label=f"{arm} seed {seed} through {r['manifest']['params']['train']['qat']['rung']}")
            last = r["curve"][-1]["step"] if r["curve"] else 0
            for name, bpb in (r["manifest"]["final"].get("eval_bpb_ptq") or {}).items():
                ax.plot([last], [bpb], marker="+", markersize=10, color=color)
                ax.annotate(f"{name} (PTQ)", (last, bpb), fontsize="x-small", color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("eval BPB")
    ax.set_title(title)
    ax.legend(fontsize="small")
    save(fig, path)


def main(argv=None) -> int:
    import argparse

    from dormouse.core.store import open_artifact

    ap = argparse.ArgumentParser(prog="dormouse verdict", description="judge an experiment's arms (rule in docs/experiments-and-history.md)")
    ap.add_argument("--experiment", required=True, help="JSON: {name, spec, runs: {arm: {seed: pretrain digest}}}")
    ap.add_argument("--store", default="results/store")
    ap.add_argument("--out", required=True, help="verdict.json")
    ap.add_argument("--plot", required=True, help="curves.png")
    args = ap.parse_args(argv)
    exp = json.loads(args.experiment)
    runs = {}
    for arm, seeds in exp["runs"].items():
        runs[arm] = {}
        for seed, digest in seeds.items():
            art = open_artifact(Path(args.store) / "pretrain" / digest, stage="pretrain")
            curve = [json.loads(line) for line in art.file("metrics.jsonl").read_text().splitlines() if line.strip()]
            runs[arm][seed] = {"digest": digest, "manifest": art.manifest, "curve": curve}
    result = {"experiment": exp["name"], **verdict(exp["spec"], runs)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot_curves(runs, Path(args.plot), f"{exp['name']}: eval BPB per seed ({result['eval_window_bytes']:,} bytes)")
    for arm, a in result["arms"].items():
        acc = a.get("qat_acceptance")
        against = (f"; rung vs the control's bf16 {acc['delta_bpb_vs_control_bf16']:+.4f} against the limit "
                   f"{acc['limit']} (spread {acc['margin']}): {acc['verdict']}") if acc and acc["verdict"] != "INVALID" \
            else "; qat_acceptance INVALID" if acc else ""
        print(f"[verdict] {arm}: mean {a['mean_bpb']} spread {a['spread_bpb']} {a.get('verdict', '(control)')}{against}")
    return 0
