#!/usr/bin/env bash
# Issue #23's acceptance on one GPU (device tool): the rl arms, each a job dir .job/<arm>/ of
# <preset>_{rl,export,bench}.json planned by benchmarks/prepare_device.sh from one sft model, run side by side
# (an rl arm is decode-bound and uses a sliver of the GPU; one after another, four arms cost ~4x the clock), then
# their exports side by side, then their benches. Each stage runs only for the arms whose artifact is not built,
# and only when the call has the stage's MIN time left (rl does not resume: a killed rl starts over), so the same
# command is called again on the warm machine until it prints "all arms benched". Then
# benchmarks/rl_acceptance.py reads each recipe's seeds (arms named <recipe>_s<seed>).
#   after `STAGES="pretrain sft" WHL=.whl_chain bash benchmarks/gpu_small_chain.sh` on the same warm machine
#   (carried: .whl_chain, .job and the shard and anchors artifacts prepare_device.sh names; the sft stays there):
#   WHL=.whl_chain bash benchmarks/gpu_rl_acceptance.sh        (ARMS default: rl_s0 rl_s1 rl_s2 null_s0, issue #40)
# Back in $OUT: rl_acceptance.tar (the device returns 8 files a call), holding every call's <arm>_<stage>.log, the sft
# model's rl_diagnosis.{tsv,json,log} (run beside the rl arms; DIAG=0 skips it) and, once benched, bench_<arm>.json,
# rl_acceptance_<recipe>.json and rl_dev_curves_<recipe>.png (every arm's dev curve, the null arm's too); they
# accumulate in $LOGS while the machine stays warm.
# Here (CPU, tiny jobs; tests/test_rl_acceptance.py): PY=.venv/bin/python PRESET=tiny ARMS="a_s0 a_s1" bash ...
set -uo pipefail
PY=${PY:-python3}
PRESET=${PRESET:-small}
ARMS=${ARMS:-rl_s0 rl_s1 rl_s2 null_s0}  # issue #40: three seeds of the default recipe and the null arm
JOBS=${JOBS:-.job}
OUT=${OUT:-/tmp/rl_out}; mkdir -p "$OUT"
LOGS=${LOGS:-/tmp/rl_logs}; mkdir -p "$LOGS"
# Triton's autotune results of the lease ride in the tar too (commit them as benchmarks/triton_autotune_small.tgz: an
# arm's first update otherwise spends ~30 s autotuning the replay shapes)
trap '[ -d "${TRITON_CACHE_DIR:-}" ] && (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar -czf "$LOGS/triton_autotune.tgz" -T -)
      tar -cf "$OUT/rl_acceptance.tar" -C "$LOGS" .' EXIT
deadline=${DEADLINE:-$(( $(date +%s) + ${CALL_S:-570} ))}  # DEADLINE: epoch seconds, when a call runs other things first
if [ "$PY" = python3 ]; then
  source "$(dirname "$0")/gpu_env.sh"  # its last test may return non-zero: not chained
fi
# the benchmarks run as modules of this checkout (`$PY -m benchmarks.<name>`) from any working directory
BENCH_PATH=$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}
out_of() { $PY -c "import json, sys; print(json.load(open(sys.argv[1]))['out'])" "$1"; }
# the least time a stage is started with, all arms side by side (H200, small: rl ~160 s alone, bench ~240 s)
min_s() { case $1 in rl) echo "${MIN_RL_S:-420}";; export) echo "${MIN_EXPORT_S:-60}";; *) echo "${MIN_BENCH_S:-330}";; esac; }
# rl does not resume, so an arm cut by the call's end is lost: while the arms run side by side, each arm's rate is
# measured over a window of at least WATCH_AFTER_S (from its step line, `[rl] step N/M`), and when the slowest arm's
# remaining steps at that rate end past the deadline, the last arm still running is stopped (it runs in the next
# call); the window then starts again, so the others' faster rate without it is measured before another is stopped
watch_rl_arms() {
  local i now step total alive worst rest bt bs ready
  declare -A base=()
  while sleep 10; do
    alive=()
    for i in "${!pids[@]}"; do kill -0 "${pids[$i]}" 2>/dev/null && alive+=("$i"); done
    [ ${#alive[@]} -le 1 ] && return
    now=$(date +%s) worst=0 ready=1
    for i in "${alive[@]}"; do
      step=
      read -r step total < <(grep -oE "^\[rl\] step [0-9]+/[0-9]+" "$LOGS/${todo[$i]}_rl.log" | tail -1 | tr -c '0-9\n' ' ')
      if [ -z "$step" ]; then ready=0; continue; fi  # an arm still loading: no rate yet
      [ -n "${base[$i]:-}" ] || base[$i]="$now $step"
      read -r bt bs <<< "${base[$i]}"
      if [ $(( now - bt )) -lt "${WATCH_AFTER_S:-60}" ] || [ "$step" -le "$bs" ]; then ready=0; continue; fi
      rest=$(( (total - step) * (now - bt) / (step - bs) ))
      [ "$rest" -gt "$worst" ] && worst=$rest
    done
    if [ "$ready" = 1 ] && [ $(( now + worst + ${ETA_MARGIN_S:-30} )) -gt "$deadline" ]; then
      i=${alive[-1]}
      echo "${todo[$i]}: rl stopped (the slowest arm needs ~${worst}s more, past this call's deadline); it runs in the next call"
      kill "${pids[$i]}"
      base=()  # the rest's rate without it, measured afresh
    fi
  done
}
# every artifact the arms' stages read and this script does not build (the shard, anchors, sft — and pretrain, which
# bench scores too) must be here before any rl minute is spent: session 25 ran rl and export of four arms from a
# carried sft and then found no pretrain for bench
missing=$($PY - "$JOBS" "$PRESET" $ARMS <<'PY'
import json, os, sys
jobs, preset, arms = sys.argv[1], sys.argv[2], sys.argv[3:]
need = set()
for a in arms:
    for stage in ("rl", "export", "bench"):
        path = f"{jobs}/{a}/{preset}_{stage}.json"
        if os.path.exists(path):
            need |= {(i["stage"], i["digest"]) for name, i in json.load(open(path)).get("inputs", {}).items()
                     if i.get("kind") == "artifact" and name not in ("rl", "export")}  # the arm's own: built here
print(" ".join(f"results/store/{s}/{d}" for s, d in sorted(need) if not os.path.exists(f"results/store/{s}/{d}/manifest.json")))
PY
) || { echo "the arms' jobs under $JOBS could not be read (above)"; exit 2; }
if [ -n "$missing" ]; then
  echo "not here, and the arms need them: $missing (carry them, or build pretrain and sft first with gpu_small_chain.sh)"
  exit 2
fi
for stage in rl export bench; do
  todo=()
  for a in $ARMS; do
    job=$JOBS/$a/${PRESET}_$stage.json
    [ -f "$job" ] || { echo "$a: no $job (benchmarks/prepare_device.sh plans it)"; exit 2; }
    [ -f "$(out_of "$job")/manifest.json" ] || todo+=("$a")
  done
  [ ${#todo[@]} -eq 0 ] && { echo "$stage: built for every arm"; continue; }
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt "$(min_s $stage)" ]; then echo "$stage: ${left}s left, under $(min_s $stage)s; call again"; exit 0; fi
  echo "$stage: ${todo[*]} side by side (at most ${left}s)"
  pids=()
  diag=
  if [ "$stage" = rl ] && [ "${DIAG:-1}" = 1 ] && [ ! -f "$LOGS/rl_diagnosis.json" ]; then
    # #23 item 1 beside the arms: the sft model's per-prompt pass rates per cell, on the GPU's spare share
    sft=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['inputs']['sft']['digest'])" "$JOBS/${todo[0]}/${PRESET}_rl.json")
    PYTHONPATH=$BENCH_PATH timeout "$left" $PY -m benchmarks.rl_diagnosis --artifact "results/store/sft/$sft" --group-size "${DIAG_G:-8}" \
      --prompts-per-cell "${DIAG_PROMPTS:-64}" --out "$LOGS/rl_diagnosis.tsv" --json "$LOGS/rl_diagnosis.json" \
      > "$LOGS/rl_diagnosis.log" 2>&1 &
    diag=$!
  fi
  for a in "${todo[@]}"; do
    timeout "$left" $PY -m dormouse.cli "$stage" --job "@$JOBS/$a/${PRESET}_$stage.json" > "$LOGS/${a}_$stage.log" 2>&1 &
    pids+=($!)
  done
  if [ "$stage" = rl ]; then watch_rl_arms; fi
  failed=0 late=0
  for i in "${!todo[@]}"; do
    wait "${pids[$i]}"; rc=$?
    a=${todo[$i]}
    grep -E "^\[$stage\] (start|end|selected)" "$LOGS/${a}_$stage.log" | sed "s/^/$a: /"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 143 ]; then echo "$a: $stage ran out of this call's time; call again"; late=1
    elif [ "$rc" -ne 0 ]; then echo "$a: $stage exit $rc (${a}_$stage.log)"; tail -3 "$LOGS/${a}_$stage.log"; failed=1; fi
  done
  if [ -n "$diag" ]; then
    wait "$diag" && grep "cells where" "$LOGS/rl_diagnosis.log" || { echo "rl_diagnosis failed (rl_diagnosis.log)"; tail -3 "$LOGS/rl_diagnosis.log"; }
  fi
  [ "$failed" -eq 0 ] || exit 1
  [ "$late" -eq 0 ] || exit 0
done
echo "all arms benched"
recipes=()
nulls=()  # null_s<seed> arms (rl.shuffle_rewards): given to every recipe's acceptance as its null arm
for a in $ARMS; do
  cp "$(out_of "$JOBS/$a/${PRESET}_bench.json")/bench.json" "$LOGS/bench_$a.json"
  r=${a%_s*}
  if [ "$r" = null ]; then [ ${#nulls[@]} -eq 0 ] && nulls=(--null "$LOGS/bench_$a.json"); continue; fi  # the first
  [[ " ${recipes[*]-} " == *" $r "* ]] || recipes+=("$r")
done
for r in "${recipes[@]}"; do
  benches=()
  for a in $ARMS; do [ "${a%_s*}" = "$r" ] && benches+=("$LOGS/bench_$a.json"); done
  PYTHONPATH=$BENCH_PATH $PY -m benchmarks.rl_acceptance --bench "${benches[@]}" "${nulls[@]}" --out "$LOGS/rl_acceptance_$r.json" \
    --plot "$LOGS/rl_dev_curves_$r.png" --preset "$PRESET"
  echo "$r: rl_acceptance exit $? (0 accepted, 1 not)"
done
