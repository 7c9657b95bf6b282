#!/usr/bin/env bash
# The small preset's chain after the data stages — pretrain, sft, rl, export, bench — on one H200
# (device tool), run from the repo root there. Made here first:
#   for s in pretrain sft rl export bench; do dormouse plan --preset small --stage $s > .job/small_$s.json; done
# carried: .whl (fla-core, jsonschema + deps, zstandard, ml_dtypes for cp312), .job, and the small
# shard and anchors artifacts under results/store. Stages already built on this (warm) machine are
# skipped and a killed pretrain resumes from its scratch checkpoint, so a second call continues the
# first. Everything stops before BUDGET_S; logs, manifests and bench.json come back in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton}
deadline=$(( $(date +%s) + ${BUDGET_S:-560} ))
for s in ${STAGES:-pretrain sft rl export bench}; do
  out=$(python3 -c "import json; print(json.load(open('.job/small_$s.json'))['out'])")
  if [ -f "$out/manifest.json" ]; then echo "$s: already built ($out)"; continue; fi
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "$s: no time left in this call; call again"; break; fi
  echo "$s: running (at most ${left}s)"
  timeout "$left" python3 -m dormouse.cli "$s" --job @.job/small_$s.json > "$OUT/$s.log" 2>&1
  rc=$?
  grep -E "^\[$s\] (start|end|step:|[a-z0-9@]+: |rl@)" "$OUT/$s.log" | tail -20
  if [ "$rc" -ne 0 ]; then echo "$s: exit $rc (see $s.log)"; tail -5 "$OUT/$s.log"; break; fi
done
mkdir -p "$OUT/art"
for s in pretrain sft rl export bench; do
  d=$(python3 -c "import json; print(json.load(open('.job/small_$s.json'))['out'])")
  [ -f "$d/manifest.json" ] || continue
  tar -rf "$OUT/art/small_chain.tar" -C "$d/.." "$(basename "$d")/manifest.json" \
    $(cd "$d" && ls metrics.jsonl bench.json 2>/dev/null | sed "s|^|$(basename "$d")/|")
done
# Triton's autotune results live in its cache (fla caches them); bring them back for the next lease.
if [ -n "${SAVE_TRITON:-}" ] && [ -d "$TRITON_CACHE_DIR" ]; then
  tar -czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . && ls -la "$OUT/triton_cache.tgz"
fi
