#!/usr/bin/env bash
# Issue #56's acceptance on one lease (device tool): pretrain and sft (gpu_small_chain.sh), then the rl arms side by
# side through rl, export and bench (gpu_rl_acceptance.sh), as one detached driver (setsid), so that no 10-minute
# call boundary cuts a stage (rl does not resume); each call only waits on it and brings back what exists.
#   here first: make env && bash benchmarks/prepare_device.sh
#   call 1 (carry .whl_chain .job and the shard and anchors artifacts prepare_device.sh names):
#     bash benchmarks/gpu_rl_chain.sh start
#   calls 2.. (back to back, no carry): bash benchmarks/gpu_rl_chain.sh wait
# The driver runs from copies of itself, .job and the wheels under $STATE: a later call's tree sync removes .job and
# the wheel folders (ignored only by .git/info/exclude, which does not travel; results/ is in .gitignore and stays).
# ARMS as gpu_rl_acceptance.sh (default rl_s0 rl_s1 rl_s2 null_s0); WAIT_S bounds a call's wait (default 560 s).
# Back in $OUT: drive.log every call; partial.tgz (the stages' logs so far); once done rl_acceptance.tar (bench.json
# files, logs, the acceptance's json and dev-curve plot) and small_chain.tar (pretrain and sft manifests).
set -uo pipefail
S=${STATE:-/tmp/rl_chain}
case ${1:-} in
start)
  [ -e "$S" ] && { echo "$S exists: a driver ran on this machine (wait, or STATE=<another dir>)"; exit 2; }
  mkdir -p "$S/chain" "$S/logs"
  cp -r .job "$S/job" && cp -r "${WHL:-.whl_chain}" "$S/whl" && cp "$0" "$S/driver.sh" || exit 2
  ARMS=${ARMS:-rl_s0 rl_s1 rl_s2 null_s0} setsid nohup bash "$S/driver.sh" run > "$S/nohup.out" 2>&1 < /dev/null &
  sleep 3
  exec bash "$0" wait ;;
run)
  {
    date -u +"%FT%TZ start"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    STAGES="pretrain sft" JOBDIR="$S/job" WHL="$S/whl" BUDGET_S=1700 OUT="$S/chain" SAVE_TRITON=1 \
      bash benchmarks/gpu_small_chain.sh
    date -u +"%FT%TZ chain done"
    PYTHONPATH=/tmp/site python3 -c "import sys, torch, triton, fla; print('python', sys.version.split()[0], 'torch',
      torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
    DIAG=0 JOBS="$S/job" WHL="$S/whl" CALL_S=1700 MIN_RL_S=0 MIN_EXPORT_S=0 MIN_BENCH_S=0 OUT="$S" LOGS="$S/logs" \
      bash benchmarks/gpu_rl_acceptance.sh
    echo "gpu_rl_acceptance rc $?"
    date -u +"%FT%TZ all done"
  } > "$S/drive.log" 2>&1
  touch "$S/done" ;;
wait)
  [ -d "$S" ] || { echo "no driver on this machine ($S): the machine went back, or call start first"; exit 2; }
  while [ ! -f "$S/done" ] && [ "$SECONDS" -lt "${WAIT_S:-560}" ]; do sleep 5; done
  date -u; cat "$S/drive.log"
  for f in "$S"/chain/*.log "$S"/logs/*_*.log; do
    [ -f "$f" ] && { echo "== $f"; grep -E "^\[[a-z]+\] (start|end|selected)" "$f" | tail -2; tail -1 "$f"; }
  done
  cp "$S/drive.log" "$OUT/"
  (cd "$S" && tar -czf "$OUT/partial.tgz" chain/pretrain.log chain/sft.log logs 2>/dev/null)
  if [ -f "$S/done" ]; then cp "$S/rl_acceptance.tar" "$S/chain/art/small_chain.tar" "$OUT/"; ls -la "$OUT"; fi ;;
*)
  echo "usage: bash benchmarks/gpu_rl_chain.sh start|wait"; exit 2 ;;
esac
