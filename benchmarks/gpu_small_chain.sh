#!/usr/bin/env bash
# The small preset's chain after the data stages — pretrain, sft, rl, export, bench — on one H200
# (device tool), run from the repo root there. Made here first:
#   for s in pretrain sft rl export bench; do dormouse plan --preset small --stage $s > .job/small_$s.json; done
# carried: $WHL (default .whl: fla-core, jsonschema + deps, zstandard, ml_dtypes for cp312; the
# 64 MiB carry limit may need a smaller set), .job, and the input artifacts prepare_device.sh names (never all of
# results/store/shard: a scale shard is 600 MB).
# JOBDIR (default .job) holds the jobs (an rl arm of benchmarks/prepare_device.sh has only its rl, export and bench).
# Stages already built on this (warm) machine are skipped and a killed pretrain resumes from its
# scratch checkpoint, so a second call continues the first. Everything stops before BUDGET_S.
# Back in $OUT: logs, art/small_chain.tar (manifests, metrics, bench.json), with WEIGHTS_BACK="sft"
# (a list of stages) those stages' whole artifacts as `dormouse pack` parts of 15 MiB (art/<stage>-<digest>.tar.zst.*
# and .parts.json: `dormouse unpack <files_at>/art --store results/store` here verifies and restores them; a small
# sft then travels back as results/store/sft/<digest>, 36.5 MB, for rl without pretrain and sft), and Triton's autotune results
# (triton_autotune.tgz, a few hundred KB; the whole cache is over $OUT's 16 MiB a file). Carry
# that tgz in .cache_h200/ and the next lease skips most of the autotune (~150-400 s cold).
set -uo pipefail
source benchmarks/gpu_env.sh
J=${JOBDIR:-.job}
deadline=${DEADLINE:-$(( $(date +%s) + ${BUDGET_S:-560} ))}  # DEADLINE: epoch seconds, when a call runs other things first
for s in ${STAGES:-pretrain sft rl export bench}; do
  out=$(python3 -c "import json; print(json.load(open('$J/small_$s.json'))['out'])")
  if [ -f "$out/manifest.json" ]; then echo "$s: already built ($out)"; continue; fi
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "$s: no time left in this call; call again"; break; fi
  echo "$s: running (at most ${left}s)"
  timeout "$left" python3 -m dormouse.cli "$s" --job @$J/small_$s.json > "$OUT/$s.log" 2>&1
  rc=$?
  grep -E "^\[$s\] (start|end|step:|[a-z0-9@]+: |rl@)" "$OUT/$s.log" | tail -20
  if [ "$rc" -ne 0 ]; then echo "$s: exit $rc (see $s.log)"; tail -5 "$OUT/$s.log"; break; fi
done
mkdir -p "$OUT/art"
for s in pretrain sft rl export bench; do
  [ -f "$J/small_$s.json" ] || continue
  d=$(python3 -c "import json; print(json.load(open('$J/small_$s.json'))['out'])")
  [ -f "$d/manifest.json" ] || continue
  tar -rf "$OUT/art/small_chain.tar" -C "$d/.." "$(basename "$d")/manifest.json" \
    $(cd "$d" && ls metrics.jsonl bench.json 2>/dev/null | sed "s|^|$(basename "$d")/|")
done
# $OUT returns at most 8 files: a model's 3 parts and their list, one tar, the autotune tgz and one log per stage run.
if [ -n "${WEIGHTS_BACK:-}" ]; then
  for s in $WEIGHTS_BACK; do
    d=$(python3 -c "import json; print(json.load(open('$J/small_$s.json'))['out'])")
    [ -f "$d/manifest.json" ] || continue
    python3 -m dormouse.cli pack --artifact "$d" --out "$OUT/art" --part-mib 15 || echo "$s: pack failed"
  done
fi
# Triton's autotune results (`<kernel>.autotune.json` in the cache; fla asks Triton to keep them).
if [ -n "${SAVE_TRITON:-}" ]; then
  (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar -czf "$OUT/triton_autotune.tgz" -T -) && ls -la "$OUT/triton_autotune.tgz"
fi
