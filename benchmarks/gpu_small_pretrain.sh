#!/usr/bin/env bash
# The small preset's pretrain on one H200 (device tool), run by hand from the repo root there:
#   the shard artifact it reads is carried (results/store/shard/<digest>), the job JSON is made
#   here with `dormouse plan --preset small --stage pretrain > .job/small_pretrain.json`, missing
#   wheels (fla-core, jsonschema, zstandard) come from .whl/. Outputs land in $OUT.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton
nvidia-smi -L
python3 -c "import torch, fla, triton; print('torch', torch.__version__, 'fla', fla.__version__, 'triton', triton.__version__)"
if [ "${RUN_KDA_TESTS:-0}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_kda.py 2>&1 | tail -5 | tee $OUT/kda_tests.txt
fi
# A cold run (Triton autotune ~4 min) can outlast one device call: stop before the call's limit,
# keep the checkpoints in results/scratch, and call again on the warm machine to resume.
timeout "${PRETRAIN_LIMIT_S:-540}" python3 -m dormouse.cli pretrain --job "$(cat .job/small_pretrain.json)" 2>&1 \
  | tee -a $OUT/pretrain.log | grep -E "eval_bpb|params|resumed|Error|error" || true
d=$(python3 -c "import json; print(json.load(open('.job/small_pretrain.json'))['out'])")
cp "$d/metrics.jsonl" "$d/manifest.json" $OUT/ 2>/dev/null || echo "no artifact yet (see pretrain.log; call again to resume)"
