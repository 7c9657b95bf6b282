#!/usr/bin/env bash
# rl arms on one H200 (device tool), all from the same small sft model and run side by side (each uses a
# sliver of the GPU), then the chain after rl for the arm with the best dev accuracy
# (benchmarks/pick_rl_arm.py: rl's own model selection split, never the held-out bench items).
# Made here first, for each arm: a preset edit, then
#   for s in pretrain sft rl export bench; do dormouse plan --preset small --stage $s > .job/<arm>/small_$s.json; done
# carried: $WHL, .job, .cache_h200, the sft artifact and the shard's manifest + eval/.
# ARMS (default "va vb"); AFTER (default "export") = the stages run for the chosen arm in this call.
set -uo pipefail
source benchmarks/gpu_env.sh
for a in ${ARMS:-va vb}; do
  timeout "${RL_S:-330}" python3 -m dormouse.cli rl --job @.job/$a/small_rl.json > "$OUT/rl_$a.log" 2>&1 &
done
wait
for a in ${ARMS:-va vb}; do echo "== $a"; grep -E "^\[rl\] (start|end|selected)" "$OUT/rl_$a.log"; tail -2 "$OUT/rl_$a.log"; done
chosen=$(python3 benchmarks/pick_rl_arm.py ${ARMS:-va vb}) || exit 1
echo "chosen arm: $chosen"
JOBDIR=.job/$chosen STAGES="${AFTER:-export}" bash benchmarks/gpu_small_chain.sh
