#!/usr/bin/env bash
# Issue #41 item 1: b1's whole chain (filter .. bench) through Snakemake itself on one GPU machine, reading the
# scale corpus's slice, in calls of at most 10 minutes on one warm machine: the same command again continues
# (Snakemake skips what is built; a cut pretrain resumes from its last checkpoint, train.ckpt_every). After
#   .venv/bin/python -m benchmarks.prepare_b1_chain        (here: wheels, fasttext's sdist; the slice from make scale-slice)
# a device call, carry [".b1chain", "corpus/scale_slice"]:
#   CALL_S=540 bash benchmarks/gpu_b1_chain.sh
# SET: the run's budget, the user's own `--config set=...` (default below: ~25 GPU minutes on one H100/H200).
# Back in $OUT: snakemake.log (this call), b1_chain.tar (every built manifest, metrics.jsonl, stage log, the views),
# headline.txt once bench.json exists.
set -uo pipefail
SET=${SET:-train.steps=2000,train.max_epochs=1,train.eval_every=500,train.eval_bytes=2000000,train.ckpt_every=250,data.shard.eval_tail_bytes=2000000,sft.steps=150,rl.steps=30}
VIEW=${VIEW:-results/b1@slice}
OUT=${OUT:-/tmp/b1_out}; mkdir -p "$OUT"
deadline=$(( $(date +%s) + ${CALL_S:-540} ))  # snakemake gets 30 s more to stop its jobs, then the tar
export WHL=.b1chain/whl
source "$(dirname "$0")/gpu_env.sh" || { echo "gpu_b1_chain: the wheels did not install"; exit 1; }
if ! python3 -c "import fasttext" 2>/dev/null; then  # no cp312 wheel on PyPI: its sdist against the image's pybind11
  t=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    .b1chain/sdist/fasttext-0.9.3.tar.gz || { echo "gpu_b1_chain: fasttext did not build"; exit 1; }
  echo "fasttext built in $(( $(date +%s) - t )) s"
fi
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -m dormouse.cli "$@"\n' > /tmp/bin/dormouse && chmod +x /tmp/bin/dormouse
export PATH=/tmp/bin:/tmp/site/bin:$PATH
# the filter's digest covers each corpus file's size and mtime: a fixed mtime keeps the digests, and with them the
# built stages and pretrain's checkpoints, from one call to the next however the carry sets file times
touch -d @1764892800 corpus/scale_slice/data/*.jsonl.zst
smk=(snakemake --cores "$(nproc)" --resources gpu=1 --rerun-incomplete --config corpus=corpus/scale_slice/data "set=$SET")
"${smk[@]}" --unlock -- "$VIEW/bench.json" > /dev/null 2>&1  # a lock left by the last call's kill
left=$(( deadline - $(date +%s) ))
[ "$left" -gt 60 ] || { echo "b1 chain: ${left}s left after the set-up: call again"; exit 0; }
echo "snakemake $VIEW/bench.json (at most ${left}s) with set=$SET"
timeout --signal=INT --kill-after=30 "$left" "${smk[@]}" -- "$VIEW/bench.json" > "$OUT/snakemake.log" 2>&1
rc=$?
grep -E "^(Finished job|rule |Error|\[.*\] (start|end|step:|selected))" "$OUT/snakemake.log" | tail -30
case $rc in
  0) echo "b1 chain: complete"; dormouse headline "$VIEW/bench.json" > "$OUT/headline.txt" 2>&1; cat "$OUT/headline.txt" ;;
  124|130|137) echo "b1 chain: this call's time ran out: call again on the warm machine" ;;
  *) echo "b1 chain: snakemake exit $rc (snakemake.log)"; tail -20 "$OUT/snakemake.log" ;;
esac
# what was built (manifests, metrics, logs, views): the weights stay on the machine
find results/store -name manifest.json -o -name metrics.jsonl -o -name bench.json -o -name anchors.json \
  | tar -cf "$OUT/b1_chain.tar" -T - results/logs "$VIEW" 2>/dev/null
exit 0
