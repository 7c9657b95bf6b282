"""Pretrain step side by side on one GPU (issue #7 item 1; the CPU half of item 4).

    # on the H200 (device tool, carry .whl: fla-core, flash-linear-attention and the other wheels):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton
    timeout 580 python3 -m benchmarks.pretrain_h200 --presets small medium --budget-s 540 --out $OUT/pretrain_h200.tsv
    # here, on CPU: tiny shapes, FLA skipped (what tests/test_pretrain_h200_bench.py runs)
    .venv/bin/python -m benchmarks.pretrain_h200 --dry-run-cpu

For every preset (config/presets/<name>.yaml: model section -> ModelConfig, batch_size and seq_len from
its train section unless --batch-size / --seq-len) it measures, one after the other, on random bytes
(torch.randint 0..255, seed --seed):

  kda_kernel      raw `fla.ops.kda.chunk_kda` fwd+bwd at the mixer's shape (B, T, H, K), called exactly as
                  our dispatcher calls it (normalised q/k, activated g/beta, output_final_state=True)
  kda_layer_ours  our `KDAMixer` fwd+bwd at the same (B, T, D, H, K) under bf16 autocast, its regions
                  compiled as the pretrain stage compiles them on a GPU (dormouse.model.regions; backend
                  --compile-backend, "none" = eager). The KERNEL RATIO TARGET is kda_layer_ours ms / kda_kernel
                  ms (everything our layer adds around the kernel)
  kda_layer_eager the same layer with no compile (the baseline of the regions)
  fla_kda         (b) FLA's own `KDAForCausalLM` (fla.models; needs the flash-linear-attention wheel and
                  transformers): hidden_size=d_model, num_hidden_layers=the APPLIED blocks (cfg.depth),
                  num_heads/head_dim as ours, intermediate_size=ffn_hidden, vocab 256, conv 4, no Engram,
                  FLA's defaults otherwise (fused norm / SwiGLU / linear cross entropy); labels = inputs
                  (FLA shifts them itself)
  kda_layer_fla   FLA's `KimiDeltaAttention` layer fwd+bwd at the same shape (gate, q/k L2 norm and beta
                  sigmoid fused into its kernel) -- what our layer could be
  ours            (a) our pretrain step, the same work as one step of dormouse/train/loop.py's loop:
                  ByteLM (the preset's config, Engram included), build_optimizers (Muon for hidden
                  matrices + AdamW), set_lr (WSD), bf16 autocast, the stage's NaN firewall
                  (dormouse/train/firewall.py: on CUDA it decides on the device, no host sync; on CPU two host
                  syncs), both optimizer steps, zero_grad -- the loop at world size 1; on CUDA with the
                  model's regions compiled, as the stage does (train.compile: cuda)
  ours_eager      (a) with no compile: the stage's step before the regions
  sdpa            (c) a plain byte Transformer: RMSNorm, causal F.scaled_dot_product_attention with RoPE,
                  SwiGLU, fp32 head; same width, depth (cfg.depth) and head layout, its SwiGLU width chosen
                  so its non-embedding parameters match ours (within a few %; printed). On CUDA compiled
                  whole (torch.compile(model): no graph break), as ours is compiled (eager before 2026-12-04)
  ours_nosync     (a) without the firewall: the same step as fla_kda and sdpa get (FLA's model runs as FLA
                  ships it, eager around its own fused kernels)
  ours_graphed    (a) with the model's forward and backward replayed from CUDA graphs
                  (dormouse.train.trainer.PretrainStep, as the stage runs it under train.cuda_graphs: cuda;
                  FLA's kernels included): one replay each way instead of ~1 000 host launches; optimizers
                  and the firewall run eagerly after it. A replay adds the counts of one captured forward.
                  CUDA only; refused under DDP. Peak memory n/a on the graphed
                  rows: max_memory_allocated leaves out the graph's private pool
  kda_kernel_graphed, kda_layer_graphed   kda_kernel and kda_layer_ours, each call captured as one CUDA graph
                  and replayed: the GPU time alone, without the host's launches (on small both eager rows are
                  host-bound, so their ratio compares host costs). kda_layer_graphed's ratio is against
                  kda_kernel_graphed
  kda_layer_torch_gates_graphed   kda_layer_graphed with the q/k L2 norms, the decay gate and beta's sigmoid
                  in our compiled `gates` region instead of inside chunk_kda (the stage's layer until run 6):
                  what leaving them to FLA's kernel saves on the GPU. Its note gives the output's largest
                  difference from our layer's with the same weights

Every training system uses the same optimizer split (Muon for the 2-D weights of nn.Linear layers inside
blocks, AdamW for embeddings, head, norms, biases, convs and 1-D parameters: `build_optimizers` itself,
through a `param_groups()` given to the peer models), bf16 autocast, fp32 master weights,
clip_grad_norm_(grad_clip). fla_kda, sdpa, ours_nosync and (on CUDA) ours do no host sync inside a step.

Timing. Triton autotunes (and compiles) every kernel on its first call at each shape: each system first
runs --warmup steps (default 10; kernel rows: --kernel-warmup calls) outside the timed region -- their
wall time, and the first step's alone, are recorded as warmup_s / note (a cold FLA autotune took ~190 s
per preset on the H200). Then the CUDA caching allocator's peak is reset, --steps steps (default 30) run
with a CUDA event pair around each, and the whole timed region is bracketed by synchronize +
perf_counter: ms_step = wall / steps, tokens_per_s = B*T*steps / wall, ms_step_median = median of the
per-step events, peak_gib = torch.cuda.max_memory_allocated over the timed steps (steady state: params,
grads, optimizer state, activations; the autotuner's scratch is left out).

FLOPs per token (fwd + bwd, "model FLOPs": no recompute counted):
  matmuls     6 * flop_params. ours: count_params(cfg)["flop_params"] (every nn.Linear weight one token
              multiplies: head, KDA projections, SwiGLU, Engram key/value projections); the peers: the
              numel of their nn.Linear weights (lm_head / head included, embeddings not)
  KDA state   per layer, per head, chunk C = 64 (FLA's), K = V = head_dim, in multiply-adds per token:
              A_kk and A_qk inside the chunk 2CK, the (I + A)^-1 solve C^2/3, w = A(k*decay) CK,
              u = A v CV, v_new = u - w S KV, o = (q*decay) S KV + A_qk v_new CV, S += k^T v_new KV
              -> 3KV + 3CK + 2CV + C^2/3 MACs forward; x2 FLOPs per MAC, x3 for fwd+bwd:
              kda_flops = 6 * depth * H * (3KV + 3CK + 2CV + C^2/3)   (elementwise decay/gates, the short
              convs and Engram lookups ignored). K=V=C=64: 204.8k FLOPs per head-token, 819k per
              layer-token at 4 heads (small), 3.3M at 16 (medium)
  attention   12 * n_layers * T * d (the usual PaLM-style estimate: QK^T and AV, fwd+bwd, full T x T
              although causal flash attention computes about half of it)
MFU % = tokens_per_s * flops_per_token / (bf16 matmul rate measured in this run: a 8192^3 torch.matmul,
median of 20 after 3 warm-ups). Kernel rows: the KDA state FLOPs of one layer over the same rate.

Run order and time. Per preset, the systems run in the order listed above: the kernel row first (it
triggers the autotune of our chunk_kda call at this (H, K); FLA's autotune keys are head count, head dim
and block sizes, not B or T, and Triton's autotune-result cache, FLA_CACHE_RESULTS=1 by default, is kept
in TRITON_CACHE_DIR), fla_kda before ours so that every later row's ratio is known when it is written.
Cold, each new (preset, kernel family) can cost minutes of autotune; with a persistent TRITON_CACHE_DIR a
second call on the same (warm) machine skips it. Warm, both presets take about a minute or two.

ratio column (ratio_of says which): throughput rows = tokens/s / fla_kda tokens/s of the same preset
(fla_kda runs before the others for that reason); kda_layer_* rows = ms / kda_kernel ms.

Robustness: each system runs in its own try block -- CUDA OOM and any other error become that row's
status (with the message in note) and the next system runs. --budget-s (default 540) arms SIGALRM at the
global deadline; SIGTERM (e.g. from `timeout`) does the same: the running system becomes "timeout", the
rest "skipped: budget", and the table is still printed. Progress goes to stdout with flush; every row is
appended to --out (TSV; header written when the file is new) as soon as its system finishes, and the
table is printed LAST.

Item 4: --check-equivalence [--equiv-steps N] trains two identical copies of (a) on the same batches:
plain (host firewall, torch's Muon, eager) and fast (the firewall deciding on the device, --muon, and
the model's regions compiled with --compile-backend, default inductor; "none" = no compile), and
compares the losses step by step (rel tol --equiv-tol, default 1e-4 on CPU fp32, 2e-2 on CUDA bf16);
exit 1 on a mismatch. The regions leave the KDA core and the counters eager (dormouse/model/regions.py).

--dry-run-cpu: tiny shapes (d 64, 2 heads x 32, 2 blocks, B 2, T 64, 2 + 1 steps) derived from each
preset, on CPU: ours (torch KDA path), ours_nosync, sdpa, kda_layer_ours against the torch chunked core
as a stand-in kernel (row kda_kernel_torch); the FLA rows are written as "skipped: ..." (FLA's kernels
need CUDA). Default --out there: a temp file (printed), never the committed TSV.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from benchmarks.bench_env import rerun_command
from benchmarks.flops import attention_flops_per_token, kda_flops_per_token, linear_weight_params
from benchmarks.kda_calls import TorchGatesMixer, fla_layer, kernel_fn
from benchmarks.peers import attach_param_groups, build_fla, build_sdpa, sdpa_layout
from benchmarks.pretrain_step import muon_of, ours_step, peer_step, preset_setup, random_batches
from benchmarks.report import TsvWriter, device_name, versions
from benchmarks.timing import as_graph, matmul_rate, measure, sync
from dormouse.model.config import ModelConfig  # noqa: E402
from dormouse.model.gpt import ByteLM, count_params  # noqa: E402
from dormouse.model.kda import KDAMixer
from dormouse.model.regions import compile_regions  # noqa: E402
from dormouse.train.optim import build_optimizers
from dormouse.train.runtime import autocast  # noqa: E402
from dormouse.train.settings import OptimSettings

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "pretrain_h200.tsv"
# the graphed kernel and layer rows last: a fault inside a capture can leave the CUDA context unusable
ORDER = ["kda_kernel", "kda_layer_ours", "kda_layer_eager", "fla_kda", "kda_layer_fla", "ours", "ours_eager", "sdpa",
         "ours_nosync", "ours_graphed", "kda_kernel_graphed", "kda_layer_graphed", "kda_layer_torch_gates_graphed"]
DEFAULT_SYSTEMS = list(ORDER)
MICRO_SYSTEMS = {"ours", "ours_graphed"}  # the rows whose step is the stage's (PretrainStep.__call__), micro-batches and all
CUDA_ONLY = {"fla_kda": "FLA needs CUDA", "kda_layer_fla": "FLA needs CUDA", "ours_graphed": "CUDA graphs need CUDA",
             "kda_kernel_graphed": "CUDA graphs need CUDA", "kda_layer_graphed": "CUDA graphs need CUDA",
             "kda_layer_torch_gates_graphed": "FLA needs CUDA"}
COLUMNS = ["date", "device", "versions", "command", "preset", "system", "status", "batch", "seq_len", "params",
           "params_nonemb", "flop_params", "flops_per_token", "steps", "warmup", "warmup_s", "ms_step",
           "ms_step_median", "tokens_per_s", "peak_gib", "mfu_pct", "matmul_tflops", "ratio", "ratio_of", "note"]
TABLE = [("preset", "preset"), ("system", "system"), ("status", "status"), ("tok/s", "tokens_per_s"),
         ("ms/step", "ms_step"), ("peak GiB", "peak_gib"), ("TFLOP/s", "tflops"), ("MFU %", "mfu_pct"),
         ("ratio", "ratio"), ("ratio of", "ratio_of")]


class BudgetExceeded(Exception):
    """Raised by SIGALRM at the global deadline, or by SIGTERM, while a system runs ("armed")."""


# The signal handler raises only while a system's body runs; otherwise it leaves the reason in "pending"
# and the driver stops before the next system (so a signal never interrupts writing a row or the table).
_SIGNALS = {"armed": False, "pending": None}


def _on_signal(signum, frame):
    reason = "SIGTERM" if signum == signal.SIGTERM else "budget"
    _SIGNALS["pending"] = _SIGNALS["pending"] or reason
    if _SIGNALS["armed"]:
        _SIGNALS["armed"] = False
        raise BudgetExceeded(reason)


def armed(fn, *a, **kw):
    """fn(*a, **kw) with the budget signals allowed to interrupt it."""
    if _SIGNALS["pending"]:
        raise BudgetExceeded(_SIGNALS["pending"])
    try:
        _SIGNALS["armed"] = True
        return fn(*a, **kw)
    finally:
        _SIGNALS["armed"] = False


def log(msg: str) -> None:
    print(f"[pretrain_h200] {msg}", flush=True)


# -------------------------------------------------------------------------------------------------
# Compiling, as the stage compiles
# -------------------------------------------------------------------------------------------------
def compiled(args, module: nn.Module, device: torch.device) -> list[str]:
    """The module's regions compiled as the pretrain stage compiles them (on CUDA, train.compile: cuda),
    with --compile-backend ("none": eager) and --compile-mode."""
    if device.type != "cuda" or args.compile_backend == "none":
        return []
    return compile_regions(module, backend=args.compile_backend, mode=args.compile_mode)


# -------------------------------------------------------------------------------------------------
# Systems: each returns a partial row (metrics + note); the caller adds the common columns
# -------------------------------------------------------------------------------------------------
class Ctx:
    """What every system of one preset shares."""

    def __init__(self, args, preset: str, cfg: ModelConfig, train: dict, device: torch.device,
                 batch: int, seq_len: int, matmul_flops: float, dry: bool):
        self.args, self.preset, self.cfg, self.train, self.device = args, preset, cfg, train, device
        self.batch, self.seq_len, self.matmul_flops, self.dry = batch, seq_len, matmul_flops, dry
        self.tokens = batch * seq_len
        self.results: dict[str, dict] = {}


def _train_row(ctx: Ctx, r: dict, params: int, nonemb: int, flop_params: int, extra_flops: float,
               steps: int, warmup: int, note: str) -> dict:
    fpt = 6 * flop_params + extra_flops
    tps = ctx.tokens / (r["ms_step"] / 1e3)
    first = f"{r['first_s']:.1f}" if r["first_s"] is not None else "n/a"
    return {
        "status": "ok", "params": params, "params_nonemb": nonemb, "flop_params": flop_params,
        "flops_per_token": round(fpt), "steps": steps, "warmup": warmup, "warmup_s": round(r["warmup_s"], 2),
        "ms_step": round(r["ms_step"], 3), "ms_step_median": round(r["ms_step_median"], 3),
        "tokens_per_s": round(tps), "peak_gib": None if r["peak_gib"] is None else round(r["peak_gib"], 3),
        "mfu_pct": round(100 * tps * fpt / ctx.matmul_flops, 2),
        "note": f"first step {first} s; loss at end {r['last_loss']}; 6N={6 * flop_params:.4g} "
                f"mixer={extra_flops:.4g} FLOP/token" + (f"; {note}" if note else ""),
    }


def run_ours(ctx: Ctx, firewall: bool = True, eager: bool = False) -> dict:
    cfg, train, dev = ctx.cfg, ctx.train, ctx.device
    torch.manual_seed(ctx.args.seed)
    model = ByteLM(cfg).to(dev)
    model.train()
    model.defer_routing = True  # as the stage: an MoE's routing counts stay on the device
    opts = build_optimizers(model, OptimSettings.of(train), muon_cls=muon_of(ctx.args.muon))
    batches = random_batches(ctx.batch, ctx.seq_len, dev, ctx.args.seed)
    counters = Counter()
    note = (f"firewall on the {'device' if dev.type == 'cuda' else 'host'}" if firewall else "no firewall")
    regions = [] if eager else compiled(ctx.args, model, dev)
    note += f"; {len(regions)} regions compiled ({ctx.args.compile_backend} {ctx.args.compile_mode})" if regions else "; eager"
    step = ours_step(model, opts, cfg, train, dev, batches, counters, firewall=firewall)
    r = measure(step, ctx.args.steps, ctx.args.warmup, dev)
    cp = count_params(cfg)
    paths = ",".join(f"{k}={v}" for k, v in sorted(counters.items()) if k.startswith("kda_path"))
    note += f"; optimizers {'+'.join(type(o).__name__ for o in opts)}; {paths}"
    return _train_row(ctx, r, cp["total"], cp["non_embedding"], cp["flop_params"],
                      kda_flops_per_token(cfg.depth, cfg.n_heads, cfg.head_dim), ctx.args.steps, ctx.args.warmup, note)


def run_ours_graphed(ctx: Ctx) -> dict:
    """ours_graphed (see the module docstring). The step host-bound on small (GPU time ~26 ms of ~80 ms
    wall, 2026-12-04 profile): this row measures what removing the launches is worth."""
    cfg, train, dev = ctx.cfg, ctx.train, ctx.device
    torch.manual_seed(ctx.args.seed)
    model = ByteLM(cfg).to(dev).train()
    opts = build_optimizers(model, OptimSettings.of(train), muon_cls=muon_of(ctx.args.muon))
    regions = graph_safe_compiled(ctx.args, model, dev)
    batches = random_batches(ctx.batch, ctx.seq_len, dev, ctx.args.seed)
    counters = Counter()
    t0 = time.perf_counter()
    step = ours_step(model, opts, cfg, train, dev, batches, counters, graphed=True)  # captured here, as the stage graphs
    capture_s = time.perf_counter() - t0
    r = {**measure(step, ctx.args.steps, ctx.args.warmup, dev), "peak_gib": None}  # the graph's pool: see graphed_measure
    cp = count_params(cfg)
    paths = ",".join(f"{k}={v}" for k, v in sorted(counters.items()) if k.startswith("kda_path"))
    note = (f"fwd+bwd as CUDA graphs (warm-up + capture {capture_s:.1f} s, not in warmup_s), firewall on the "
            f"device; {len(regions)} regions compiled; optimizers "
            f"{'+'.join(type(o).__name__ for o in opts)}; {paths}")
    return _train_row(ctx, r, cp["total"], cp["non_embedding"], cp["flop_params"],
                      kda_flops_per_token(cfg.depth, cfg.n_heads, cfg.head_dim), ctx.args.steps, ctx.args.warmup, note)


# Small eager ops between the compiled regions and kernels (run 7 at medium: ~85 add_, ~85 sum, ~158 copy_ and ~100
# fill_ a step, ~4 ms together); the autograd engine runs most of them, with no Python stack to name them by.
SMALL_OPS = ("aten::copy_", "aten::add_", "aten::add", "aten::sum", "aten::fill_", "aten::zero_", "aten::cat",
             "aten::mul", "aten::clone", "aten::_to_copy")


def profile_ours(ctx: Ctx, steps: int = 5, rows: int = 30) -> str:
    """torch.profiler over `steps` warm steps of our pretrain step (firewall on, regions compiled on CUDA): where a step's time goes
    (the kernel rows say the KDA op is a small share of it), and the SMALL_OPS by input shape, which says what
    tensors they touch (a [B, T, D] add_ is the residual stream's gradient, a [C, W] sum a conv weight's).
    Returns the tables to print."""
    from torch.profiler import ProfilerActivity, profile

    cfg, train, dev = ctx.cfg, ctx.train, ctx.device
    torch.manual_seed(ctx.args.seed)
    model = ByteLM(cfg).to(dev).train()
    opts = build_optimizers(model, OptimSettings.of(train), muon_cls=muon_of(ctx.args.muon))
    compiled(ctx.args, model, dev)  # as the stage runs it
    step = ours_step(model, opts, cfg, train, dev, random_batches(ctx.batch, ctx.seq_len, dev, ctx.args.seed), Counter())
    for _ in range(ctx.args.warmup):
        step()
    sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        sync(dev)
    ka = prof.key_averages()
    dev_key = "device_time_total" if dev.type == "cuda" else "cpu_time_total"
    self_key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    small = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.key in SMALL_OPS),
                   key=lambda e: getattr(e, self_key), reverse=True)[:rows]
    # our own lines: EventList.table over a filtered list asserts on CUDA (its device total skips CPU-side ops)
    small_table = "\n".join(
        [f"{'self ms':>13} {'calls':>12} {'a call':>12}  {'op':<14} input shapes"]
        + [f"{getattr(e, self_key) / 1e3:10.3f} ms {e.count:6d} calls {getattr(e, self_key) / e.count:9.1f} us"
           f"  {e.key:<14} {str(e.input_shapes)[:120]}" for e in small])
    return (f"== {ctx.preset}: {steps} steps, by {dev_key}\n{ka.table(sort_by=dev_key, row_limit=rows)}\n"
            f"== {ctx.preset}: kernels by {self_key} (whole names: which region a fused kernel belongs to)\n"
            f"{ka.table(sort_by=self_key, row_limit=rows, max_name_column_width=160)}\n"
            f"== {ctx.preset}: small eager ops by input shape, by {self_key}\n"
            f"{small_table}\n"
            f"== {ctx.preset}: by self_cpu_time_total (host overhead)\n{ka.table(sort_by='self_cpu_time_total', row_limit=rows)}")


def run_sdpa(ctx: Ctx) -> dict:
    cfg, train, dev = ctx.cfg, ctx.train, ctx.device
    torch.manual_seed(ctx.args.seed)
    lay = sdpa_layout(cfg)
    model = build_sdpa(cfg).to(dev)
    model.train()
    attach_param_groups(model, [model.blocks])
    opts = build_optimizers(model, OptimSettings.of(train), muon_cls=muon_of(ctx.args.muon))
    whole = dev.type == "cuda" and ctx.args.compile_backend != "none"
    if whole:  # as quality_h200.py: a compiled ours against an eager peer would not be a fair race
        model.compile(backend=ctx.args.compile_backend)
    step = peer_step(lambda x, y: model(x, y)[1], model, opts, train, dev,
                     random_batches(ctx.batch, ctx.seq_len, dev, ctx.args.seed))
    r = measure(step, ctx.args.steps, ctx.args.warmup, dev)
    total = sum(p.numel() for p in model.parameters())
    nonemb = total - model.embed.weight.numel() - model.head.weight.numel()
    assert nonemb == lay["non_embedding"], (nonemb, lay)
    return _train_row(ctx, r, total, nonemb, linear_weight_params(model),
                      attention_flops_per_token(lay["n_layers"], ctx.seq_len, lay["n_heads"] * lay["head_dim"]),
                      ctx.args.steps, ctx.args.warmup,
                      f"{lay['n_layers']} layers d {lay['d']} {lay['n_heads']}x{lay['head_dim']} heads SwiGLU "
                      f"{lay['ffn_hidden']}; non-embedding {nonemb / lay['target']:.3f} x ours; "
                      f"{'torch.compile(model)' if whole else 'eager'}")


def run_fla(ctx: Ctx) -> dict:
    cfg, train, dev = ctx.cfg, ctx.train, ctx.device
    torch.manual_seed(ctx.args.seed)
    model = build_fla(cfg).to(dev)
    model.train()
    opts = build_optimizers(model, OptimSettings.of(train), muon_cls=muon_of(ctx.args.muon))

    def loss_fn(x, y):
        return model(input_ids=x, labels=x, use_cache=False).loss  # FLA shifts the labels itself

    step = peer_step(loss_fn, model, opts, train, dev, random_batches(ctx.batch, ctx.seq_len, dev, ctx.args.seed))
    r = measure(step, ctx.args.steps, ctx.args.warmup, dev)
    total = sum(p.numel() for p in model.parameters())
    nonemb = total - model.model.embeddings.weight.numel() - model.lm_head.weight.numel()
    c = model.config
    return _train_row(ctx, r, total, nonemb, linear_weight_params(model),
                      kda_flops_per_token(cfg.depth, cfg.n_heads, cfg.head_dim), ctx.args.steps, ctx.args.warmup,
                      f"KDAForCausalLM {c.num_hidden_layers} layers, fuse_norm={c.fuse_norm} "
                      f"fuse_swiglu={c.fuse_swiglu} fuse_cross_entropy={c.fuse_cross_entropy}")


def _kernel_row(ctx: Ctx, r: dict, reps: int, warmup: int, note: str) -> dict:
    cfg = ctx.cfg
    fl = kda_flops_per_token(1, cfg.n_heads, cfg.head_dim) * ctx.tokens  # one layer
    return {"status": "ok", "steps": reps, "warmup": warmup, "warmup_s": round(r["warmup_s"], 2),
            "flops_per_token": round(fl / ctx.tokens),
            "ms_step": round(r["ms_step"], 4), "ms_step_median": round(r["ms_step_median"], 4),
            "tokens_per_s": round(ctx.tokens / (r["ms_step"] / 1e3)),
            "peak_gib": None if r["peak_gib"] is None else round(r["peak_gib"], 3),
            "mfu_pct": round(100 * fl / (r["ms_step"] / 1e3) / ctx.matmul_flops, 2),
            "note": f"one layer fwd+bwd, B {ctx.batch} T {ctx.seq_len} H {cfg.n_heads} K {cfg.head_dim}; "
                    f"MFU = KDA state FLOPs only; {note}"}


def run_kda_kernel(ctx: Ctx, torch_standin: bool, graphed: bool = False) -> dict:
    fn, name = kernel_fn(ctx.cfg, ctx.batch, ctx.seq_len, ctx.device, ctx.args.seed, torch_standin)
    if graphed:
        r, name = graphed_measure(fn, ctx), f"{name}, replayed from one CUDA graph"
    else:
        r = measure(fn, ctx.args.kernel_reps, ctx.args.kernel_warmup, ctx.device)
    return _kernel_row(ctx, r, ctx.args.kernel_reps, ctx.args.kernel_warmup, name)


def _layer_fn(ctx: Ctx, layer: nn.Module, call):
    B, T, D = ctx.batch, ctx.seq_len, ctx.cfg.d_model
    g0 = torch.Generator(device="cpu").manual_seed(ctx.args.seed)
    x = torch.randn(B, T, D, generator=g0).to(ctx.device).requires_grad_()
    dy = None

    def fn():
        nonlocal dy
        x.grad = None
        layer.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        with autocast(ctx.device, ctx.train["dtype"]):
            y = call(x)
        if dy is None:
            dy = torch.randn(y.shape, generator=g0).to(device=ctx.device, dtype=y.dtype)
        y.backward(dy)

    return fn


def run_layer_ours(ctx: Ctx, eager: bool = False, graphed: bool = False) -> dict:
    torch.manual_seed(ctx.args.seed)
    mixer = KDAMixer(ctx.cfg).to(ctx.device)
    regions = [] if eager else (graph_safe_compiled if graphed else compiled)(ctx.args, mixer, ctx.device)
    counters = Counter()
    fn = _layer_fn(ctx, mixer, lambda x: mixer(x, counters=counters)[0])
    r = graphed_measure(fn, ctx) if graphed else measure(fn, ctx.args.kernel_reps, ctx.args.kernel_warmup, ctx.device)
    paths = ",".join(f"{k}={v}" for k, v in sorted(counters.items()))
    how = f"regions {'+'.join(regions)} compiled ({ctx.args.compile_backend})" if regions else "eager"
    how += ", replayed from one CUDA graph" if graphed else ""
    return _kernel_row(ctx, r, ctx.args.kernel_reps, ctx.args.kernel_warmup,
                       f"dormouse KDAMixer, bf16 autocast, {how}; {paths}")


def graph_safe_compiled(args, module: nn.Module, device: torch.device) -> list[str]:
    """`compiled` without --compile-mode: inductor's own CUDA graphs (reduce-overhead) cannot nest in a capture."""
    if device.type != "cuda" or args.compile_backend == "none":
        return []
    return compile_regions(module, backend=args.compile_backend)


def graphed_measure(fn, ctx: Ctx) -> dict:
    """measure() of fn replayed from one CUDA graph; peak memory n/a (the graph's pool is outside the allocated peak)."""
    r = measure(as_graph(fn, ctx.device), ctx.args.kernel_reps, ctx.args.kernel_warmup, ctx.device)
    return {**r, "peak_gib": None}


def run_layer_torch_gates_graphed(ctx: Ctx) -> dict:
    torch.manual_seed(ctx.args.seed)
    ours = KDAMixer(ctx.cfg).to(ctx.device)
    other = TorchGatesMixer(ctx.cfg).to(ctx.device)
    other.load_state_dict(ours.state_dict())
    regions = graph_safe_compiled(ctx.args, other, ctx.device)
    graph_safe_compiled(ctx.args, ours, ctx.device)  # the reference output as the stage computes it
    x = torch.randn(ctx.batch, ctx.seq_len, ctx.cfg.d_model, generator=torch.Generator().manual_seed(ctx.args.seed + 1))
    with torch.no_grad(), autocast(ctx.device, ctx.train["dtype"]):
        a, b = ours(x.to(ctx.device))[0].float(), other(x.to(ctx.device))[0].float()
    diff = f"max |this - ours| {(a - b).abs().max().item():.3g} of max |ours| {a.abs().max().item():.3g}"
    del ours, a, b
    fn = _layer_fn(ctx, other, lambda x: other(x)[0])
    r = graphed_measure(fn, ctx)
    how = f"regions {'+'.join(regions)} compiled ({ctx.args.compile_backend})" if regions else "eager"
    return _kernel_row(ctx, r, ctx.args.kernel_reps, ctx.args.kernel_warmup,
                       f"our layer, gate/L2 norms/beta in our gates region ({how}), one CUDA graph; {diff}")


def run_layer_fla(ctx: Ctx) -> dict:
    torch.manual_seed(ctx.args.seed)
    layer = fla_layer(ctx.cfg, ctx.device)
    fn = _layer_fn(ctx, layer, lambda x: layer(hidden_states=x)[0])
    r = measure(fn, ctx.args.kernel_reps, ctx.args.kernel_warmup, ctx.device)
    return _kernel_row(ctx, r, ctx.args.kernel_reps, ctx.args.kernel_warmup,
                       "fla.layers.kda.KimiDeltaAttention (gate, q/k norm, beta fused in the kernel), bf16 autocast")


RUNNERS = {
    "kda_kernel": lambda ctx: run_kda_kernel(ctx, torch_standin=ctx.dry),
    "kda_layer_ours": run_layer_ours,
    "kda_layer_eager": lambda ctx: run_layer_ours(ctx, eager=True),
    "kda_kernel_graphed": lambda ctx: run_kda_kernel(ctx, torch_standin=False, graphed=True),
    "kda_layer_graphed": lambda ctx: run_layer_ours(ctx, graphed=True),
    "kda_layer_torch_gates_graphed": run_layer_torch_gates_graphed,
    "kda_layer_fla": run_layer_fla,
    "fla_kda": run_fla,
    "ours": run_ours,
    "ours_eager": lambda ctx: run_ours(ctx, eager=True),
    "sdpa": run_sdpa,
    "ours_nosync": lambda ctx: run_ours(ctx, firewall=False),
    "ours_graphed": run_ours_graphed,
}
assert list(RUNNERS) == [s for s in RUNNERS if s in ORDER] and set(RUNNERS) == set(ORDER)


# -------------------------------------------------------------------------------------------------
# Item 4: the optimised step gives the plain step's losses
# -------------------------------------------------------------------------------------------------
GRAPHED_TOL = 1e-3  # graphed against fast: the same kernels, so only reduction order (FLA's atomics) may differ


def check_equivalence(cfg: ModelConfig, train: dict, device: torch.device, batch: int, seq_len: int,
                      steps: int = 3, backend: str = "inductor", seed: int = 0, tol: float | None = None,
                      muon: str = "stacked") -> dict:
    """Train two identical copies of (a) on the same batches: plain (the firewall deciding on the host,
    torch's Muon, no compile) and fast (the firewall deciding on the device, `muon`, the model's regions
    compiled with `backend` unless it is "none", on any device) and, on CUDA where the stage would graph it,
    graphed (fast with its forward and backward replayed from CUDA graphs, dormouse.train.cuda_graphs). Returns
    {"plain": [...], "fast": [...], "counters": {arm: Counter}, "max_rel": float, "tol": float, "ok": bool}
    (+ "graphed", "graphed_rel", "graphed_tol"): ok when every loss is finite, fast is within tol of plain,
    graphed within GRAPHED_TOL of fast, and every arm counted what plain counted."""
    tol = tol if tol is not None else (2e-2 if device.type == "cuda" else 1e-4)
    torch.manual_seed(seed)
    plain = ByteLM(cfg).to(device)
    arms = [("plain", plain), ("fast", copy.deepcopy(plain))]
    if device.type == "cuda":  # one process: the stage graphs every model (cuda_graphs.refusal)
        arms.append(("graphed", copy.deepcopy(plain)))
    batches = random_batches(batch, seq_len, device, seed)
    losses, counts = {}, {}
    for name, model in arms:
        model.train()
        fast = name != "plain"
        opts = build_optimizers(model, OptimSettings.of(train), muon_cls=muon_of(muon if fast else "torch"))
        if fast and backend != "none":
            compile_regions(model, backend=backend)
        counts[name] = Counter()
        step = ours_step(model, opts, cfg, train, device, batches, counts[name], firewall=True, firewall_on_device=fast,
                         graphed=name == "graphed")
        losses[name] = [float(step().detach().float().item()) for _ in range(steps)]
    def max_rel(ref, other):
        return max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses[ref], losses[other], strict=True)), default=0.0)

    mx = max_rel("plain", "fast")
    ok = (mx <= tol and all(math.isfinite(x) for name, _ in arms for x in losses[name])
          and all(counts[name] == counts["plain"] for name, _ in arms))
    out = {**losses, "counters": counts, "max_rel": mx, "tol": tol}
    if "graphed" in losses:  # the same kernels as fast, replayed: held to a tighter tolerance, against fast
        out["graphed_rel"], out["graphed_tol"] = max_rel("fast", "graphed"), GRAPHED_TOL
        ok = ok and out["graphed_rel"] <= GRAPHED_TOL
    return {**out, "ok": ok}


# -------------------------------------------------------------------------------------------------
# Output
# -------------------------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    def cell(r, key):
        v = r.get(key)
        if key == "tflops":  # achieved: tokens/s x FLOPs/token; the matmul row: the measured rate
            if r.get("system") == "matmul":
                v = r.get("matmul_tflops")
            elif isinstance(r.get("tokens_per_s"), (int, float)) and isinstance(r.get("flops_per_token"), (int, float)):
                v = r["tokens_per_s"] * r["flops_per_token"] / 1e12
        if v is None or v == "":
            return "n/a" if key not in ("ratio_of",) else ""
        if key == "tokens_per_s" and isinstance(v, (int, float)):
            return f"{v:,.0f}"
        if key == "status":
            return str(v)[:40]
        if isinstance(v, float):
            return f"{v:.3g}" if key in ("ratio",) else f"{v:.2f}"
        return str(v)

    body = [[h for h, _ in TABLE]] + [[cell(r, k) for _, k in TABLE] for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(TABLE))]
    lines = ["  ".join(c.ljust(w) if i < 3 or i == len(TABLE) - 1 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(line, widths, strict=True))) for line in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------
# Driver
# -------------------------------------------------------------------------------------------------
def setup(name: str, args, dry: bool):
    """A preset's (cfg, train, batch, seq_len) with this run's --batch-size, --seq-len and --micro-batch-size
    (benchmarks.pretrain_step.preset_setup)."""
    if args.micro_batch_size:  # the stage's gradient accumulation (dormouse.train.trainer.PretrainStep)
        others = set(args.systems or DEFAULT_SYSTEMS) - MICRO_SYSTEMS
        if others:  # they call the forward on the whole batch, or are another system: rows that would not compare
            raise SystemExit(f"pretrain_h200: --micro-batch-size runs only with --systems among {sorted(MICRO_SYSTEMS)}; "
                             f"not {sorted(others)}")
    return preset_setup(name, dry, args.batch_size, args.seq_len, args.micro_batch_size)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="See the module docstring.")
    ap.add_argument("--presets", nargs="+", default=["small", "medium"])
    ap.add_argument("--systems", nargs="+", default=None, choices=ORDER,
                    help=f"subset to run, always in the order {' '.join(ORDER)} (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per system (default 30; dry run 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per system (default 10; dry run 1)")
    ap.add_argument("--kernel-reps", type=int, default=None, help="timed calls per kernel/layer row (default 20; dry run 2)")
    ap.add_argument("--kernel-warmup", type=int, default=None, help="warm-up calls per kernel/layer row (default 5; dry run 1)")
    ap.add_argument("--batch-size", type=int, default=None, help="override the preset's train.batch_size")
    ap.add_argument("--seq-len", type=int, default=None, help="override the preset's train.seq_len")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="train.micro_batch_size: rows per forward; the batch's gradients add up before one optimizer step "
                         "(e.g. b1 at --batch-size 32 --micro-batch-size 16: Muon's cost over twice the tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--muon", choices=["torch", "stacked"], default="stacked",
                    help="every row's Muon: dormouse.train.optim.StackedMuon (the stages') or torch.optim.Muon")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode of the regions (e.g. reduce-overhead)")
    ap.add_argument("--profile", action="store_true",
                    help="only profile our step (torch.profiler, 5 warm steps per preset) and print where the time goes")
    ap.add_argument("--check-equivalence", action="store_true",
                    help="only check that the compiled step gives the plain step's losses (item 4); exit 1 if not")
    ap.add_argument("--equiv-steps", type=int, default=3)
    ap.add_argument("--equiv-tol", type=float, default=None)
    ap.add_argument("--budget-s", type=float, default=540.0, help="global deadline in seconds (0: none)")
    ap.add_argument("--out", type=Path, default=None, help=f"TSV to append to (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument("--matmul-n", type=int, default=None, help="side of the timed square matmul (default 8192; CPU 256)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on CPU, FLA skipped (a test of the script)")
    ap.add_argument("--note", default="", help="free text added to every row's note")
    args = ap.parse_args(argv)
    dry = args.dry_run_cpu
    args.steps = args.steps or (2 if dry else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 10)
    args.kernel_reps = args.kernel_reps or (2 if dry else 20)
    args.kernel_warmup = args.kernel_warmup if args.kernel_warmup is not None else (1 if dry else 5)
    systems = list(args.systems or DEFAULT_SYSTEMS)
    args.systems = [s for s in ORDER if s in systems]
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "pretrain_h200.dry.tsv" if dry else DEFAULT_OUT
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    dry = args.dry_run_cpu
    if dry:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        log("no CUDA device visible: use --dry-run-cpu to exercise the script on CPU")
        return 2
    command = rerun_command("benchmarks.pretrain_h200", argv)

    if args.check_equivalence:
        bad = 0
        for name in args.presets:
            cfg, train, batch, seq_len = setup(name, args, dry)
            res = check_equivalence(cfg, train, device, batch, seq_len, args.equiv_steps, args.compile_backend,
                                    args.seed, args.equiv_tol, args.muon)
            graphed = (f"graphed {res['graphed']} (rel to fast {res['graphed_rel']:.3g}, tol {res['graphed_tol']:.3g})"
                       if "graphed" in res else "(graphed: not on this device)")
            same = all(c == res["counters"]["plain"] for c in res["counters"].values())
            log(f"equivalence {name} (B {batch} T {seq_len}, compile backend {args.compile_backend}, muon {args.muon}, "
                f"firewall on the device): plain {res['plain']} fast {res['fast']} {graphed}; counters "
                f"{'equal' if same else 'DIFFER'}; max rel diff {res['max_rel']:.3g} tol {res['tol']:.3g} -> "
                f"{'OK' if res['ok'] else 'MISMATCH'}")
            bad += not res["ok"]
        return 1 if bad else 0

    if args.profile:
        for name in args.presets:
            cfg, train, batch, seq_len = setup(name, args, dry)
            print(profile_ours(Ctx(args, name, cfg, train, device, batch, seq_len, 0.0, dry)), flush=True)
        return 0

    setups = {name: setup(name, args, dry) for name in args.presets}  # a bad preset fails here, first
    writer = TsvWriter(args.out, COLUMNS)
    base = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device_name(device),
            "versions": versions(), "command": command}
    log(f"device {base['device']}; {base['versions']}; out {writer.path}")
    log(f"systems {' '.join(args.systems)}; each warms up ({args.warmup} steps, kernel rows {args.kernel_warmup} "
        f"calls: Triton autotune/compile happen there) before {args.steps} timed steps ({args.kernel_reps} calls)")
    _SIGNALS.update(armed=False, pending=None)
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGALRM)}
    signal.signal(signal.SIGTERM, _on_signal)
    if args.budget_s > 0:
        signal.signal(signal.SIGALRM, _on_signal)
        signal.setitimer(signal.ITIMER_REAL, args.budget_s)
    try:
        out = run_all(args, device, dry, setups, writer, base)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if out is None:
        return 1
    mm, mm_row, rows = out
    log(f"rows appended to {writer.path}")
    for r in rows:
        if r["system"] in ("kda_layer_ours", "kda_layer_graphed") and r.get("ratio") is not None:
            log(f"kernel ratio target {r['preset']}: our KDAMixer fwd+bwd / {r['ratio_of'].split(' / ')[1]} = {r['ratio']}")
    log(f"bf16 matmul rate {mm / 1e12:.1f} TFLOP/s is the MFU denominator" if not dry else
        f"CPU fp32 matmul rate {mm / 1e12:.3f} TFLOP/s is the MFU denominator (dry run)")
    print(table([mm_row] + rows), flush=True)
    for line in control_ratios(rows):
        log(line)
    return 0


def control_ratios(rows: list[dict]) -> list[str]:
    """tokens/s of each preset against its controls ('b1:{...}' rows of the same system), measured in this run."""
    ok = {(r["preset"], r["system"]): r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s")}
    out = []
    for (preset, system), r in ok.items():
        if ":" in preset:
            continue
        for (other, osys), c in ok.items():
            if osys == system and other.startswith(preset + ":"):
                out.append(f"{preset} / control {other} ({system}): {r['tokens_per_s'] / c['tokens_per_s']:.3f}x tokens/s "
                           f"({r['tokens_per_s']:,} / {c['tokens_per_s']:,})")
    return out


def run_all(args, device: torch.device, dry: bool, setups: dict, writer: TsvWriter, base: dict):
    """The matmul rate, then every preset x system; None if stopped before the matmul rate."""
    rows: list[dict] = []
    OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    try:
        mm, mm_desc = armed(matmul_rate, device, args.matmul_n)
        log(f"matmul rate {mm / 1e12:.1f} TFLOP/s ({mm_desc}){' [CPU: not a GPU figure]' if dry else ''}")
    except BudgetExceeded as e:
        log(f"stopped before the matmul rate: {e}")
        return None
    mm_tflops = float(f"{mm / 1e12:.4g}")
    mm_row = {**base, "preset": "-", "system": "matmul", "status": "ok", "matmul_tflops": mm_tflops,
              "note": mm_desc + (f"; {args.note}" if args.note else "")}
    writer.write(mm_row)

    for name, (cfg, train, batch, seq_len) in setups.items():
        ctx = Ctx(args, name, cfg, train, device, batch, seq_len, mm, dry)
        cp = count_params(cfg)
        log(f"preset {name}: B {batch} T {seq_len} d {cfg.d_model} depth {cfg.depth} heads {cfg.n_heads}x"
            f"{cfg.head_dim} ffn {cfg.ffn_hidden} engram {cfg.engram}; ours {cp['total']:,} params "
            f"({cp['non_embedding']:,} non-embedding)")
        for system in args.systems:
            label = "kda_kernel_torch" if (system == "kda_kernel" and dry) else system
            row = {**base, "preset": name, "system": label, "batch": batch, "seq_len": seq_len,
                   "matmul_tflops": mm_tflops}
            t0 = time.monotonic()
            if _SIGNALS["pending"]:
                row["status"] = f"skipped: {_SIGNALS['pending']}"
            elif dry and system in CUDA_ONLY:
                row["status"] = f"skipped: {CUDA_ONLY[system]} (dry run)"
            else:
                log(f"{name} {label}: start")
                try:
                    row.update(armed(RUNNERS[system], ctx))
                except BudgetExceeded as e:
                    row["status"] = f"timeout ({e})"
                except OOM as e:
                    row["status"] = "oom"
                    row["note"] = str(e).split("\n")[0][:300]
                except Exception as e:  # noqa: BLE001 - one system's failure is that row's result
                    row["status"] = f"error: {type(e).__name__}"
                    row["note"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
                    sys.stderr.flush()
                finally:
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    torch._dynamo.reset()  # each system compiles its own regions
            ctx.results[label] = row
            add_ratio(row, ctx.results)
            if args.note:
                row["note"] = f"{row.get('note', '')}; {args.note}".lstrip("; ")
            rows.append(row)
            writer.write(row)
            log(f"{name} {label}: {row['status']} ({time.monotonic() - t0:.1f} s)" + (
                f"; {row['ms_step']} ms/step, {row['tokens_per_s']:,} tok/s, peak {row.get('peak_gib')} GiB, "
                f"MFU {row['mfu_pct']} %, warm-up {row['warmup_s']} s" if row["status"] == "ok" else
                (f"; {row['note']}" if row.get("note") else "")))
    return mm, mm_row, rows


def add_ratio(row: dict, results: dict[str, dict]) -> None:
    """ratio: kernel/layer rows vs the kernel row's ms; training rows vs fla_kda's tokens/s (same preset)."""
    if row.get("status") != "ok":
        return
    sysname = row["system"]
    if sysname.startswith("kda_layer"):
        ref_name = ("kda_kernel_graphed" if sysname.endswith("_graphed") else
                    "kda_kernel" if "kda_kernel" in results else "kda_kernel_torch")
        ref = results.get(ref_name)
        if ref and ref.get("status") == "ok":
            row["ratio"] = round(row["ms_step"] / ref["ms_step"], 3)
            row["ratio_of"] = f"ms / {ref_name} ms"
    elif sysname.startswith("kda_kernel"):
        row["ratio"], row["ratio_of"] = 1.0, ("reference for kda_layer_graphed" if sysname.endswith("_graphed")
                                              else "reference for kda_layer_*")
    else:
        ref = results.get("fla_kda")
        if ref and ref.get("status") == "ok":
            row["ratio"] = round(row["tokens_per_s"] / ref["tokens_per_s"], 3)
            row["ratio_of"] = "tok/s / fla_kda tok/s"


if __name__ == "__main__":
    sys.exit(main())
