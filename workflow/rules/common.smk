# The plan: validated config, resolved presets and every job's digest, computed at parse time
# (dormouse.planner.plan; cheap: config files and file stats only).
import os
import sys
from pathlib import Path

from dormouse.data import demo_corpus, scale_corpus
from dormouse.core.config import ConfigError, load_yaml
from dormouse.planner.plan import build_run_plan
from dormouse.core.store import canonical_json

try:
    # What --config changed against config/config.yaml (set=, corpus=, ...): where that changes a preset's chain,
    # its views go to results/<preset>@<tag>/, so a one-off run does not replace the preset's own results/<preset>/.
    PLAN = build_run_plan(config, load_yaml(Path("config/config.yaml")), dict(workflow.config_settings.config))
except ConfigError as e:  # a configuration mistake: the message names what to fix; no traceback
    print(f"dormouse: {e}", file=sys.stderr)
    sys.exit(1)
STORE = PLAN.store
# A target nothing makes (a preset not in this run, a misspelt file) is named with the fix, not MissingRuleException
problem = PLAN.cli_target_problem()
if problem:
    print(f"dormouse: {problem}", file=sys.stderr)
    sys.exit(1)


wildcard_constraints:
    d="[0-9a-f]{20}",
    view=PLAN.view_pattern(),
    exp="|".join(PLAN.experiments) or "(?!)",


def stage_inputs(stage):
    # ancient(): a content-addressed input reruns nothing by its modification time. Its path holds its digest
    # (raw files: their size and mtime are in the digest), so a changed input is a new path; an artifact
    # re-created with the same digest (after a kill, or a manifest put back) must not cascade downstream.
    return lambda w: {k: ancient(v) for k, v in PLAN.input_files(stage, w.d).items()}


def stage_job(stage):
    # Canonical JSON string: Snakemake's params trigger compares repr, so keep it stable.
    return lambda w: PLAN.job_json(stage, w.d)


def stage_job_file(stage):
    """The job JSON written to results/jobs/<stage>/<digest>.json (when it differs), for the shell to pass as
    --job @file: the printed command stays one short line. The params trigger still reads `job` above."""

    def path(w):
        out = Path("results/jobs") / stage / f"{w.d}.json"
        text = PLAN.job_json(stage, w.d)
        if not out.exists() or out.read_text() != text:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(out)
        return str(out)

    return path


def view_input(stage):
    return lambda w: ancient(PLAN.manifest_path(stage, PLAN.chain[PLAN.view_preset(w.view)][stage]))


def view_params():
    """What `dormouse view` records beside the result: the preset and this run's overrides (canonical JSON, so
    the params trigger sees a stable string)."""
    return {"preset": lambda w: PLAN.view_preset(w.view),
            "overrides": lambda w: canonical_json(PLAN.view_overrides(PLAN.view_preset(w.view)))}



def slurm(gpu=False):
    """sbatch partition/account resources from config (ignored by the local executor)."""
    cfg = PLAN.config["slurm"]
    partition = (cfg["gpu_partition"] or cfg["partition"]) if gpu else cfg["partition"]
    out = {}
    if partition:
        out["slurm_partition"] = partition
    if cfg["account"]:
        out["slurm_account"] = cfg["account"]
    return out


# Under the slurm executor: the status command this cluster answers (sacct, or squeue without
# accounting) and a guard that fails a job whose status stays unreadable (dormouse/tools/slurm_status.py).
SLURM_STATUS = {}


onstart:
    from dormouse.tools import slurm_status

    guard = slurm_status.install(workflow, 60 * PLAN.config["slurm"]["status_timeout_min"])
    if guard is not None:
        SLURM_STATUS["guard"] = guard


def log_slurm_status_counts():
    import sys

    if SLURM_STATUS and SLURM_STATUS["guard"].counts:
        print(f"dormouse: SLURM status counters {dict(SLURM_STATUS['guard'].counts)}", file=sys.stderr)


onsuccess:
    log_slurm_status_counts()


onerror:
    log_slurm_status_counts()
