#!/usr/bin/env bash
# The H200 throughput checks in one device call (about 7 minutes), run from the repo root there after
# `bash benchmarks/prepare_device.sh` here; carry .whl_chain (WHL=.whl_chain; .whl adds FLA's model row,
# whose first step autotunes for ~400 s cold). Everything lands in $OUT:
#   gpu_tests.log   with TESTS=1: the GPU tests (pytest -m gpu) of CUDA graphs, the KDA dispatcher and the firewall
#   equiv.log    item 4 (EQUIV=0 skips it): plain step (host firewall, torch Muon, eager) vs fast (device
#                firewall, StackedMuon, the model's regions compiled with inductor) vs graphed (fast, replayed
#                from CUDA graphs as train.cuda_graphs: cuda runs it), loss by loss and counter by counter
#   table.log, pretrain_h200.tsv   small: the kernel and our layer (host-paced and as CUDA graphs: the GPU
#                time alone), our layer with its gates and norms inside chunk_kda (graphed), our step compiled
#                and as CUDA graphs, and the SDPA Transformer (SYSTEMS overrides the list)
#   medium.log, medium.tsv   MEDIUM_SYSTEMS at the medium preset (unset: skipped; its chunk_kda autotune is
#                not in the committed cache, so give it MEDIUM_S seconds)
#   profile.log  torch.profiler tables of our compiled step (device time first) at PROFILE's preset (e.g. medium)
#   triton_autotune.tgz   the lease's Triton autotune results (to merge into benchmarks/triton_autotune_h200.tgz)
set -uo pipefail
export WHL=${WHL:-.whl_chain} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graphs.py tests/test_kda.py \
    tests/test_firewall.py > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"; tail -3 "$OUT/gpu_tests.log"
fi
if [ "${EQUIV:-1}" != 0 ]; then
  timeout 200 python3 benchmarks/pretrain_h200.py --presets small --check-equivalence --compile-backend inductor \
    > "$OUT/equiv.log" 2>&1; echo "equivalence rc $?"; grep equivalence "$OUT/equiv.log" | tail -1
fi
timeout ${TABLE_S:-330} python3 benchmarks/pretrain_h200.py --presets small --budget-s $(( ${TABLE_S:-330} - 15 )) \
  --systems ${SYSTEMS:-kda_kernel kda_layer_ours kda_kernel_graphed kda_layer_graphed kda_layer_fused_graphed ours sdpa ours_graphed} \
  --out "$OUT/pretrain_h200.tsv" > "$OUT/table.log" 2>&1; echo "table rc $?"; tail -12 "$OUT/table.log"
if [ -n "${MEDIUM_SYSTEMS:-}" ]; then
  timeout ${MEDIUM_S:-240} python3 benchmarks/pretrain_h200.py --presets medium --budget-s $(( ${MEDIUM_S:-240} - 10 )) \
    --systems $MEDIUM_SYSTEMS --out "$OUT/medium.tsv" > "$OUT/medium.log" 2>&1; echo "medium rc $?"; tail -8 "$OUT/medium.log"
fi
[ -n "${PROFILE:-}" ] && { timeout 150 python3 benchmarks/pretrain_h200.py --presets "$PROFILE" --profile --warmup 3 \
  > "$OUT/profile.log" 2>&1; echo "profile rc $?"; }
(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar -czf "$OUT/triton_autotune.tgz" -T -)
exit 0
