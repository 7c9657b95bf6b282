#!/usr/bin/env bash
# The H200 throughput checks in one device call (about 7 minutes), run from the repo root there after
# `bash benchmarks/prepare_device.sh` here; carry .whl_chain (WHL=.whl_chain; .whl adds FLA's model row,
# whose first step autotunes for ~400 s cold). Everything lands in $OUT:
#   equiv.log    item 4 (EQUIV=0 skips it): plain step (host firewall, torch Muon, eager) vs fast (device
#                firewall, StackedMuon, the model's regions compiled with inductor), loss by loss
#   table.log, pretrain_h200.tsv   small: the kernel, our layer compiled and eager, our step compiled and
#                eager, no-sync, fwd+bwd as CUDA graphs (ours_graphed) and the SDPA Transformer (SYSTEMS
#                overrides the list)
#   medium.log, medium.tsv   MEDIUM_SYSTEMS at the medium preset (unset: skipped; its chunk_kda autotune is
#                not in the committed cache, so give it MEDIUM_S seconds)
#   profile.log  torch.profiler tables of our compiled step (device time first), if PROFILE is set
#   triton_autotune.tgz   the lease's Triton autotune results (to merge into benchmarks/triton_autotune_h200.tgz)
set -uo pipefail
export WHL=${WHL:-.whl_chain} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ "${EQUIV:-1}" != 0 ]; then
  timeout 200 python3 benchmarks/pretrain_h200.py --presets small --check-equivalence --compile-backend inductor \
    > "$OUT/equiv.log" 2>&1; echo "equivalence rc $?"; grep equivalence "$OUT/equiv.log" | tail -1
fi
timeout ${TABLE_S:-330} python3 benchmarks/pretrain_h200.py --presets small --budget-s $(( ${TABLE_S:-330} - 15 )) \
  --systems ${SYSTEMS:-kda_kernel kda_layer_ours kda_layer_eager ours ours_eager sdpa ours_nosync ours_graphed} \
  --out "$OUT/pretrain_h200.tsv" > "$OUT/table.log" 2>&1; echo "table rc $?"; tail -12 "$OUT/table.log"
if [ -n "${MEDIUM_SYSTEMS:-}" ]; then
  timeout ${MEDIUM_S:-240} python3 benchmarks/pretrain_h200.py --presets medium --budget-s $(( ${MEDIUM_S:-240} - 10 )) \
    --systems $MEDIUM_SYSTEMS --out "$OUT/medium.tsv" > "$OUT/medium.log" 2>&1; echo "medium rc $?"; tail -8 "$OUT/medium.log"
fi
[ -n "${PROFILE:-}" ] && { timeout 150 python3 benchmarks/pretrain_h200.py --presets small --profile --warmup 3 \
  > "$OUT/profile.log" 2>&1; echo "profile rc $?"; }
(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar -czf "$OUT/triton_autotune.tgz" -T -)
exit 0
