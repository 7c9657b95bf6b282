#!/usr/bin/env bash
# Issue #28's acceptance on one GPU (device tool): every pretrain run of an experiment (EXP, default small_qat: a
# control that measures each rung after training, train.ptq_rungs, and one QAT-finish arm per rung; 3 seeds, 12
# runs), then its verdict (with #28's bars, qat_acceptance), from the repo root there.
# Made here first (repo root, after benchmarks/prepare_device.sh, which builds the small preset's data stages and
# .whl_chain):
#   bash benchmarks/gpu_small_qat.sh --plan   # .job/qat/<exp>.<arm>.s<seed>.json + <exp>.experiment.json
# then, device tool, carry [".whl_chain", ".job", "results/store/shard/<small's shard>"] (prepare_device.sh names it):
#   WHL=.whl_chain bash benchmarks/gpu_small_qat.sh
# Runs go seed by seed; built runs are skipped and a killed one resumes from its scratch checkpoint (every 500
# steps), so on a warm machine call again until the verdict is written; everything stops before BUDGET_S (or
# DEADLINE). Back in $OUT: runs.tar (every finished run's manifest and metrics.jsonl: all the verdict reads),
# logs.tar, and once every run is in, verdict.json and curves.png. 12 runs of ~3-4 min outlast one session's device
# time: here, `mkdir -p .job/qat/runs && tar -xf runs.tar -C .job/qat/runs`; the next session carries .job and the
# script skips those runs and judges them with the rest (each run's manifest names its GPU, final.gpu).
set -uo pipefail
EXP=${EXP:-small_qat}
J=.job/qat
if [ "${1:-}" = "--plan" ]; then
  mkdir -p "$J"
  .venv/bin/python - "$EXP" "$J" <<'PY'
import sys
from pathlib import Path

from dormouse.core.config import load_yaml
from dormouse.planner.plan import build_plan

name, out = sys.argv[1], Path(sys.argv[2])
plan = build_plan(load_yaml(Path("config/config.yaml")))
(out / f"{name}.experiment.json").write_text(plan.experiment_json(name))
for arm, seeds in plan.experiment_runs(name).items():
    for seed, digest in seeds.items():
        (out / f"{name}.{arm}.s{seed}.json").write_text(plan.job_json("pretrain", digest))
        print(f"{name} {arm} seed {seed}: pretrain {digest}")
PY
  exit
fi
source benchmarks/gpu_env.sh
deadline=${DEADLINE:-$(( $(date +%s) + ${BUDGET_S:-560} ))}  # DEADLINE: epoch seconds, when a call runs other things first
logs=/tmp/qat_logs && mkdir -p "$logs"
# every finished run's manifest + metrics, as a store the verdict reads (it needs no weights): built here, or carried
# from an earlier session's runs.tar under $J/runs (so an experiment longer than a session's device time goes on)
runs=/tmp/qat_runs && mkdir -p "$runs/pretrain"
# once per machine: a later call on it keeps what the first dropped (below), though each call carries .job again
if [ ! -f "$runs/.carried" ]; then
  [ -d "$J/runs/pretrain" ] && cp -rn "$J/runs/pretrain/." "$runs/pretrain/"
  touch "$runs/.carried"
fi
collect() {  # $1: a run's artifact dir in the store
  local d=$1 g; g=$(basename "$d")
  [ -f "$d/manifest.json" ] && [ ! -f "$runs/pretrain/$g/manifest.json" ] && mkdir -p "$runs/pretrain/$g" \
    && cp "$d/manifest.json" "$d/metrics.jsonl" "$runs/pretrain/$g/"
  return 0
}
done_all=1
# seed by seed (control s0, each arm s0, control s1, ...): a call cut short leaves whole seeds behind it. An arm that
# branches (the experiment's branch) continues its control's artifact in this store: a control carried only as a
# manifest is built again when an arm of its seed is still to run, and that seed's carried arms are dropped with it
# (they continued the earlier build)
jobs=$(python3 - "$J" "$EXP" "$runs/pretrain" <<'PY'
import json, re, shutil, sys
from pathlib import Path

J, exp, runs = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
jobs = {}
for p in J.glob(f"{exp}.*.s*.json"):
    arm, seed = re.fullmatch(rf"{re.escape(exp)}\.(.+)\.s(\d+)\.json", p.name).groups()
    jobs[(int(seed), arm != "control", arm)] = p
spec = {k: json.loads(p.read_text()) for k, p in jobs.items()}
for seed in sorted({k[0] for k in jobs}):
    control = spec[(seed, False, "control")]
    branches = [j for (s, is_arm, _), j in spec.items() if s == seed and is_arm and "trunk" in j["inputs"]]
    todo = [j for j in branches if not (runs / Path(j["out"]).name / "manifest.json").exists()]
    carried = [j for j in [control, *branches] if (runs / Path(j["out"]).name).exists()]
    if todo and carried and not (Path(control["out"]) / "manifest.json").exists():
        for j in carried:
            shutil.rmtree(runs / Path(j["out"]).name)
        print(f"seed {seed}: its control is not in this store and {len(todo)} arm(s) still branch from it: the control "
              "runs again, and every arm of the seed after it", file=sys.stderr)
print(" ".join(str(jobs[k]) for k in sorted(jobs)))
PY
)
for job in $jobs; do
  out=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['out'])" "$job")
  run=$(basename "$job" .json)
  collect "$out"
  if [ -f "$runs/pretrain/$(basename "$out")/manifest.json" ]; then echo "$run: built ($(basename "$out"))"; continue; fi
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 60 ]; then echo "$run: no time left in this call; call again"; done_all=0; break; fi
  echo "$run: running (at most ${left}s) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  timeout "$left" python3 -m dormouse.cli pretrain --job @"$job" > "$logs/$run.log" 2>&1
  rc=$?
  grep -E "^\[pretrain\] (step:|qat|cuda_graphs)" "$logs/$run.log" | tail -6
  if [ "$rc" -ne 0 ]; then echo "$run: exit $rc (see logs.tar)"; tail -5 "$logs/$run.log"; done_all=0; break; fi
  collect "$out"
done
tar -cf "$OUT/logs.tar" -C "$logs" .
tar -cf "$OUT/runs.tar" -C "$runs" pretrain  # here: tar -xf runs.tar -C .job/qat/runs (carried next time)
echo "runs finished so far: $(ls "$runs/pretrain" | wc -l) of $(echo $jobs | wc -w)"
if [ "$done_all" = 1 ]; then
  python3 -m dormouse.cli verdict --experiment "$(cat "$J/$EXP.experiment.json")" --store "$runs" \
    --out "$OUT/verdict.json" --plot "$OUT/curves.png"
fi
