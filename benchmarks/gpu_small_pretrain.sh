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
python3 -m pytest -q -p no:cacheprovider tests/test_kda.py 2>&1 | tail -5 | tee $OUT/kda_tests.txt
python3 -m dormouse.cli pretrain --job "$(cat .job/small_pretrain.json)" 2>&1 | tee $OUT/pretrain.log | grep -E "eval_bpb|params|resumed|Error|error" || true
d=$(python3 -c "import json; print(json.load(open('.job/small_pretrain.json'))['out'])")
cp "$d/metrics.jsonl" "$d/manifest.json" $OUT/ 2>/dev/null || echo "no artifact (see pretrain.log)"
