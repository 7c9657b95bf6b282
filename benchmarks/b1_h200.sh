#!/usr/bin/env bash
# Issue #31 on one H200, in one device call (~9 min): where b1's first steps go with a cold Triton cache and
# with only the autotune results of that run, then the MoE's expert paths side by side. Run from the repo root
# after benchmarks/prepare_device.sh made .whl_chain (carry it):
#   bash benchmarks/b1_h200.sh      # writes $OUT/b1_h200.log, first_cold.jsonl, first_warm.jsonl, moe_h200.tsv,
#                                   # autotune_b1.tgz (merge into benchmarks/triton_autotune_h200.tgz)
set -uo pipefail
OUT=${OUT:-/tmp/b1_out}; mkdir -p "$OUT"
WHL=.whl_chain source benchmarks/gpu_env.sh >/dev/null
log=$OUT/b1_h200.log
python3 -c "import torch, triton, fla; print('versions torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$log"
# 1. cold: no Triton cache, no inductor cache (a fresh machine)
export TRITON_CACHE_DIR=/tmp/tc_cold TORCHINDUCTOR_CACHE_DIR=/tmp/ind_cold
mkdir -p $TRITON_CACHE_DIR
TORCH_LOGS=recompiles timeout ${COLD_S:-330} python3 -m benchmarks.first_steps --preset b1 --steps 4 --stack-every 0 \
  --out "$OUT/first_cold.jsonl" 2>&1 | grep -v "Warning\|warn(" | tee -a "$log"
(cd $TRITON_CACHE_DIR && find . -name "*.autotune.json" | tar -czf "$OUT/autotune_b1.tgz" -T -)
# 2. warm: a fresh machine with the committed autotune results only (this run's, unpacked into an empty cache)
export TRITON_CACHE_DIR=/tmp/tc_warm TORCHINDUCTOR_CACHE_DIR=/tmp/ind_warm
mkdir -p $TRITON_CACHE_DIR && tar -xzf "$OUT/autotune_b1.tgz" -C $TRITON_CACHE_DIR
timeout ${WARM_S:-150} python3 -m benchmarks.first_steps --preset b1 --steps 4 --stack-every 0 \
  --out "$OUT/first_warm.jsonl" 2>&1 | grep -v "Warning\|warn(" | tee -a "$log"
# 3. the expert paths at b1's layer shape
timeout ${MOE_S:-100} python3 -m benchmarks.moe_h200 --preset b1 --out "$OUT/moe_h200.tsv" 2>&1 | grep -v "Warning\|warn(" | tail -8 | tee -a "$log"
ls -la "$OUT"
