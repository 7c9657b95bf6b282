#!/usr/bin/env bash
# Equal wall-clock runs on the scale corpus's b1 shard (issues #31 item 5 and #29 item 5) through the device tool:
# each call of this same command unpacks the shard once (its three parts carried into /tmp/parts beforehand), then
# trains the RUNS in order, each for BUDGET seconds of training, pausing before the call's own limit and resuming
# in the next call (state in /tmp/q_<run>, kept while the machine stays warm). Call it again until it prints
# "all runs done". Back in $OUT: q_<preset>_<system>.tsv per run (the whole curve so far). (tests/test_b1_benches.py)
# Two shards, both b1's: format 1 of the scale corpus (JOB .job/b1_scale_pretrain.json, parts .carry/p0..p2, 626 MB of
# train: b1's 600 s curve is on it, so #31's medium at the same clock goes there too) and format 2
# (JOB=.job/b1_scale2_pretrain.json, parts .carry/scale2/p0..p7, 1 546 MB of train: #29's small, SDPA and medium,
# which read up to 1.40 GB in 600 s). One part a call: carry .whl_chain + a part folder (cp <it>/* /tmp/parts), the
# last with .job too:
#   RUNS="medium:ours" bash benchmarks/gpu_scale_quality.sh                                   # #31, format 1
#   JOB=.job/b1_scale2_pretrain.json RUNS="small:ours small:sdpa medium:ours" bash benchmarks/gpu_scale_quality.sh  # #29
# Here (CPU, a tiny job): PY=.venv/bin/python JOB=<job> PARTS= BUDGET=4 CALL_S=60 MARGIN_S=20 RUNS="tiny:ours" bash ...
set -uo pipefail
PY=${PY:-python3}
JOB=${JOB:-.job/b1_scale_pretrain.json}
RUNS=${RUNS:-medium:ours small:ours small:sdpa}
BUDGET=${BUDGET:-600}
OUT=${OUT:-/tmp/scale_out}; mkdir -p "$OUT"
STATE=${STATE:-/tmp}  # paused runs in $STATE/q_<preset>, finished ones marked in $STATE/q_done
start=$(date +%s)
deadline=${DEADLINE:-$(( start + ${CALL_S:-570} ))}  # DEADLINE: epoch seconds, when a call runs other things first
if [ "$PY" = python3 ]; then
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton}
  # a replacement machine has neither: fail now, not after the unpack or a cold autotune (150-400 s)
  [ -d /tmp/site/zstandard ] || { echo "no /tmp/site/zstandard: source benchmarks/gpu_env.sh (WHL=.whl_chain) first"; exit 2; }
  mkdir -p "$TRITON_CACHE_DIR" && tar -xzf "$(dirname "$0")/triton_autotune_h200.tgz" -C "$TRITON_CACHE_DIR"
fi
# the benchmark runs as a module of this checkout (`$PY -m benchmarks.quality_h200`) from any working directory
BENCH_PATH=$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}
shard=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['inputs']['shard']['digest'])" "$JOB") || exit 2
if [ ! -f "results/store/shard/$shard/manifest.json" ]; then
  [ -n "${PARTS-/tmp/parts}" ] || { echo "no shard $shard in results/store and no PARTS to unpack"; exit 2; }
  $PY -m dormouse.cli unpack "${PARTS:-/tmp/parts}" --store results/store || exit 2
fi
for run in $RUNS; do
  preset=${run%%:*} system=${run##*:}
  done_flag=$STATE/q_done/$preset-$system
  if [ -f "$done_flag" ]; then echo "$run: done"; continue; fi
  # the call's time left, less a margin for the warm-up (compiles, a throwaway model) and the evals off the clock
  # a run's first call compiles cold (b1's spent 225 s off the clock), so it keeps the larger margin
  margin=${MARGIN_S:-$([ -d "$STATE/q_$preset/${system}_$preset" ] && echo 180 || echo 240)}  # quality_h200's state
  left=$(( deadline - $(date +%s) - margin ))
  if [ "$left" -lt "${MIN_S:-60}" ]; then echo "$run: not enough time left in this call; call again"; exit 0; fi
  echo "$run: training for at most ${left}s of this call"
  PYTHONPATH=$BENCH_PATH $PY -m benchmarks.quality_h200 --job "$JOB" --systems "$system" --model-preset "$preset" --budget-s "$BUDGET" \
    --pause-after-s "$left" --state "$STATE/q_$preset" --out "$OUT/q_${preset}_${system}.tsv" 2>&1 \
    | grep -v -i "warn\|run_backward" | tee "$OUT/q_${preset}_${system}.log" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "$run: failed (q_${preset}_${system}.log)"; exit 1; }
  if grep -q "paused at" "$OUT/q_${preset}_${system}.log"; then echo "$run: paused; call again"; exit 0; fi
  mkdir -p "$STATE/q_done" && touch "$done_flag"
done
echo "all runs done"
