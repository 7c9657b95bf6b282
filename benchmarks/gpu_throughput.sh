#!/usr/bin/env bash
# The H200 throughput checks in one device call (about 9 minutes cold), run from the repo root there after
# `bash benchmarks/prepare_device.sh` here; carry .whl. Everything lands in $OUT:
#   gpu_tests.log   pytest -m gpu for the firewall (device vs host decision) and decode
#   equiv.log       item 4: plain step (host firewall, torch Muon) vs fast (device firewall, StackedMuon)
#   muon.log        torch.optim.Muon vs StackedMuon, optimizer step alone
#   profile.log     torch.profiler tables of our step (device time first)
#   pretrain_h200.tsv, table_{torch,stacked}.log   the throughput rows with each Muon (ours, ours_nosync) beside
#                   the kernel and the SDPA Transformer (FLA's model row is left to its own call: ~400 s autotune)
set -uo pipefail
export WHL=${WHL:-.whl} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 300 python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_firewall.py tests/test_decode.py > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"
timeout 200 python3 benchmarks/pretrain_h200.py --presets small --check-equivalence --compile-backend none --muon stacked > "$OUT/equiv.log" 2>&1; echo "equivalence rc $?"
timeout 60 python3 benchmarks/muon_bench.py --preset small --device cuda > "$OUT/muon.log" 2>&1; tail -2 "$OUT/muon.log"
timeout 150 python3 benchmarks/pretrain_h200.py --presets small --profile --warmup 3 > "$OUT/profile.log" 2>&1; echo "profile rc $?"
for m in torch stacked; do
  timeout 160 python3 benchmarks/pretrain_h200.py --presets small --systems kda_kernel kda_layer_ours ours ours_nosync sdpa \
    --muon $m --budget-s 150 --out "$OUT/pretrain_h200.tsv" > "$OUT/table_$m.log" 2>&1; tail -9 "$OUT/table_$m.log"
done
