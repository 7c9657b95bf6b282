#!/usr/bin/env bash
# Issue #28's acceptance on one H200 (device tool): every pretrain run of an experiment (EXP, default
# small_qat_ternary; then small_qat_mxfp4, small_qat_nvfp4), then its verdict (with #28's bar, qat_acceptance), from
# the repo root there.
# Made here first (repo root, after benchmarks/prepare_device.sh, which builds the small preset's data stages and
# .whl_chain):
#   EXP=small_qat_ternary bash benchmarks/gpu_small_qat.sh --plan   # .job/qat/<exp>.<arm>.s<seed>.json + <exp>.experiment.json
# then, device tool, carry [".whl_chain", ".job", "results/store/shard/<small's shard>"] (prepare_device.sh names it):
#   EXP=small_qat_ternary WHL=.whl_chain bash benchmarks/gpu_small_qat.sh
# Built runs are skipped and a killed one resumes from its scratch checkpoint (every 500 steps), so on a warm machine
# call again until the verdict is written; everything stops before BUDGET_S. Back in $OUT: verdict.json, curves.png,
# runs.tar (each run's manifest and metrics.jsonl), logs.tar.
set -uo pipefail
EXP=${EXP:-small_qat_ternary}
J=.job/qat
if [ "${1:-}" = "--plan" ]; then
  mkdir -p "$J"
  .venv/bin/python - "$EXP" "$J" <<'PY'
import sys
from pathlib import Path

from dormouse.engine.config import load_yaml
from dormouse.engine.plan import build_plan

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
done_all=1
for job in "$J/$EXP".*.s*.json; do
  out=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['out'])" "$job")
  run=$(basename "$job" .json)
  if [ -f "$out/manifest.json" ]; then echo "$run: built ($out)"; continue; fi
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 60 ]; then echo "$run: no time left in this call; call again"; done_all=0; break; fi
  echo "$run: running (at most ${left}s)"
  timeout "$left" python3 -m dormouse.cli pretrain --job @"$job" > "$logs/$run.log" 2>&1
  rc=$?
  grep -E "^\[pretrain\] (step:|qat|cuda_graphs)" "$logs/$run.log" | tail -6
  if [ "$rc" -ne 0 ]; then echo "$run: exit $rc (see logs.tar)"; tail -5 "$logs/$run.log"; done_all=0; break; fi
done
tar -cf "$OUT/logs.tar" -C "$logs" .
for job in "$J/$EXP".*.s*.json; do
  d=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['out'])" "$job")
  [ -f "$d/manifest.json" ] && tar -rf "$OUT/runs.tar" -C "$d/.." "$(basename "$d")/manifest.json" "$(basename "$d")/metrics.jsonl"
done
if [ "$done_all" = 1 ]; then
  python3 -m dormouse.cli verdict --experiment "$(cat "$J/$EXP.experiment.json")" --store results/store \
    --out "$OUT/verdict.json" --plot "$OUT/curves.png"
fi
