#!/usr/bin/env bash
# The H200 throughput checks in one device call, run from the repo root there after
# `bash benchmarks/prepare_device.sh` here; carry .whl_chain (WHL=.whl_chain; .whl adds FLA's model row,
# whose first step autotunes for ~400 s cold). Every step gets min(its own limit, what is left of TOTAL_S,
# default 560 s, so a 600 s device command ends with the outputs in place). Everything lands in $OUT:
#   gpu_tests.log   with TESTS=1: the GPU tests (pytest -m gpu) of CUDA graphs, the firewall, decoding, the quality
#                race, the conv kernels, StackedMuon's inductor graphs and the KDA dispatcher (TESTS_S, default
#                330 s: in run 6 the graph and firewall tests took 96 s and test_kda 175 s, its fp32 kernels
#                autotuning cold on a fresh lease, so it runs last; the files added since were not timed together)
#   equiv.log    item 4 (EQUIV=0 skips it): plain step (host firewall, torch Muon, eager) vs fast (device
#                firewall, StackedMuon, the model's regions compiled with inductor) vs graphed (fast, replayed
#                from CUDA graphs as train.cuda_graphs: cuda runs it), loss by loss and counter by counter
#   table.log, pretrain_h200.tsv   small: the kernel and our layer, our step compiled and as CUDA graphs, the
#                SDPA Transformer, then the kernel and our layer as CUDA graphs (the GPU time alone) and our
#                layer with its gates and norms in our compiled region (SYSTEMS overrides the list; TABLE_S its limit)
#   medium.log, medium.tsv   MEDIUM_SYSTEMS at the medium preset (unset: skipped; MEDIUM_S its limit)
#   profile.log  torch.profiler tables of our compiled step (device time first) at the preset PROFILE names
#   triton_autotune.tgz   the lease's Triton autotune results (to merge into benchmarks/triton_autotune_h200.tgz),
#                written on exit whatever happened before
set -uo pipefail
export WHL=${WHL:-.whl_chain} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
END=$(( SECONDS + ${TOTAL_S:-560} ))
trap '(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar -czf "$OUT/triton_autotune.tgz" -T -)' EXIT
limit() {  # seconds a step may take: its own limit or what is left, at least 1 (`timeout 0` would mean none)
  local left=$(( END - SECONDS )); (( left < 1 )) && left=1; echo $(( $1 < left ? $1 : left )); }
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  timeout "$(limit "${TESTS_S:-330}")" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graphs.py tests/test_firewall.py \
    tests/test_decode.py tests/test_quality_bench.py tests/test_conv_triton.py tests/test_optim.py tests/test_kda.py > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"; tail -3 "$OUT/gpu_tests.log"
fi
if [ "${EQUIV:-1}" != 0 ]; then
  timeout "$(limit 200)" python3 -m benchmarks.pretrain_h200 --presets small --check-equivalence --compile-backend inductor \
    > "$OUT/equiv.log" 2>&1; echo "equivalence rc $?"; grep equivalence "$OUT/equiv.log" | tail -1
fi
t=$(limit "${TABLE_S:-330}")
if [ "$t" -gt 30 ]; then
  timeout "$t" python3 -m benchmarks.pretrain_h200 --presets small --budget-s $(( t - 15 )) \
    --systems ${SYSTEMS:-kda_kernel kda_layer_ours ours sdpa ours_graphed kda_kernel_graphed kda_layer_graphed kda_layer_torch_gates_graphed} \
    --out "$OUT/pretrain_h200.tsv" > "$OUT/table.log" 2>&1; echo "table rc $?"; tail -12 "$OUT/table.log"
else echo "table: no time left"; fi
if [ -n "${MEDIUM_SYSTEMS:-}" ]; then
  t=$(limit "${MEDIUM_S:-240}")
  if [ "$t" -gt 30 ]; then
    timeout "$t" python3 -m benchmarks.pretrain_h200 --presets medium --budget-s $(( t - 10 )) \
      --systems $MEDIUM_SYSTEMS --out "$OUT/medium.tsv" > "$OUT/medium.log" 2>&1; echo "medium rc $?"; tail -8 "$OUT/medium.log"
  else echo "medium: no time left"; fi
fi
if [ -n "${PROFILE:-}" ]; then
  timeout "$(limit 150)" python3 -m benchmarks.pretrain_h200 --presets "$PROFILE" --profile --warmup 3 \
    > "$OUT/profile.log" 2>&1; echo "profile rc $?"
fi
exit 0
