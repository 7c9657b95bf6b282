"""The plan: for every preset, each stage's params slice, inputs and digest — computed at parse time.

Cheap by construction: it reads config files and stats raw files, and never hashes large files.
Snakemake (workflow/rules/common.smk) and `dormouse plan` both build it with `build_plan`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dormouse.core.config import ConfigError, find_project, flatten, load_preset, load_retractions, load_yaml, validate
from dormouse.planner.experiments import load_experiments
from dormouse.data.raw import DEMO_BUILT, expand_raw, is_demo, raw_input
from dormouse.planner.registry import STAGES, ptq_twin, stage_params
from dormouse.core.store import artifact_digest, canonical_json


@dataclass
class Job:
    stage: str
    digest: str
    params: dict
    inputs: dict[str, dict]  # name -> {"digest": ..., "path": artifact dir or raw spec(s), "kind": "artifact"|"raw"}
    retractions: list[str]
    presets: list[str] = field(default_factory=list)
    gpus: int = 1  # pretrain on cuda: the largest resources.gpus of its presets (not a param: not digested)
    mem_gb: float = 0.0  # the largest resources.mem_gb.<stage> of its presets (not digested either)
    runtime_min: int = 0  # the largest resources.runtime_min.<stage>

    @property
    def format_version(self) -> int:
        return STAGES[self.stage].format_version

    def spec(self, store: str) -> dict:
        """Everything the stage needs to run, as handed to `dormouse <stage> --job`."""
        return {
            "stage": self.stage,
            "format_version": self.format_version,
            "digest": self.digest,
            "params": self.params,
            "inputs": self.inputs,
            "retractions": self.retractions,
            "out": f"{store}/{self.stage}/{self.digest}",
        }


def matching_retractions(entries: list[dict], stage: str, params: dict) -> list[str]:
    flat = flatten(params)
    hits = []
    for e in entries:
        if e["stage"] != stage:
            continue
        ok = True
        for key, want in e["match"].items():
            if key not in flat:
                ok = False
                break
            allowed = want if isinstance(want, list) else [want]
            if flat[key] not in allowed:
                ok = False
                break
        if ok:
            hits.append(e["id"])
    return sorted(hits)


# What `snakemake results/<view>/<file>` can build (workflow/rules/*.smk)
PRESET_TARGETS = ("anchors.json", "pretrain.json", "bench.json", "plots/curves.png", "plots/rungs.png", "plots/tasks.png")


@dataclass
class Plan:
    config: dict
    presets: dict[str, dict]  # name -> resolved preset
    jobs: dict[tuple[str, str], Job]  # (stage, digest) -> job
    chain: dict[str, dict[str, str]]  # preset (or experiment run, "ab/<exp>/<arm>/s<seed>"; "<either>/ptq": a QAT
    # chain's twin with every qat key off, up to export, whose rungs its bench scores too) -> stage -> digest
    retractions: list[dict]
    experiments: dict = field(default_factory=dict)  # name -> dormouse.planner.experiments.Experiment
    overrides: dict = field(default_factory=dict)  # run_overrides: this run's --config keys that change results
    own_chain: dict = field(default_factory=dict)  # with overrides: the chains the config file alone plans

    @property
    def store(self) -> str:
        return self.config["store"]

    def view_name(self, preset: str) -> str:
        """The folder of a preset's views in results/: the preset's name, or `<preset>@<tag>` when this run's
        overrides change the preset's chain, so a one-off run (another corpus, --config set=...) never replaces
        the preset's own views. Overrides that change no digest (set=resources.*, the file's own corpus) keep it."""
        if not self.overrides or self.own_chain.get(preset) == self.chain[preset]:
            return preset
        return f"{preset}@{override_tag(self.overrides)}"

    def view_overrides(self, preset: str) -> dict:
        """What the preset's views record: the overrides that put them in their own folder, else none."""
        return self.overrides if self.view_name(preset) != preset else {}

    @property
    def views(self) -> dict[str, str]:
        """view name -> preset, for this run's presets (the default names: rule all's targets)."""
        return {self.view_name(p): p for p in self.presets}

    def view_preset(self, name: str) -> str | None:
        """The preset whose views this run writes to results/<name>/: its default view name, or, for a preset
        whose chain the overrides change, `<preset>@<label>` with a label of the user's choosing."""
        preset, at, label = name.partition("@")
        if preset not in self.presets or at != ("@" if self.view_name(preset) != preset else ""):
            return None
        return preset if not at or re.fullmatch(VIEW_LABEL, label) else None

    def view_pattern(self) -> str:
        """A regex of the view names view_preset accepts (the Snakemake wildcard's constraint)."""
        return "|".join(re.escape(p) + (f"@{VIEW_LABEL}" if self.view_name(p) != p else "") for p in self.presets)

    def overrides_args(self, overrides: dict | None = None) -> str:
        """This run's overrides (or those given) as Snakemake's --config arguments, for a command in a message."""
        overrides = self.overrides if overrides is None else overrides
        if not overrides:
            return ""
        return " --config " + " ".join(shlex.quote(f"{k}={v}") for k, v in overrides.items())

    def job(self, stage: str, digest: str) -> Job:
        try:
            return self.jobs[(stage, digest)]
        except KeyError:
            raise KeyError(f"no {stage} job with digest {digest} in the plan") from None

    def artifact_dir(self, stage: str, digest: str) -> str:
        return f"{self.store}/{stage}/{digest}"

    def manifest_path(self, stage: str, digest: str) -> str:
        return f"{self.artifact_dir(stage, digest)}/manifest.json"

    def digests(self, stage: str) -> list[str]:
        return sorted(d for s, d in self.jobs if s == stage)

    def gpus(self, stage: str, digest: str) -> int:
        """GPUs a job holds (the gpu resource and gpu-run's slots): 0 for a job on cpu; on cuda 1, but
        pretrain takes its presets' resources.gpus and runs data-parallel under torchrun when > 1."""
        job = self.job(stage, digest)
        device = job.params["train"]["device"] if stage == "pretrain" else job.params.get("device")
        if device != "cuda":
            return 0
        return job.gpus if stage == "pretrain" else 1

    def mem_mb(self, stage: str, digest: str) -> int:
        """The job's memory request: its presets' resources.mem_gb (pretrain: per GPU process)."""
        job = self.job(stage, digest)
        per = int(job.mem_gb * 1000)
        return per * max(1, self.gpus(stage, digest)) if stage == "pretrain" else per

    def runtime_min(self, stage: str, digest: str) -> int:
        return self.job(stage, digest).runtime_min

    def experiment_runs(self, name: str) -> dict[str, dict[str, str]]:
        """arm -> seed -> pretrain digest of an experiment."""
        exp = self.experiments[name]
        return {arm: {str(seed): self.chain[exp.run_name(arm, seed)]["pretrain"] for seed in exp.spec["seeds"]}
                for arm in exp.arms}

    def experiment_inputs(self, name: str) -> list[str]:
        exp = self.experiments[name]
        last = "bench" if exp.bench else "pretrain"
        return [self.manifest_path(last, self.chain[exp.run_name(arm, seed)][last])
                for arm in exp.arms for seed in exp.spec["seeds"]]

    def experiment_json(self, name: str) -> str:
        exp = self.experiments[name]
        return canonical_json({"name": name, "spec": exp.spec, "runs": self.experiment_runs(name)})

    def cli_target_problem(self) -> str | None:
        """target_problem of the first bad target on snakemake's command line: Snakemake reads the Snakefile
        before it hands over its targets, so they are read from sys.argv with Snakemake's own parser."""
        if Path(sys.argv[0]).name != "snakemake":
            return None
        try:
            from snakemake.cli import parse_args

            targets = parse_args(sys.argv[1:])[1].targets or []
        except (Exception, SystemExit):  # not ours to judge: Snakemake reports its own argument errors
            return None
        return next((p for p in map(self.target_problem, targets) if p), None)

    def target_problem(self, target: str, root: Path = Path(".")) -> str | None:
        """Why Snakemake would find no rule for a results/ target (a preset or experiment not in this run, or a
        file a preset does not have), in one line; None for anything else (Snakemake's own messages stand)."""
        parts = Path(target).parts
        if len(parts) < 3 or parts[0] != "results" or parts[1] in ("logs", "jobs", "benchmarks", "store"):
            return None
        if Path(target).resolve().is_relative_to(Path(self.store).resolve()):  # a store inside results/
            return None
        if parts[1] == "ab":
            if parts[2] in self.experiments:
                return None
            known = ", ".join(self.experiments) or "none"
            return (f"{target}: no experiment {parts[2]!r} (experiments: {known}); "
                    "an experiment is config/experiments/<name>.yaml")
        name, rest = parts[1], "/".join(parts[2:])
        preset, said = name.partition("@")[0], describe_overrides(self.overrides)
        if preset not in self.presets:
            there = (root / "config" / "presets" / f"{preset}.yaml").exists()
            hint = (f"config/presets/{preset}.yaml exists: add it to the run with --config 'presets=[{', '.join(self.presets)}, {preset}]'"
                    if there else "a preset is config/presets/<name>.yaml, listed in config.yaml's presets")
            return f"{target}: no preset {preset!r} in this run (presets: {', '.join(self.presets)}); {hint}"
        mine = self.view_name(preset)
        theirs = recorded_overrides(root / "results" / name)
        if self.view_preset(name) is None:  # the preset's own folder under overrides, or a run's under none
            if name == preset:
                other = "the preset's own views, which a run with overrides leaves as they are"
            elif mine != preset:
                other = f"no view (a label is letters, digits, '.', '_' and '-': {VIEW_LABEL})"
            elif theirs is not None:
                other = (f"the views of a run with {describe_overrides(theirs)} (rebuild: snakemake "
                         f"{target}{self.overrides_args(theirs)})")
            else:
                other = "the views of a run with overrides (none recorded there yet)"
            where = f"results/{mine}/ (or results/{preset}@<label>/)" if mine != preset else f"results/{mine}/"
            return (f"{target}: results/{name}/ holds {other}; this run ({said}) writes {where}: "
                    f"snakemake results/{mine}/{rest}{self.overrides_args()}")
        if theirs is not None and theirs != self.view_overrides(preset):  # a label reused for other overrides
            return (f"{target}: results/{name}/ holds the views of a run with {describe_overrides(theirs)}, not "
                    f"this run's ({said}): name another label, or snakemake results/{mine}/{rest}{self.overrides_args()}")
        if rest not in PRESET_TARGETS:
            return f"{target}: results/{name}/ holds {', '.join(PRESET_TARGETS)}"
        return None

    def presets_of(self, stage: str, digest: str) -> list[str]:
        """The presets whose chain holds this job."""
        return [p for p, stages in self.chain.items() if stages.get(stage) == digest]

    def job_json(self, stage: str, digest: str) -> str:
        return canonical_json(self.job(stage, digest).spec(self.store))

    def input_files(self, stage: str, digest: str) -> dict[str, str | list[str]]:
        """Snakemake inputs of a job: upstream manifests, the demo build marker, or raw files."""
        job = self.job(stage, digest)
        out: dict[str, str | list[str]] = {}
        for name, inp in job.inputs.items():
            if inp["kind"] == "artifact":
                out[name] = self.manifest_path(inp["stage"], inp["digest"])
            elif any(is_demo(s) for s in inp["specs"]):
                out[name] = str(DEMO_BUILT)
            else:  # raw user files exist at parse time (they were fingerprinted)
                out[name] = [str(f) for s in inp["specs"] for f in expand_raw(s)]
        return out


# A view label (results/<preset>@<label>/): a word a path and a Snakemake wildcard take as it is
VIEW_LABEL = r"[A-Za-z0-9][A-Za-z0-9_.-]*"

# --config keys that say which presets run, where artifacts live and how jobs are submitted: they change no
# result, so a run that sets them still writes the presets' own views.
VIEW_NEUTRAL = frozenset({"preset", "presets", "store", "slurm"})


def run_overrides(file_config: Mapping, given: Mapping) -> dict:
    """The overrides a run was given (Snakemake's --config, or a command's --set/--corpus) that can change what
    its chain computes: every key but VIEW_NEUTRAL whose value is not the config file's, sorted by key."""
    return {k: given[k] for k in sorted(given)
            if k not in VIEW_NEUTRAL and (given[k] or None) != (file_config.get(k) or None)}


def override_tag(overrides: dict) -> str:
    """8 hex of the overrides' digest: the same overrides name the same view folder in every run."""
    return hashlib.sha256(canonical_json(overrides).encode()).hexdigest()[:8]


def describe_overrides(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "no overrides"


def recorded_overrides(view_dir: Path) -> dict | None:
    """The overrides a view folder's files record (dormouse view writes them); None when none says."""
    for name in ("bench.json", "pretrain.json", "anchors.json"):
        try:
            return json.loads((view_dir / name).read_text())["overrides"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def add_plan_arguments(ap: argparse.ArgumentParser) -> None:
    """--config, --corpus and --set for a command that builds the plan (dormouse plan, dormouse serve): the
    overrides as `snakemake --config` takes them, so a command finds a one-off run's artifacts by its overrides."""
    ap.add_argument("--config", help="config.yaml (default: config/config.yaml of the clone around the cwd)")
    ap.add_argument("--corpus", help="override config corpus (as snakemake --config corpus=...)")
    ap.add_argument("--set", help="preset overrides, 'key=value,...' (as snakemake --config set=...)")


def build_run_plan(config: dict, file_config: Mapping, given: Mapping, root: Path = Path(".")) -> Plan:
    """The plan of a run whose config is the config file updated with `given` (Snakemake's --config, or a
    command's --set/--corpus): with overrides, also the chains the file alone plans, to tell which presets'
    views they change (Plan.view_name)."""
    overrides = run_overrides(file_config, given)
    plan = build_plan(config, root, overrides)
    if overrides:
        own = {k: v for k, v in config.items() if k not in overrides} | {k: file_config[k] for k in overrides
                                                                           if k in file_config}
        try:
            plan.own_chain = build_plan(own, root).chain
        except ConfigError:  # the file alone does not plan (its corpus is missing, say): every view is this run's
            plan.own_chain = {}
    return plan


def plan_from_args(args: argparse.Namespace) -> Plan:
    """load_plan with the arguments add_plan_arguments declared."""
    return load_plan(args.config, args.set, **({"corpus": args.corpus} if args.corpus else {}))


def resolve_presets(config: dict, root: Path = Path(".")) -> dict[str, dict]:
    return {name: load_preset(name, root, config.get("set", "")) for name in config["presets"]}


def load_plan(config_arg: str | None, set_: str | None = None, **paths: str) -> Plan:
    """The plan of the project around the cwd (config.find_project), for a CLI command run from any folder.
    `paths`: config keys set to paths the user gave relative to the cwd (corpus, store), rebased on the root
    as Snakemake would see them (a raw path is part of its fingerprint); the store is made absolute when the
    root is not the cwd. `set_`: config `set`, the preset overrides (as snakemake --config set=...)."""
    root, path = find_project(config_arg)
    rebased = {}
    for key, value in paths.items():
        absolute = Path(value).resolve()
        rebased[key] = str(absolute.relative_to(root.resolve()) if absolute.is_relative_to(root.resolve()) else absolute)
    file_config = load_yaml(path)
    given = {**rebased, **({"set": set_} if set_ else {})}
    plan = build_run_plan({**file_config, **given}, file_config, given, root)
    if root.resolve() != Path.cwd().resolve() and not Path(plan.config["store"]).is_absolute():
        plan.config["store"] = str(root / plan.config["store"])
    return plan


def build_plan(config: dict, root: Path = Path("."), overrides: dict | None = None) -> Plan:
    """`overrides`: run_overrides of this run; its presets' views then go to results/<preset>@<tag>/."""
    config = validate(json.loads(json.dumps(config)), "config.schema.yaml", "config")
    if config["preset"] not in config["presets"]:
        raise ConfigError(f"config: preset {config['preset']!r} is not in presets {config['presets']}")
    retractions = load_retractions(Path(config["retractions"]), root)
    presets = resolve_presets(config, root)
    jobs: dict[tuple[str, str], Job] = {}
    chain: dict[str, dict[str, str]] = {}
    raw_cache: dict[str, str] = {}

    def raw(name: str, specs: list[str]) -> dict:
        return raw_input(specs, root, raw_cache)

    def plan_chain(name: str, preset: dict, source: str, last: str = "bench", trunk: str | None = None) -> None:
        chain[name] = {}
        for stage, spec in STAGES.items():
            if stage in chain[name]:
                continue
            try:
                params = stage_params(stage, preset)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
            inputs = {up: {"kind": "artifact", "stage": up, "digest": chain[name][up]} for up in spec.upstream}
            if stage == "filter":
                inputs["corpus"] = raw("corpus", [config["corpus"]])
                quality = preset["data"]["filter"]["quality"]
                if quality["model"] == "train":
                    for side in ("positive", "negative"):
                        if not quality.get(side):
                            raise ConfigError(f"preset {name}: data.filter.quality.{side} is required when model is 'train'")
                        inputs[side] = raw(side, quality[side])
                else:
                    inputs["quality_model"] = raw("quality_model", [quality["model"]])
            if stage == "pretrain" and trunk is not None:  # a finish that continues another run's pretrain
                inputs["trunk"] = {"kind": "artifact", "stage": "pretrain", "digest": chain[trunk]["pretrain"]}
            if stage == "bench" and expand_raw(config["bench_tasks"], root):
                inputs["bench_tasks"] = raw("bench_tasks", [config["bench_tasks"]])
            twin = ptq_twin(preset) if stage == "bench" else None
            if twin is not None:  # a QAT chain's rungs beside the same preset's quantized after training
                plan_chain(f"{name}/ptq", twin, f"{source} with every qat off", "export")
                inputs["export_ptq"] = {"kind": "artifact", "stage": "export", "digest": chain[f"{name}/ptq"]["export"]}
            ids = matching_retractions(retractions, stage, params)
            digest = artifact_digest(stage, spec.format_version, params, {k: v["digest"] for k, v in inputs.items()}, ids)
            job = jobs.setdefault((stage, digest), Job(stage, digest, params, inputs, ids))
            job.presets.append(name)
            if stage == "pretrain":
                job.gpus = max(job.gpus, pretrain_gpus(preset, source))
            job.mem_gb = max(job.mem_gb, preset["resources"]["mem_gb"][stage])
            job.runtime_min = max(job.runtime_min, preset["resources"]["runtime_min"][stage])
            chain[name][stage] = digest
            if stage == last:
                break

    for name, preset in presets.items():
        plan_chain(name, preset, f"config/presets/{name}.yaml")
    experiments = {}
    for exp in load_experiments(root):
        experiments[exp.name] = exp
        for run_name, (arm, seed, preset) in exp.runs(root).items():
            plan_chain(run_name, preset, f"{exp.path} arm {arm} seed {seed}", "bench" if exp.bench else "pretrain",
                       exp.trunk(arm, seed))
    check_match_keys(retractions, jobs.values(), config["retractions"])
    return Plan(config, presets, jobs, chain, retractions, experiments, dict(overrides or {}))


def pretrain_gpus(preset: dict, source: str) -> int:
    """resources.gpus of a preset, checked against its train section."""
    gpus, train = preset["resources"]["gpus"], preset["train"]
    if gpus > 1 and train["device"] != "cuda":
        raise ConfigError(f"{source}: resources.gpus {gpus} needs train.device cuda (a cpu pretrain is one process)")
    if train["batch_size"] % gpus:
        raise ConfigError(f"{source}: train.batch_size {train['batch_size']} is not a multiple of resources.gpus {gpus} "
                          f"(each GPU trains on an equal slice of the global batch)")
    return gpus


def check_match_keys(entries: list[dict], jobs, source: str) -> None:
    """A match key that no job of its stage has is a typo that would silently retract nothing."""
    known: dict[str, set[str]] = {}
    for job in jobs:
        known.setdefault(job.stage, set()).update(flatten(job.params))
    for e in entries:
        unknown = sorted(k for k in e["match"] if k not in known.get(e["stage"], set()))
        if unknown:
            raise ConfigError(
                f"{source}: retraction {e['id']}: {unknown} not among the params of stage {e['stage']!r} "
                f"(known: {', '.join(sorted(known.get(e['stage'], ())))})"
            )
