"""A pretrain's quantization-aware finish and its branching: the finish's FakeQuant and first step, the checks that it
ran, the checkpoints a run keeps for its branches, and a branch's start from its trunk's kept checkpoint (what the
pretrain stage's docstring describes: train.qat, train.keep_checkpoints, an experiment's `branch`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from dormouse.train import checkpoint, qat
from dormouse.train.arms import before_finish, finish_start
from dormouse.train.qat import FakeQuant
from dormouse.train.settings import TrainSettings

KEPT = "kept"  # the scratch folder of train.keep_checkpoints


def qat_finish(model, train: TrainSettings, say) -> tuple[FakeQuant | None, int]:
    """(the finish's FakeQuant or None, its first step; train.steps when off)."""
    spec = train.qat
    if spec is None:
        return None, train.steps
    start = finish_start(train.steps, spec.fraction)
    if spec.fraction > 0 and start == train.steps:
        raise SystemExit(f"pretrain: train.qat.fraction {spec.fraction} of {train.steps} steps rounds to no step; "
                         "raise it, or set 0 to measure only the final weights' rung")
    fq = FakeQuant(model, spec.rung)
    say(f"[pretrain] qat: steps {start}..{train.steps - 1} train through {spec.rung} "
        f"({len(fq.quantized)} tensors; the rest bf16, as export writes them)", flush=True)
    return fq, start


def qat_summary(c, fq: FakeQuant, train: TrainSettings, start: int, train_total, step_fn, here: int) -> dict:
    """Counters and the manifest's final.qat; a finish that did not run is a defect, as an inert arm is: every step
    and eval counted through the rung in this process must have entered the rung's forward (fq.applications)."""
    planned, ran = train.steps - start, train_total.get("qat.steps", 0)
    if ran != planned:
        raise SystemExit(f"pretrain: the quantization-aware finish planned {planned} steps through {fq.rung}, ran {ran}")
    if fq.applications != here:
        raise SystemExit(f"pretrain: {here} forwards (steps x micro-batches, evals) through {fq.rung} in this process entered its forward "
                         f"{fq.applications} times")
    summary = qat.file_counters(c, fq, "pretrain", ran)
    if step_fn.graphs == "graphed":
        c["cuda_graphs.eager_steps_qat"] = step_fn.eager_steps_qat
    return {**summary, "fraction": train.qat.fraction, "from_step": start}


def keep_checkpoints(art, kept_root: Path, steps: set[int]) -> None:
    """train.keep_checkpoints: each kept step's checkpoint (weights, optimizer state, data position, counters) into
    the artifact's checkpoints/, where a finish branches from it (an experiment's `branch`)."""
    for step in sorted(steps):
        src = kept_root / f"step-{step:08d}"
        if not (src / checkpoint.SNAPSHOT).exists():
            raise SystemExit(f"pretrain: train.keep_checkpoints lists step {step}, but {src} holds no checkpoint")
        for name in (checkpoint.WEIGHTS, checkpoint.OPTIM, checkpoint.SNAPSHOT):
            shutil.copyfile(src / name, art.path(f"checkpoints/{src.name}/{name}"))


def branch(trunk, params: dict, model, opts, start: int) -> tuple[Path, dict]:
    """Load the trunk artifact's kept checkpoint at this run's finish start: the run continues the trunk's own steps,
    as a resume would, so only the finish trains. The trunk must have trained exactly these params up to there (every
    key but the finish's own, arms.before_finish), which the experiment's plan arranges and this checks."""
    mine, theirs = before_finish(params), before_finish(trunk.manifest["params"])
    if mine != theirs:
        differ = sorted(k for sec in ("model", "train") for k in {**mine[sec], **theirs[sec]}
                        if mine[sec].get(k) != theirs[sec].get(k))
        raise SystemExit(f"pretrain: trunk {trunk.path} trained other params than this run before its finish ({differ})")
    own = trunk.manifest["params"]["train"].get("qat")
    if own and finish_start(theirs["train"]["steps"], own["fraction"]) < start:
        raise SystemExit(f"pretrain: trunk {trunk.path} trains through {own['rung']} before step {start}, where this "
                         "run's finish starts: its steps are not this run's")
    name = f"checkpoints/step-{start:08d}"
    if f"{name}/{checkpoint.SNAPSHOT}" not in trunk.manifest["files"]:
        raise SystemExit(f"pretrain: trunk {trunk.path} keeps no checkpoint at step {start}, where this run's finish "
                         f"starts (its kept: {sorted({f.split('/')[1] for f in trunk.files('checkpoints/')})})")
    for f in (checkpoint.WEIGHTS, checkpoint.OPTIM, checkpoint.SNAPSHOT):
        trunk.file(f"{name}/{f}")  # verified against the trunk's manifest
    path = trunk.path / name
    checkpoint.load_weights(model, path / checkpoint.WEIGHTS)
    checkpoint.load_optimizers(opts, path / checkpoint.OPTIM)
    # the build of the trunk, not only its digest (a GPU rebuild of one digest is another build): the verdict checks
    # that an arm and its control are the same build
    built = {"digest": trunk.digest, "step": start,
             "weights_sha256": trunk.manifest["files"][f"{name}/{checkpoint.WEIGHTS}"]["sha256"]}
    return path, {**checkpoint.load_snapshot(path), "branched_from": built}
