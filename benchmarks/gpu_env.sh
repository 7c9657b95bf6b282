# Sourced by the gpu_*.sh scripts on the device machine: wheels into /tmp/site ($WHL, default .whl), then
# Triton's saved autotune results from .cache_h200/ (a fresh lease otherwise spends 150-400 s autotuning).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl ||
  return 1 2>/dev/null || exit 1  # sourced: the caller decides; run: stop
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton}
export DORMOUSE_COMPILE_CACHE=${DORMOUSE_COMPILE_CACHE:-$PWD/.compile_cache}  # the stages' inductor artifacts (docs/running.md)
mkdir -p "$TRITON_CACHE_DIR"
# .cache_h200/ holds the latest lease's (ignored); benchmarks/triton_autotune_h200.tgz is the committed copy
# (217 results: the small and medium presets' chunk_kda with and without the activations inside, FLA's
# KDAForCausalLM at small and medium, the layer variants of benchmarks/kda_layer_h200.py at small and medium, the fp32
# GPU tests of test_kda.py, dormouse.model.conv_triton at medium; H200 + triton 3.6 + fla-core 0.6.0, 2026-12-04), so a fresh
# checkout starts warm too. Results for other shapes or versions are simply not hit. triton_autotune_tiny.tgz: the tiny
# preset's, from benchmarks/gpu_check.sh's run (its $OUT/triton_autotune.tgz).
for t in benchmarks/triton_autotune_*.tgz .cache_h200/triton_autotune.tgz; do
  if [ -f "$t" ]; then tar -xzf "$t" -C "$TRITON_CACHE_DIR" || echo "gpu_env: $t did not unpack (autotune starts cold)" >&2; fi
done
true  # sourced: a missing autotune file is no failure
