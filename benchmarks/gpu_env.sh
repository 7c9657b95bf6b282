# Sourced by the gpu_*.sh scripts on the device machine: wheels into /tmp/site ($WHL, default .whl), then
# Triton's saved autotune results from .cache_h200/ (a fresh lease otherwise spends 150-400 s autotuning).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .cache_h200/triton_autotune.tgz ] && tar -xzf .cache_h200/triton_autotune.tgz -C "$TRITON_CACHE_DIR"
