#!/usr/bin/env bash
# The GPU check: the first command of every stretch of GPU work. On a bare GPU machine (the device tool's image:
# python3 3.12 with torch 2.11 and triton 3.6; no fla, Snakemake, fastText or lm-eval), from the repository root,
# it runs every CUDA path of the project within 10 minutes, set-up included, and prints one verdict line a part,
# then `GPU CHECK PASS` or `GPU CHECK FAIL` and its wall time.
#
# Beside the checkout it needs .gpucheck/, made here (the dev VM, after `make env`) by
#     .venv/bin/python -m benchmarks.prepare_gpu_check
# (~55 MiB: the wheels of what the image lacks, for cp312; the tiny preset's data stages, so the GPU never runs the
# CPU-only filter). Device call: carry [".gpucheck"], command `bash benchmarks/gpu_check.sh`.
#
# Parts (each one verdict line):
#   setup    the wheels into /tmp/site, every package the parts import, the GPU seen; tiny's data unpacked
#   tests    every test marked gpu (pytest -m gpu), run beside the chain
#   chain    `snakemake results/tiny@<tag>/bench.json --config set=train.device=cuda,...` through Snakemake itself,
#            pretrain to bench on CUDA (compiled regions and CUDA graphs on); the manifests must show the GPU paths
#   decode   the rl model's step-by-step greedy decode (FLA's recurrent kernel, conv caches) gives the bytes its
#            parallel forward (FLA's chunk kernel) predicts, fp32, on tiny's held-out prompts
#   serve    `dormouse serve` on CUDA answers one streamed chat completion from the official openai client
#   lm-eval  `dormouse lm-eval` on the CUDA chain's export (rung int8) over the local tiny task
# Logs in $OUT (default gpu_check_out/; at most 8 files): gpu_check.log, tests.log, chain.log, serve.log,
# lm_eval.log, artifacts.tar (the chain's manifests, metrics and bench.json), triton_autotune.tgz (Triton's autotune
# results of this run: commit as benchmarks/triton_autotune_tiny.tgz so the next machine starts warm).
# BUDGET_S (default 580) bounds the whole; a part with no time left is a FAIL saying so. `--digest` prints only the
# code digest the first line names (to match a device run to a checkout).
set -uo pipefail
cd "$(dirname "$0")/.."
code_digest() {  # the code's own digest: a device copy of the tree may carry an older .git, whose HEAD names another commit
  find Snakefile dormouse benchmarks tests workflow config -type f \( -name '*.py' -o -name '*.smk' -o -name '*.yaml' \
    -o -name '*.sh' -o -name Snakefile \) | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12
}
if [ "${1:-}" = "--digest" ]; then code_digest; exit 0; fi
T0=$(date +%s)
DEADLINE=$(( T0 + ${BUDGET_S:-580} ))
OUT=${OUT:-$PWD/gpu_check_out}
G=${GPUCHECK:-.gpucheck}
# rl's corpus replay on too (small's default recipe uses it; tiny's leaves it off): its CUDA path runs here
SET="train.device=cuda,train.compile=cuda,train.cuda_graphs=cuda,rl.replay_rows=4,rl.replay_seq_len=64"
mkdir -p "$OUT"
rm -f "$OUT/tests.log" "$OUT/artifacts.tar" "$OUT/triton_autotune.tgz"  # appended below: a rerun into one $OUT starts clean
VERDICTS=()

record() {  # record PART VERDICT-LINE: the line a part printed (or one made here), kept for the summary
  VERDICTS+=("$2")
  echo "$2"
}
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() {  # cap N: N seconds or what is left before the deadline less 20 s for the summary, whichever is less
  local l=$(( $(left) - 20 )); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
runpart() {  # runpart PART MAX_S CMD...: the command's last "PART: ..." line, or a FAIL naming why
  local part=$1 max=$2; shift 2
  local t; t=$(cap "$max")
  if [ "$t" -lt 15 ]; then record "$part" "$part: FAIL not run: no time left in the budget"; return; fi
  local out rc; out=$(timeout "$t" "$@" 2>&1); rc=$?
  local line; line=$(printf '%s\n' "$out" | grep -E "^$part: (PASS|FAIL)" | tail -1)
  if [ -z "$line" ]; then
    printf '%s\n' "$out" | tail -15
    line="$part: FAIL exit $rc$([ $rc = 124 ] && echo " (timed out after ${t}s)")"
  fi
  record "$part" "$line"
}

main() {
  echo "gpu_check: code digest $(code_digest) (\`bash benchmarks/gpu_check.sh --digest\` on a checkout gives its own)," \
    ".git HEAD $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ)"
  # ---- setup
  if [ ! -d "$G/whl" ] || [ ! -f "$G/data.tgz" ]; then
    record setup "setup: FAIL no $G/whl or $G/data.tgz: run .venv/bin/python -m benchmarks.prepare_gpu_check here and carry .gpucheck"
    return
  fi
  WHL=$G/whl source benchmarks/gpu_env.sh || { record setup "setup: FAIL the wheels did not install (pip above)"; return; }
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false  # nothing can be fetched there
  mkdir -p /tmp/site/bin
  printf '#!/bin/sh\nexec python3 -m dormouse.cli "$@"\n' > /tmp/site/bin/dormouse  # the rules call `dormouse`
  chmod +x /tmp/site/bin/dormouse
  export PATH=/tmp/site/bin:$PATH
  tar -xzf "$G/data.tgz" || { record setup "setup: FAIL $G/data.tgz did not unpack"; return; }
  local seen
  seen=$(python3 - <<'PY' 2>&1
import importlib, torch
mods = ["fla.ops.kda", "snakemake", "lm_eval", "fastapi", "uvicorn", "openai", "jsonschema", "zstandard", "dormouse.cli"]
missing = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:  # every import a part needs, named with its error
        missing.append(f"{m} ({type(e).__name__}: {e})")
if not torch.cuda.is_available():
    missing.append("no CUDA device visible to torch")
if missing:
    print("setup: FAIL " + "; ".join(missing))
else:
    import fla, snakemake, triton
    print(f"setup: PASS {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
          f"fla-core {fla.__version__}, snakemake {snakemake.__version__}")
PY
)
  local line; line=$(printf '%s\n' "$seen" | grep -E '^setup: ' | tail -1)
  [ -n "$line" ] || { printf '%s\n' "$seen" | tail -8; line="setup: FAIL the import check crashed (above)"; }
  record setup "$line"
  [[ "$line" == "setup: PASS"* ]] || return

  # ---- tests, beside the chain (one GPU, two processes: correctness, not timing)
  local files; files=$(grep -l "mark.gpu" tests/test_*.py | tr '\n' ' ')
  # groups side by side (mostly compiling, so CPU-bound on 16 cores): test_cuda_graphs apart, so that its tracebacks
  # come back even when the rest runs out of time, and the other files dealt round-robin into TEST_GROUPS groups (run 6:
  # one group of them took 285 s against test_cuda_graphs' 84 s); their logs are joined into tests.log in this order
  rm -f /tmp/gpu_check_tests.rc /tmp/gpu_check_tests.*.log
  local groups=(tests/test_cuda_graphs.py) rest k=0 f
  rest=$(( ${TEST_GROUPS:-3} > 0 ? ${TEST_GROUPS:-3} : 1 ))
  for f in $(tr ' ' '\n' <<< "$files" | grep -v test_cuda_graphs); do
    groups[$(( 1 + k % rest ))]+=" $f"; k=$(( k + 1 ))
  done
  (t_end=$(( $(date +%s) + $(cap 420) ))
   i=0 pids=()
   for group in "${groups[@]}"; do
     i=$((i + 1))
     t=$(( t_end - $(date +%s) ))
     (if [ "$t" -lt 15 ]; then echo "not run: no time left for $group"; exit 124; fi
      timeout --kill-after=20 "$t" python3 -m pytest -v -m gpu -p no:cacheprovider --timeout 240 --tb=short -rfEs --durations=8 $group) \
       > /tmp/gpu_check_tests.$i.log 2>&1 &
     pids+=($!)
   done
   for pid in "${pids[@]}"; do wait "$pid"; echo $? >> /tmp/gpu_check_tests.rc; done
   cat /tmp/gpu_check_tests.*.log >> "$OUT/tests.log") &
  local tests_pid=$!

  # ---- chain: built afresh (a warm machine or a rerun keeps results/: the digests do not cover code, so Snakemake
  # would find the last run's artifacts up to date and the parts below would test them)
  for s in pretrain sft rl export bench; do
    d=$(python3 -m benchmarks.gpu_check path --set "$SET" --stage $s)
    rm -rf "$d" "results/scratch/$s/$(basename "$d")"
  done
  runpart chain 430 bash -c '
    python3 -m snakemake --nolock --cores 16 --resources gpu=1 --config "set=$1" -- \
      "$(python3 -m benchmarks.gpu_check view --set "$1")/bench.json" > "$2/chain.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
      for f in $(ls -t results/logs/*/*.log 2>/dev/null | head -1); do echo "== $f"; tail -40 "$f"; done >> "$2/chain.log"
      tail -20 "$2/chain.log"; echo "chain: FAIL snakemake exit $rc (chain.log)"; exit 1
    fi
    python3 -m benchmarks.gpu_check chain --set "$1"' _ "$SET" "$OUT"
  local rl exp
  rl=$(python3 -m benchmarks.gpu_check path --set "$SET" --stage rl)
  exp=$(python3 -m benchmarks.gpu_check path --set "$SET" --stage export)
  for s in pretrain sft rl export bench; do
    d=$(python3 -m benchmarks.gpu_check path --set "$SET" --stage $s)
    [ -f "$d/manifest.json" ] && tar -rf "$OUT/artifacts.tar" -C "$d/.." \
      $(cd "$d" && ls manifest.json metrics.jsonl bench.json 2>/dev/null | sed "s|^|$(basename "$d")/|")
  done

  # ---- decode, serve, lm-eval on the chain's CUDA artifacts
  if [ -f "$rl/manifest.json" ]; then
    runpart decode 150 python3 -m benchmarks.gpu_check decode --model "$rl"
    dormouse serve --model "$rl" --device cuda --port 8765 > "$OUT/serve.log" 2>&1 &
    local serve_pid=$!
    runpart serve 150 bash -c '
      for i in $(seq 120); do
        python3 -c "import httpx; httpx.get(\"http://127.0.0.1:8765/health\", timeout=2).raise_for_status()" 2>/dev/null && break
        kill -0 $1 2>/dev/null || { tail -5 "$2/serve.log"; echo "serve: FAIL the server exited (serve.log)"; exit 1; }
        sleep 1
      done
      python3 -m benchmarks.gpu_check serve --port 8765 --device cuda' _ "$serve_pid" "$OUT"
    kill "$serve_pid" 2>/dev/null; wait "$serve_pid" 2>/dev/null
  else
    record decode "decode: FAIL no rl model (the chain did not build it)"
    record serve "serve: FAIL no rl model (the chain did not build it)"
  fi
  if [ -f "$exp/manifest.json" ]; then
    runpart lm-eval 180 bash -c '
      tasks=$(dirname "$(python3 -m benchmarks.gpu_check lm-eval-task /tmp/gpu_check_lmeval)")
      rm -rf /tmp/gpu_check_lmeval_out
      dormouse lm-eval --model dormouse --model_args "pretrained=$1,rung=int8" --tasks dormouse_tiny \
        --include_path "$tasks" --device cuda --output_path /tmp/gpu_check_lmeval_out > "$2/lm_eval.log" 2>&1
      rc=$?
      [ $rc -eq 0 ] || { tail -15 "$2/lm_eval.log"; echo "lm-eval: FAIL exit $rc (lm_eval.log)"; exit 1; }
      python3 -m benchmarks.gpu_check lm-eval-result /tmp/gpu_check_lmeval_out --log "$2/lm_eval.log"' _ "$exp" "$OUT"
  else
    record lm-eval "lm-eval: FAIL no export artifact (the chain did not build it)"
  fi

  # ---- the tests' verdict
  wait "$tests_pid"
  local trc; trc=$(tr '\n' ' ' < /tmp/gpu_check_tests.rc 2>/dev/null || echo '?')
  local summary; summary=$(grep -E "^=+ .*(passed|failed|error).* in " "$OUT/tests.log" | sed 's/=//g' | tr '\n' ';')
  if [ "$(grep -c '^0$' /tmp/gpu_check_tests.rc 2>/dev/null)" = "${#groups[@]}" ] && grep -q passed <<< "$summary" && ! grep -qE "failed|error" <<< "$summary"; then
    record tests "tests: PASS pytest -m gpu over $(wc -w <<< "$files") files: $summary"
  else
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
    record tests "tests: FAIL pytest exit $trc: $summary (tests.log)"
  fi
}

main 2>&1 | tee "$OUT/gpu_check.log"
# the verdicts live in the subshell of the pipe: read them back from the log
mapfile -t lines < <(grep -E "^(setup|tests|chain|decode|serve|lm-eval): (PASS|FAIL)" "$OUT/gpu_check.log")
if [ -n "${TRITON_CACHE_DIR:-}" ] || [ -d .triton ]; then
  (cd "${TRITON_CACHE_DIR:-.triton}" && find . -name "*.autotune.json" | tar -czf "$OUT/triton_autotune.tgz" -T -) 2>/dev/null
fi
fails=0
for p in setup tests chain decode serve lm-eval; do  # a part's last verdict line counts, as the summary shows it
  printf '%s\n' "${lines[@]}" | grep "^$p: " | tail -1 | grep -q "^$p: PASS" || fails=$((fails + 1))
done
{
  echo "---- verdicts"
  for p in setup tests chain decode serve lm-eval; do
    printf '%s\n' "${lines[@]}" | grep "^$p: " | tail -1 | grep . || echo "$p: FAIL not run"
  done
  echo "wall time: $(( $(date +%s) - T0 )) s (setup included)"
  [ "$fails" = 0 ] && echo "GPU CHECK PASS" || echo "GPU CHECK FAIL ($fails of 6 parts)"
} | tee -a "$OUT/gpu_check.log"
[ "$fails" = 0 ]
