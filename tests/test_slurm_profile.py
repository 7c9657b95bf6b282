"""workflow/profiles/slurm without a cluster: tests/fake_slurm/ stands in for sbatch and friends.

The fake sbatch runs each job at once on this machine, through the plugin's own job command
(`python -m snakemake --executor slurm-jobstep`, which runs `srun ... python -m snakemake` for the
rule), logs every SLURM command it sees as a JSON line, and sacct then reports the job COMPLETED
or FAILED in the format the plugin parses. See tests/fake_slurm/fakeslurm.py.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pipeline_util import configure, needs_slurm_plugin, plan_in

pytestmark = needs_slurm_plugin


BIN = Path(sys.executable).parent
FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
PROFILE = "workflow/profiles/slurm"
STAGES = {"filter", "shard", "anchors", "anchors_view"}
PARTITION, GPU_PARTITION, ACCOUNT = "cpu_part", "gpu_part", "dormouse_acct"
SLURM_CONFIG = f"slurm={{partition: {PARTITION}, account: {ACCOUNT}, gpu_partition: {GPU_PARTITION}}}"


def run_slurm(workdir: Path, tmp_path: Path, *args, ok: bool = True, path_first: Path | None = None, env_extra=None):
    """snakemake --workflow-profile workflow/profiles/slurm with the fake SLURM first on PATH
    (after `path_first`, when given); `ok`: snakemake must succeed.

    Returns (snakemake's output, the fake's call log as a list of dicts)."""
    log = tmp_path / "fake_slurm.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}  # a login node
    env.update({
        "PATH": f"{str(path_first) + ':' if path_first else ''}{FAKE_SLURM}:{BIN}:{os.environ['PATH']}",
        "FAKE_SLURM_LOG": str(log),
        "FAKE_SLURM_STATE": str(tmp_path / "fake_slurm_state"),
        "FAKE_SLURM_ACCOUNTS": f"{ACCOUNT},other_acct",  # what sacctmgr lists: the plugin validates -A
        "FAKE_SLURM_PARTITIONS": f"{PARTITION}*,{GPU_PARTITION}",
        **(env_extra or {}),
    })
    # The fake sbatch returns when the job has finished: query sacct after 1 s, not the profile's 20.
    fast = ["--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1"]
    proc = subprocess.run([str(BIN / "snakemake"), "--workflow-profile", PROFILE, *fast, *args], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, f"snakemake {' '.join(args)} {'failed' if ok else 'succeeded'}:\n{out[-6000:]}"
    return out, [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def sbatch_calls(calls) -> dict:
    """{rule: logged sbatch call}; the plugin's --comment is rule_<rule>[_wildcards_<values>]."""
    jobs = {}
    for call in calls:
        if call["cmd"] == "sbatch":
            rule = re.fullmatch(r"rule_(.+?)(_wildcards_.*)?", call["opts"]["comment"]).group(1)
            assert rule not in jobs, f"{rule} submitted twice"
            jobs[rule] = call
    return jobs


def job_resources(out: str) -> dict:
    """{rule: {threads, mem_mb, runtime}} as Snakemake resolved them (its job listing)."""
    resources, rule = {}, None
    for line in out.splitlines():
        if m := re.match(r"(?:local)?rule (\w+):$", line.strip()):
            rule = m.group(1)
            resources[rule] = {"threads": 1}  # Snakemake lists threads only when > 1
        elif rule and (m := re.match(r"threads: (\d+)$", line.strip())):
            resources[rule]["threads"] = int(m.group(1))
        elif rule and line.strip().startswith("resources: "):
            for item in line.strip().removeprefix("resources: ").split(", "):
                key, _, value = item.partition("=")
                if key in ("mem_mb", "runtime"):
                    resources[rule][key] = int(value)
    return resources


def assert_sbatch_flags(call: dict, partition: str, account: str, runtime: int, mem_mb: int, cpus: int):
    opts = call["opts"]  # the fake's parse of sbatch's argv: long option name -> value
    assert opts.get("partition") == partition, opts
    assert opts.get("account") == account, opts
    assert opts.get("time") == str(runtime), opts  # minutes, from resources: runtime
    assert opts.get("mem") == str(mem_mb), opts  # MB, from resources: mem_mb
    assert opts.get("cpus-per-task") == str(cpus), opts  # from threads
    assert opts.get("parsable") is True and opts.get("export") == "ALL", opts


def assert_ran_under_srun(calls, sbatch_call: dict, cpus: int) -> dict:
    """Inside the job the plugin's jobstep executor runs the rule through srun."""
    steps = [c for c in calls if c["cmd"] == "srun" and c["job_id"] == sbatch_call["job_id"]]
    assert len(steps) == 1, steps
    assert steps[0]["opts"].get("cpus-per-task") == str(cpus), steps[0]
    assert steps[0]["command"][1:3] == ["-m", "snakemake"], steps[0]
    return steps[0]


@pytest.fixture()
def slurm_workflow(workdir, small_corpus, quality_examples):
    configure(workdir, small_corpus, *quality_examples, presets=("tiny",))
    return workdir


@pytest.mark.slow  # ~40 s: four jobs, each two nested Snakemake start-ups (jobstep + rule)
def test_slurm_profile_submits_every_stage_with_its_resources(slurm_workflow, tmp_path):
    out, calls = run_slurm(slurm_workflow, tmp_path, "results/tiny/anchors.json", "--config", SLURM_CONFIG)

    view = json.loads((slurm_workflow / "results" / "tiny" / "anchors.json").read_text())
    assert [link["stage"] for link in view["digest_chain"]] == ["anchors", "shard", "filter"]
    assert view["ladder"] and view["ladder"][0]["name"] == "uniform"

    submitted = sbatch_calls(calls)
    assert set(submitted) == STAGES, sorted(submitted)  # every stage went through sbatch, nothing ran locally
    declared = job_resources(out)
    for rule, call in submitted.items():
        res = declared[rule]  # the rule's threads / resources in workflow/rules/data.smk
        assert_sbatch_flags(call, PARTITION, ACCOUNT, res["runtime"], res["mem_mb"], res["threads"])
        assert call["opts"].get("ntasks") == "1" and "gpus" not in call["opts"] and "gres" not in call["opts"]
        assert call["opts"]["output"].startswith(str(slurm_workflow / "results/logs/slurm" / f"rule_{rule}") + "/")
        # the job step's Snakemake caps a rule's threads at the cores it sees: the fake job runs on this machine
        assert_ran_under_srun(calls, call, min(res["threads"], os.cpu_count()))
    # status came from sacct, filtered by the run's job name
    run_names = {c["opts"]["job-name"] for c in submitted.values()}
    assert len(run_names) == 1
    status = [c for c in calls if c["cmd"] == "sacct" and "--name" in c["argv"]]
    assert status and all(c["argv"][c["argv"].index("--name") + 1] in run_names for c in status)
    assert not [c for c in calls if c["cmd"] == "scancel"]


GPU_SNAKEFILE = """
configfile: "config/config.yaml"


include: "workflow/rules/common.smk"


rule gpu_probe:
    output:
        "results/gpu_probe.txt",
    threads: 4
    resources:
        mem_mb=3000,
        runtime=15,
        gpu=1,
        **slurm(gpu=True),
    shell:
        "echo $SLURM_JOB_ID > {output}"
"""


@pytest.mark.slow  # ~12 s
def test_slurm_profile_gpu_rule_gets_gpus_and_gpu_partition(slurm_workflow, tmp_path):
    """Stand-in for the GPU rules to come: resources gpu=1 plus **slurm(gpu=True)."""
    (slurm_workflow / "gpu_probe.smk").write_text(GPU_SNAKEFILE)
    # also the plugin's other submission path: the job script on sbatch's stdin, srun ... sh -s
    out, calls = run_slurm(slurm_workflow, tmp_path, "-s", "gpu_probe.smk", "--config", SLURM_CONFIG,
                           "--slurm-pass-command-as-script")
    (call,) = sbatch_calls(calls).values()
    assert_sbatch_flags(call, GPU_PARTITION, ACCOUNT, runtime=15, mem_mb=3000, cpus=4)
    assert call["opts"].get("gpus") == "1", call["opts"]  # plugin 2.8 maps resources gpu=N to --gpus=N
    assert "--gpus=1" in call["argv"]
    assert "ntasks" not in call["opts"]  # GPU jobs get no --ntasks unless tasks/tasks_per_gpu is set
    assert call["argv"][-1] == "/dev/stdin" and call["stdin"].startswith("#!/bin/sh\n")
    step = [c for c in calls if c["cmd"] == "srun" and c["job_id"] == call["job_id"]]
    assert len(step) == 1 and step[0]["opts"].get("gpus") == "1" and step[0]["command"] == ["sh", "-s"], step
    assert (slurm_workflow / "results" / "gpu_probe.txt").read_text().strip() == call["job_id"]


PRETRAIN_SNAKEFILE = """
configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/train.smk"
"""

FAKE_TORCHRUN = """#!{python}
# Stands in for torchrun on a machine without GPUs: records how it was called, then fails the job.
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "SLURM_JOB_ID": os.environ.get("SLURM_JOB_ID")}}) + "\\n")
sys.exit(3)
"""


@pytest.mark.slow  # ~25 s
def test_slurm_profile_multi_gpu_pretrain_is_one_node_with_n_gpus_under_torchrun(slurm_workflow, tmp_path):
    """The real pretrain rule for a preset with resources.gpus 2: one sbatch on one node with 2 GPUs,
    and the job's command launches torchrun with 2 processes on the 2 devices. No GPU here: a fake
    torchrun records its call and fails the job (so snakemake fails, as expected)."""
    preset_path = slurm_workflow / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(preset_path.read_text())
    preset["train"].update(device="cuda", batch_size=8)
    preset["resources"] = {"gpus": 2}
    preset_path.write_text(yaml.safe_dump(preset, sort_keys=False))
    plan = plan_in(slurm_workflow, yaml.safe_load((slurm_workflow / "config" / "config.yaml").read_text()))
    digest = plan.chain["tiny"]["pretrain"]
    shard_manifest = slurm_workflow / plan.manifest_path("shard", plan.chain["tiny"]["shard"])
    shard_manifest.parent.mkdir(parents=True)
    shard_manifest.write_text("{}")  # the input must exist; the fake torchrun never reads it
    (slurm_workflow / "pretrain_only.smk").write_text(PRETRAIN_SNAKEFILE)
    bin_dir, torchrun_log = tmp_path / "bin", tmp_path / "torchrun.jsonl"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN.format(python=sys.executable, log=str(torchrun_log)))
    (bin_dir / "torchrun").chmod(0o755)

    out, calls = run_slurm(slurm_workflow, tmp_path, "-s", "pretrain_only.smk", plan.manifest_path("pretrain", digest),
                           "--config", SLURM_CONFIG, ok=False, path_first=bin_dir,
                           env_extra={"DORMOUSE_GPUS": "0,1", "DORMOUSE_GPU_LOCK_DIR": str(tmp_path / "locks")})
    (call,) = sbatch_calls(calls).values()
    assert_sbatch_flags(call, GPU_PARTITION, ACCOUNT, runtime=24 * 60, mem_mb=2 * 16000, cpus=2 * 2)
    assert call["opts"].get("gpus") == "2" and call["opts"].get("nodes") == "1", call["opts"]
    (step,) = [c for c in calls if c["cmd"] == "srun" and c["job_id"] == call["job_id"]]
    assert step["opts"].get("gpus") == "2" and step["opts"].get("nodes") == "1", step
    (launch,) = [json.loads(line) for line in torchrun_log.read_text().splitlines()]
    job_file = f"results/jobs/pretrain/{digest}.json"  # the rule passes the job as @file (a short command line)
    assert launch["argv"] == ["--standalone", "--nproc-per-node", "2", "-m", "dormouse.cli", "pretrain",
                              "--job", f"@{job_file}", "--presets", "tiny", "--terminal-progress"]
    assert (slurm_workflow / job_file).read_text() == plan.job_json("pretrain", digest)
    assert launch["CUDA_VISIBLE_DEVICES"] == "0,1" and launch["SLURM_JOB_ID"] == call["job_id"]  # gpu-run took both
