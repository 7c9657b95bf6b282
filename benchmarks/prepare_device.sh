#!/usr/bin/env bash
# Run here (the dev VM, repo root, after `make env`) before the device calls of a session: every session
# starts from a fresh checkout, so nothing ignored survives. Makes
#   .whl_chain  wheels the H200 image lacks for the stages (cp312): fla-core, jsonschema + its deps, zstandard
#   .whl        the same plus flash-linear-attention (fla.models, for pretrain_h200.py's FLA row)
#   .whl_serve  what `dormouse serve` and serve_bench.py add (fastapi, uvicorn, httpx and their deps)
#   .whl_bench  serve_bench.py with its Transformer peer: .whl_chain + .whl_serve + requirements-bench.txt's wheels
#               (transformers, tokenizers; the image's own transformers is another version), about 27 MB
#   results/    the small preset's data stages (filter, shard, anchors: about 20 s)
#   .job/       the small preset's job JSONs, as gpu_small_chain.sh reads them
#   .job/qat/   small_qat's pretrain jobs (gpu_small_qat.sh --plan)
#   .job/qat_chain/  the small chain through ternary (#28's task half; its bench reads the plain chain's export)
# and adds the three ignored paths to .git/info/exclude. Then, e.g. (device tool, carry as listed there):
#   STAGES=pretrain WEIGHTS_BACK=pretrain WHL=.whl_chain bash benchmarks/gpu_small_chain.sh
set -euo pipefail
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree: ask git where its exclude lives
mkdir -p "$(dirname "$exclude")"
for p in /.whl/ /.whl_chain/ /.whl_rl/ /.whl_serve/ /.whl_bench/ /.job/ /.cache_h200/; do grep -qxF "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$@"; }
get .whl_chain fla-core==0.6.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 zstandard==0.25.0
mkdir -p .whl && cp .whl_chain/*.whl .whl/
# .whl_rl: .whl_chain without zstandard (5.5 MB; rl reads no zstd part): rl from an sft carried as
# results/store/sft/<digest> (36.5 MB, brought back by gpu_small_chain.sh's WEIGHTS_BACK) fits 64 MiB with the shard
mkdir -p .whl_rl && cp .whl_chain/*.whl .whl_rl/ && rm -f .whl_rl/zstandard-*.whl
get .whl flash-linear-attention==0.6.0
get .whl_serve fastapi==0.165.0 uvicorn==0.55.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 anyio==4.16.0 sniffio==1.3.1 h11==0.16.0 \
  click==8.5.1 httpx==0.29.0 httpcore==1.0.9 httpcore2==2.16.2 certifi==2026.10.19.post1 idna==3.20 opentelemetry-api==1.45.3 \
  typing-extensions==4.16.0
mkdir -p .whl_bench && cp .whl_chain/*.whl .whl_serve/*.whl .whl_bench/
get .whl_bench -r requirements-bench.txt  # the pins the peer was tested with (serve_bench.py, tests/test_serve_bench.py)
PATH=$PWD/.venv/bin:$PATH snakemake --cores 2 --quiet rules -- results/small/anchors.json
mkdir -p .job
for s in pretrain sft rl export bench; do .venv/bin/python -m dormouse.cli plan --preset small --stage $s > .job/small_$s.json; done
# what a small-chain call carries beside its wheels and .job (never all of results/store/shard: a scale shard is 600 MB)
carry=$(.venv/bin/python - <<'PY'
import json
inputs = json.load(open(".job/small_bench.json"))["inputs"]
print(" ".join(f"results/store/{s}/{inputs[s]['digest']}" for s in ("shard", "anchors")))
PY
)
du -sh .whl_chain .whl .whl_serve .whl_bench .job $carry | cat
echo "carry for the small chain (gpu_small_chain.sh, gpu_rl_acceptance.sh, gpu_small_qat.sh): .job $carry"
# issue #40's acceptance (benchmarks/gpu_rl_acceptance.sh, its default ARMS): three seeds of the default recipe
# (rl_s<seed>) and the null arm (null_s0: rl.shuffle_rewards, each group's rewards permuted), all from the one small sft
# model; the published small-scale recipe of #23 (rlx_s<seed>: Dr. GRPO advantage, token-level loss, prompts by
# measured pass rate, no KL, 16 samples a prompt as nanochat) stays planned for ARMS="rlx_s0 rlx_s1". Each dir holds
# small_{rl,export,bench}.json, after `STAGES="pretrain sft" bash benchmarks/gpu_small_chain.sh`.
# gen_s<seed> (ARMS="gen_s0 gen_s1 gen_s2 null_s0"): session 22's arms (records/2026-12-05-rl-gen-h100) before small's
# default took their idea further (skip_cells: every cell rl cannot move, pass_rate prompts, 32 prompts a step, no
# plateau stop): rl_s<seed> and null_s0 now run that default.
for arm in rl_s0 rl_s1 rl_s2 null_s0 rlx_s0 rlx_s1 gen_s0 gen_s1 gen_s2; do
  s=${arm#*_s}
  case ${arm%_s*} in
    rl) set_=rl.seed=$s ;;
    null) set_=rl.seed=$s,rl.shuffle_rewards=true ;;
    rlx) set_="rl.seed=$s,rl.advantage=mean,rl.loss_norm=token,rl.prompts=pass_rate,rl.kl_coef=0,rl.group_size=16" ;;
    gen) set_="rl.seed=$s,rl.prompts=pass_rate,rl.skip_cells=[add@1, sub@1, mul@1, sort@2, reverse@2]" ;;
  esac
  mkdir -p .job/$arm
  for st in rl export bench; do .venv/bin/python -m dormouse.cli plan --preset small --stage $st --set "$set_" > .job/$arm/small_$st.json; done
done
# issue #28's experiment (benchmarks/gpu_small_qat.sh): its pretrain jobs under .job/qat (runs carried back from an
# earlier session stay in .job/qat/runs)
bash benchmarks/gpu_small_qat.sh --plan > /dev/null
# issue #28's task half: the small chain trained through ternary (pretrain finish, sft, rl), for
# `JOBDIR=.job/qat_chain bash benchmarks/gpu_small_chain.sh`; its bench also reads the plain chain's export (the PTQ twin)
mkdir -p .job/qat_chain
for st in pretrain sft rl export bench; do
  .venv/bin/python -m dormouse.cli plan --preset small --stage $st \
    --set 'train.qat={rung: ternary, fraction: 0.2},sft.qat=ternary,rl.qat=ternary' > .job/qat_chain/small_$st.json
done
