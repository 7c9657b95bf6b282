"""Where our KDA layer's time goes beyond `chunk_kda` (issue #7's layer target), one preset per run, on CUDA.

Every variant is one mixer forward+backward at the preset's batch and sequence length under bf16 autocast,
replayed from one CUDA graph (GPU time only: the launches the stage removes with train.cuda_graphs), and is
reported as ms and as a ratio to the raw kernel measured in the same run:

  kernel          fla.ops.kda.chunk_kda on pre-activated inputs (the reference)
  ours            dormouse KDAMixer as the stage runs it: the six input projections as one compiled matmul,
                  our Triton conv (dormouse.model.conv_triton, eager), the q/k L2 norms, decay gate and beta's
                  sigmoid inside chunk_kda, finish compiled with inductor
  fla_conv        ours with FLA's Triton causal_conv1d for the short convs (the layer of run 6)
  torch_gates     ours with those activations in our compiled `gates` region (the layer until run 6, but with
                  our conv since run 7: not comparable with its earlier rows)
  separate_proj   torch_gates with the six projections as separate eager nn.Linear calls (early run 6; our conv
                  since run 7)
  torch_conv      the layer until run 5: projections, our torch conv and the gates in one compiled region
  ours_noconv     ours without the short convs (what the three convs cost; its SiLUs run eagerly)
  no_kernel       ours with the core replaced by o = v (all of our code around the kernel)
  fla_norm        ours with FLA's fused gated RMSNorm (sigmoid) in finish
  fla_layer       fla.layers.kda.KimiDeltaAttention itself (carry .whl: fla.layers ships in flash-linear-attention)

then a torch.profiler table of `ours` (compiled, not graphed) by kernel, device time first.

    python3 -m benchmarks.kda_layer_h200 --preset medium [--variants ours torch_conv ...] [--reps 20]
    .venv/bin/python -m benchmarks.kda_layer_h200 --dry-run-cpu   # the wiring on CPU, tiny shapes: FLA's rows
        skipped, the torch core standing in for the kernel, regions traced with aot_eager, no graphs

Times on CPU mean nothing; the dry run exists so a lease is not spent on a variant that cannot build.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback

import torch

from benchmarks.kda_calls import TorchGatesMixer, fla_layer, kernel_fn
from benchmarks.pretrain_step import preset_setup
from benchmarks.timing import as_graph, measure, sync
from dormouse.model import kda as kda_module  # noqa: E402
from dormouse.model.kda import KDAMixer  # noqa: E402
from dormouse.model.regions import compile_regions  # noqa: E402
from dormouse.train.runtime import autocast  # noqa: E402

VARIANTS = ["kernel", "ours", "fla_conv", "torch_gates", "separate_proj", "torch_conv", "ours_noconv", "no_kernel", "fla_norm",
            "fla_layer"]
NEEDS_FLA = {"fla_norm", "fla_layer"}


class NoKernelMixer(KDAMixer):
    def core(self, q, k, v, g, beta, h0=None, counters=None):
        return v * beta[..., None].to(v.dtype), None  # keeps every prepare output in the graph


class SeparateProjMixer(TorchGatesMixer):
    """Early run 6's layer: each projection its own eager nn.Linear (x cast six times, six dx summed in fp32)."""

    def in_proj(self, x, norm=None):
        x = x if norm is None else norm(x)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q, k, v, self.f_proj(x), self.b_proj(x), self.g_proj(x)

    def regions(self):
        return ("gates", "finish")


class TorchConvMixer(TorchGatesMixer):
    """Run 5's layer: one compiled region from x to the gates, the convs in torch (built and captured under
    `conv_off`, so the dispatcher takes its CPU path)."""

    def regions(self):
        return ("prepare", "finish")


class conv_off:  # noqa: N801 - a context manager: short_conv does not see the named kernels inside
    def __init__(self, *names):
        self.names = names

    def __enter__(self):
        self.saved = {n: getattr(kda_module, n) for n in self.names}
        for n in self.names:
            setattr(kda_module, n, lambda: None)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(kda_module, n, f)


CONV_OFF = {"torch_conv": ("_conv_triton", "_fla_causal_conv1d"), "fla_conv": ("_conv_triton",)}


def _fla_finish(self, o, gate):
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    B, T, H, K = o.shape
    y = rms_norm_gated(o, gate.view(B, T, H, K), self.o_norm_weight, None, activation="sigmoid", eps=self.norm_eps)
    return self.o_proj(y.reshape(B, T, H * K).to(gate.dtype))


class FlaNormMixer(KDAMixer):
    finish = _fla_finish

    def regions(self):
        return ("in_proj", "gates")


MIXERS = {"ours": KDAMixer, "fla_conv": KDAMixer, "torch_gates": TorchGatesMixer, "separate_proj": SeparateProjMixer,
          "no_kernel": NoKernelMixer, "torch_conv": TorchConvMixer, "fla_norm": FlaNormMixer}


def layer_fn(layer, x, dy, train, call):
    def fn():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with autocast(x.device, train["dtype"]):
            y = call(x)
        y.backward(dy)
    return fn


def build(name, cfg, device, backend="inductor"):
    torch.manual_seed(0)
    if name == "fla_layer":
        layer = fla_layer(cfg, device)
        return layer, lambda x: layer(hidden_states=x)[0]
    if name == "ours_noconv":
        from dataclasses import replace

        layer = KDAMixer(replace(cfg, kda_conv_size=0)).to(device)
    else:
        layer = MIXERS[name](cfg).to(device)
    compile_regions(layer, backend=backend)
    return layer, lambda x: layer(x)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on CPU: the wiring, not the speed")
    args = ap.parse_args(argv)
    dry = args.dry_run_cpu
    device = torch.device("cpu" if dry else "cuda")
    cfg, train, batch, seq_len = preset_setup(args.preset, dry)
    backend = "aot_eager" if dry else "inductor"  # aot_eager traces the same fullgraph regions, without a C++ build
    graph = (lambda fn, device: fn) if dry else as_graph
    print(f"[kda_layer] {args.preset}: B {batch} T {seq_len} D {cfg.d_model} H {cfg.n_heads} K {cfg.head_dim} "
          f"conv {cfg.kda_conv_size}; {torch.__version__}", flush=True)
    g0 = torch.Generator().manual_seed(args.seed)
    x = torch.randn(batch, seq_len, cfg.d_model, generator=g0).to(device).requires_grad_()
    dy = torch.randn(batch, seq_len, cfg.d_model, generator=g0).to(device, torch.float32 if dry else torch.bfloat16)
    ref = None
    rows = []
    for name in args.variants:
        if dry and name in NEEDS_FLA:
            rows.append((name, None, "skipped: FLA needs CUDA"))
            continue
        torch._dynamo.reset()  # the variants share region code objects: their graphs would add up to the recompile limit
        try:
            if name == "kernel":
                fn, note = kernel_fn(cfg, batch, seq_len, device, args.seed, torch_standin=dry)[0], ""
            else:
                note, a = "", None
                if name in ("fla_conv", "torch_gates", "separate_proj", "torch_conv", "fla_norm"):
                    ours, ocall = build("ours", cfg, device, backend)
                    with torch.no_grad(), autocast(device, train["dtype"]):
                        a = ocall(x).float()
                with conv_off(*CONV_OFF[name]) if name in CONV_OFF else contextlib.nullcontext():
                    layer, call = build(name, cfg, device, backend)
                    fn = layer_fn(layer, x, dy, train, call)
                    if a is not None:
                        layer.load_state_dict(ours.state_dict())
                        with torch.no_grad(), autocast(device, train["dtype"]):
                            b = call(x).float()
                        note = f"max|this-ours| {(a - b).abs().max().item():.3g} of max|ours| {a.abs().max().item():.3g}"
                        del ours
                    fn = graph(fn, device)  # compiled and captured here: the replays run no python
            r = measure(fn if name != "kernel" else graph(fn, device), args.reps, 3, device)
            rows.append((name, r["ms_step_median"], note))
            if name == "kernel":
                ref = r["ms_step_median"]
            print(f"[kda_layer] {name}: {r['ms_step_median']:.3f} ms {note}", flush=True)
        except Exception as e:  # one variant failing (a capture fault, an FLA API change) must not end the run
            traceback.print_exc()
            rows.append((name, None, f"failed: {type(e).__name__}: {str(e)[:120]}"))
        sync(device)
    if "ours" in args.variants and args.profile_rows and not dry:
        from torch.profiler import ProfilerActivity, profile

        layer, call = build("ours", cfg, device)
        fn = layer_fn(layer, x, dy, train, call)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"== ours ({args.preset}), 5 calls, kernels by device time")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.profile_rows,
                                        max_name_column_width=90))
    print(f"\n{'variant':<12} {'ms':>8} {'/kernel':>8}  note")
    for name, ms, note in rows:
        ratio = f"{ms / ref:.2f}" if ms is not None and ref else "n/a"
        print(f"{name:<12} {'n/a' if ms is None else f'{ms:.3f}':>8} {ratio:>8}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
