"""workflow/profiles/slurm against a real SLURM: Debian's slurm-wlm 22.05 and munge, one node, no
accounting (tests/real_slurm.py starts it in a temp dir and stops every daemon by PID).

Needs the slurm-wlm and munge binaries, or root and apt-get to install them; skips with the reason
otherwise. Slow (~5 min on 2 cores: every job waits the profile's 20 s before its first status
query): `make test-all`, `make test-slurm` and `.ci/run` run it. Each snakemake has a hard timeout,
so a status hang fails the test instead of hanging CI.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import real_slurm
from dormouse.planner.plan import build_plan
from pipeline_util import configure, needs_slurm_plugin

pytestmark = [pytest.mark.slow, needs_slurm_plugin]

BIN = Path(sys.executable).parent
PROFILE = "workflow/profiles/slurm"
SLURM_CONFIG = "slurm={partition: debug, account: '', gpu_partition: ''}"
NODE_CPUS = 2  # the node declares this machine's 2 cores; --max-threads caps the filter's 8 threads to it
TIMEOUT_S = int(os.environ.get("DORMOUSE_SLURM_TEST_TIMEOUT_S", 480))  # per snakemake: a lost job fails here
# Files that carry wall-clock figures (and so differ between any two runs): compared without them.
TIMED = {"anchors.json": ("seconds",), "metrics.jsonl": ("tokens_per_s",)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = real_slurm.find_or_install()
    if reason:
        pytest.skip(f"no real SLURM: {reason}")
    if os.geteuid() != 0:
        pytest.skip("no real SLURM: slurmd runs jobs as their user only when started as root")
    node = real_slurm.Cluster(tmp_path_factory.mktemp("slurm"), cpus=NODE_CPUS, gpus=2)
    try:
        node.start()
        yield node
    finally:
        forced = node.stop()
        assert not [name for name, p in node.procs.items() if p.poll() is None]
        assert not node.stepds(), "slurmstepd left running"
        print(f"real SLURM stopped; killed hard: {forced or 'nothing'}")


def snakemake(cluster, workdir: Path, *args, profile: bool = True, ok: bool = True, path_first: Path | None = None):
    """Run snakemake in workdir (through the SLURM profile unless profile=False) with a hard timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(cluster.env())
    env["PATH"] = f"{str(path_first) + os.pathsep if path_first else ''}{env['PATH']}{os.pathsep}{BIN}"
    cmd = [str(BIN / "snakemake"), *(["--workflow-profile", PROFILE, "--max-threads", str(NODE_CPUS)] if profile else
                                     ["--cores", str(NODE_CPUS)]), *args]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        pytest.fail(f"snakemake {' '.join(args)} still running after {TIMEOUT_S} s (lost track of a job?):\n"
                    f"{out[-4000:]}\nsqueue:\n{cluster.run('squeue', '--states=all', check=False).stdout}")
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, f"snakemake {' '.join(args)} rc {proc.returncode}:\n{out[-6000:]}"
    return out, time.monotonic() - start


def submitted(out: str) -> dict:
    """{slurm job id: rule} from the plugin's "Job N has been submitted with SLURM jobid M (log: .../rule_<rule>/...)"."""
    return {m.group(1): m.group(2) for m in re.finditer(r"submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+?)/", out)}


def tiny_workdir(workdir, small_corpus, quality_examples) -> Path:
    configure(workdir, small_corpus, *quality_examples, presets=("tiny",))
    preset_path = workdir / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(preset_path.read_text())
    preset["train"].update(steps=40, eval_every=20, ckpt_every=20)  # the tiny pretrain, shortened
    preset_path.write_text(yaml.safe_dump(preset, sort_keys=False))
    return workdir


def without_timings(path: Path):
    keys = TIMED[path.name]
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.suffix == ".jsonl" else [json.loads(path.read_text())]
    return [{k: v for k, v in row.items() if k not in keys} for row in rows]


def assert_same_artifact(a: Path, b: Path):
    """Same files, same sha256, except the timed ones: equal once their timings are dropped."""
    files_a, files_b = (json.loads((d / "manifest.json").read_text())["files"] for d in (a, b))
    assert sorted(files_a) == sorted(files_b), a
    for name in files_a:
        if Path(name).name in TIMED:
            assert without_timings(a / name) == without_timings(b / name), a / name
        else:
            assert files_a[name] == files_b[name], a / name  # sha256 and size


def plan_of(workdir: Path):
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        return build_plan(yaml.safe_load((workdir / "config" / "config.yaml").read_text()))
    finally:
        os.chdir(cwd)


def test_real_slurm_runs_every_rule_as_a_job_and_matches_a_local_run(cluster, workdir, small_corpus,
                                                                      quality_examples, tmp_path_factory):
    tiny_workdir(workdir, small_corpus, quality_examples)
    local = tmp_path_factory.mktemp("local_run")
    shutil.copytree(workdir, local, dirs_exist_ok=True, symlinks=True)
    plan = plan_of(workdir)
    pretrain = plan.manifest_path("pretrain", plan.chain["tiny"]["pretrain"])
    targets = ["results/tiny/anchors.json", pretrain]

    out, slurm_s = snakemake(cluster, workdir, *targets, "--config", SLURM_CONFIG)
    assert "SLURM job status by squeue, not sacct (sacct exited 1: Slurm accounting storage is disabled)" in out
    jobs = submitted(out)
    assert sorted(jobs.values()) == ["anchors", "anchors_view", "filter", "pretrain", "shard"], out[-3000:]
    held = {j["JobId"]: j for j in cluster.jobs()}  # slurmctld keeps finished jobs for MinJobAge (300 s)
    for job_id in jobs:
        job = held[job_id]
        assert job["JobState"] == "COMPLETED" and job["NodeList"] == cluster.node and job["Partition"] == "debug", job
        assert job["ExitCode"] == "0:0", job
    pretrain_job = held[next(i for i, r in jobs.items() if r == "pretrain")]
    assert pretrain_job["NumCPUs"] == "2" and pretrain_job["NumNodes"] == "1", pretrain_job  # threads 2, nodes=1
    assert "TresPerJob" not in pretrain_job or "gpu" not in pretrain_job["TresPerJob"]  # device: cpu, no GPUs asked

    _, local_s = snakemake(cluster, local, *targets, profile=False)
    for stage in ("filter", "shard", "anchors", "pretrain"):
        path = Path(plan.manifest_path(stage, plan.chain["tiny"][stage])).parent
        assert_same_artifact(workdir / path, local / path)
    print(f"real SLURM: {len(jobs)} jobs in {slurm_s:.0f} s; locally {local_s:.0f} s")


FAILING_SNAKEFILE = """
configfile: "config/config.yaml"


include: "workflow/rules/common.smk"


rule fails:
    output:
        "results/never.txt",
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
        **slurm(),
    shell:
        "echo about to fail; exit 3"
"""


def test_real_slurm_failing_job_fails_the_run(cluster, workdir, small_corpus, quality_examples):
    tiny_workdir(workdir, small_corpus, quality_examples)
    (workdir / "fails.smk").write_text(FAILING_SNAKEFILE)
    out, seconds = snakemake(cluster, workdir, "-s", "fails.smk", "--config", SLURM_CONFIG, ok=False)
    ((job_id, rule),) = submitted(out).items()
    assert rule == "fails"
    assert f"SLURM-job '{job_id}' failed, SLURM status is: 'FAILED'" in out, out[-3000:]
    job = {j["JobId"]: j for j in cluster.jobs()}[job_id]
    assert job["JobState"] == "FAILED" and job["ExitCode"] != "0:0", job
    print(f"real SLURM: failing job reported in {seconds:.0f} s")


GPU_TORCHRUN = """#!{python}
# Stands in for torchrun on a node whose GPUs are /dev/null-like devices: records its call, fails the job.
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "SLURM_JOB_ID": os.environ.get("SLURM_JOB_ID")}}) + "\\n")
sys.exit(3)
"""


def test_real_slurm_gpu_pretrain_lands_on_the_gres_node_with_two_gpus(cluster, workdir, small_corpus,
                                                                      quality_examples, tmp_path):
    """The pretrain rule for a preset with resources.gpus 2 on the node declared Gres=gpu:2 (devices
    made like /dev/null): sbatch --gpus=2 --nodes=1, SLURM binds both GPUs (CUDA_VISIBLE_DEVICES=0,1)
    and gpu-run starts torchrun with 2 processes. No CUDA here: a recording torchrun fails the job."""
    tiny_workdir(workdir, small_corpus, quality_examples)
    preset_path = workdir / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(preset_path.read_text())
    preset["train"].update(device="cuda", batch_size=8)
    preset["resources"] = {"gpus": 2}
    preset_path.write_text(yaml.safe_dump(preset, sort_keys=False))
    plan = plan_of(workdir)
    shard_manifest = workdir / plan.manifest_path("shard", plan.chain["tiny"]["shard"])
    shard_manifest.parent.mkdir(parents=True)
    shard_manifest.write_text("{}")  # the input must exist; the recording torchrun never reads it
    (workdir / "pretrain_only.smk").write_text('configfile: "config/config.yaml"\n\n\ninclude: "workflow/rules/common.smk"\n'
                                               'include: "workflow/rules/train.smk"\n')
    bin_dir, log = tmp_path / "bin", tmp_path / "torchrun.jsonl"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(GPU_TORCHRUN.format(python=sys.executable, log=str(log)))
    (bin_dir / "torchrun").chmod(0o755)
    out, _ = snakemake(cluster, workdir, "-s", "pretrain_only.smk", plan.manifest_path("pretrain", plan.chain["tiny"]["pretrain"]),
                       "--config", SLURM_CONFIG, ok=False, path_first=bin_dir)
    ((job_id, rule),) = submitted(out).items()
    assert rule == "pretrain"
    job = {j["JobId"]: j for j in cluster.jobs()}[job_id]
    assert job["TresPerJob"] == "gres:gpu:2" and job["NodeList"] == cluster.node and job["NumNodes"] == "1", job
    assert job["NumCPUs"] == str(NODE_CPUS), job  # 2 threads per GPU, capped by --max-threads
    (launch,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert launch["argv"][:3] == ["--standalone", "--nproc-per-node", "2"], launch
    assert launch["CUDA_VISIBLE_DEVICES"] == "0,1" and launch["SLURM_JOB_ID"] == job_id, launch
