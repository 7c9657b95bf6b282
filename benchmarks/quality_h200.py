"""Held-out BPB at equal wall-clock: our pretrain model against a plain SDPA Transformer of equal
non-embedding parameters (issue: H200 throughput, item 3). One system per call, so each fits a device
call of 10 minutes:

    python3 -m benchmarks.quality_h200 --job .job/small_pretrain.json --systems ours --budget-s 480 --out $OUT/q_ours.tsv
    python3 -m benchmarks.quality_h200 --job .job/small_pretrain.json --systems sdpa --budget-s 480 --out $OUT/q_sdpa.tsv
    # the issue's 600 s over two calls on a warm machine (/tmp persists between them; the same command twice):
    python3 -m benchmarks.quality_h200 --job ... --systems ours --budget-s 600 --pause-after-s 300 --state /tmp/q \
      --out $OUT/q_ours.tsv
    .venv/bin/python -m benchmarks.quality_h200 --job <a tiny pretrain job> --budget-s 5 --eval-every-s 2   # CPU
    .venv/bin/python -m benchmarks.quality_h200 --from-tsv benchmarks/records/2026-12-04-throughput-h200-run9-quality-600s/quality_h200.tsv \
        --anchors results/small/anchors.json --plot benchmarks/records/2026-12-04-throughput-h200-run9-quality-600s/quality_h200.png   # the curves of a past run

Both systems read the pretrain job's data the same way (TrainStream over the shard artifact's train
shards, the job's batch, sequence length and seed) and are scored on the job's eval window (the eval
tail from its start, eval_bytes). Same optimizer split (build_optimizers: Muon for the hidden matrices,
AdamW for the rest), lr, warmup-stable-decay shape and grad clip; ours runs the stage's NaN firewall.
On CUDA both are compiled: ours as the stage compiles it (its regions, dormouse/model/regions.py), the
SDPA model whole (torch.compile(model): it has no graph break). When the job asks (train.cuda_graphs: cuda,
the default) both replay their forward and backward from CUDA graphs (dormouse.train.cuda_graphs.GraphedLoss),
ours as the stage does and the SDPA model the same way, so neither race is run by the host's launch rate;
where ours is refused (an MoE preset) neither is graphed.
The schedule runs on the clock: its progress is training seconds / budget, so both systems decay to
the end of their budget whatever their step rate. Warm-up (Triton autotune, first-call compiles) runs on
a throwaway model before the clock starts; evaluation pauses the clock. The SDPA model is
pretrain_h200.py's (c), with its parameter matching (benchmarks/peers.py).

Rows (one per eval): system, train_s, step, bytes, passes (bytes over the train shards' size: past 1 the curve measures
memorising as well as learning), eval_bpb; the table (final and best BPB per system) prints last.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.peers import attach_param_groups, build_sdpa, sdpa_layout
from benchmarks.report import versions
from dormouse.data import shards as layout  # noqa: E402
from dormouse.data.byte_stream import StreamState, TrainStream, eval_window  # noqa: E402
from dormouse.core.config import load_preset  # noqa: E402
from dormouse.planner.job import input_artifact  # noqa: E402
from dormouse.model.config import ModelConfig  # noqa: E402
from dormouse.model.gpt import ByteLM, count_params  # noqa: E402
from dormouse.train import checkpoint, cuda_graphs  # noqa: E402
from dormouse.train.optim import build_optimizers, set_lr, wsd_multiplier  # noqa: E402
from dormouse.train.runtime import compile_for, evaluate  # noqa: E402
from dormouse.train.trainer import PretrainStep, resume  # noqa: E402
from dormouse.train.settings import OptimSettings, TrainSettings

ROOT = Path(__file__).resolve().parents[1]

SYSTEMS = ("ours", "sdpa")
PROGRESS_STEPS = 10_000  # the clock's progress in these units drives wsd_multiplier


class CounterFree(torch.nn.Module):
    """The SDPA model under runtime.evaluate's call (it passes counters)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, targets=None, counters=None):
        return self.model(idx, targets)

    def take_routing(self, counters) -> None:  # no MoE: nothing routed (cuda_graphs.GraphedLoss drains the capture's)
        pass


def build(system: str, cfg: ModelConfig, train: dict, device: torch.device):
    """(model to train, model to evaluate, optimizers, parameter note)."""
    if system == "ours":
        model = ByteLM(cfg).to(device)
        regions = compile_for(model, device, train["compile"])  # as the stage runs it
        return (model, model, build_optimizers(model, OptimSettings.of(train)),
                f"{count_params(cfg)['non_embedding']:,} non-embedding; {len(regions)} regions compiled")
    lay = sdpa_layout(cfg)
    model = build_sdpa(cfg).to(device)
    attach_param_groups(model, [model.blocks])
    if device.type == "cuda":  # compiled whole (it has no graph breaks): an equal-clock race against an eager peer is not fair
        model.compile()
    return model, CounterFree(model), build_optimizers(model, OptimSettings.of(train)), (
        f"{lay['non_embedding']:,} non-embedding (target {lay['target']:,}); "
        f"{'torch.compile(model)' if device.type == 'cuda' else 'eager'}")


def train_for(system: str, cfg: ModelConfig, train: dict, shards, device, budget_s: float, eval_every_s: float,
              warmup_steps: int, log, pause_s: float | None = None, state_dir: Path | None = None,
              run_key: dict | None = None, label: str | None = None) -> list[dict]:
    """The curve of one system (rows and saved state named `label`, default the system). With state_dir, a checkpoint of it there is resumed, and with pause_s the clock
    stops after that many training seconds of this call and the run is saved there for the next call (a 600 s budget does not
    fit one 600 s device command); the schedule runs on the whole budget either way. A saved run resumes only
    under the same run_key (job digest, system, budget and eval interval)."""
    name = label or system
    bins = layout.train_bins(shards)
    ex, ey, eval_bytes = eval_window(layout.eval_bin(shards), train["eval_bytes"], train["seq_len"])
    counters = Counter()

    # both systems graphed or neither: the stage's decision for ours holds for the SDPA peer too
    graphs = cuda_graphs.decide(train["cuda_graphs"], device.type, cfg, 1)
    if graphs.startswith("refused"):
        log(f"{name}: train.cuda_graphs: {graphs}; eager steps")
    step_cfg = cfg if system == "ours" else ModelConfig.from_dict({**cfg.to_dict(), "moe": False})  # no MoE term

    def stepper(model, scored, opts) -> PretrainStep:
        """The pretrain stage's step (dormouse.train.trainer); the SDPA peer through its counter-free wrapper."""
        return PretrainStep(model, opts, step_cfg, TrainSettings.of(train), device, net=None if system == "ours" else scored, graphs=graphs)

    if warmup_steps:  # autotune and compile on a throwaway model of the same shapes: the timed one starts at its init
        w_model, w_scored, w_opts, _ = build(system, cfg, train, device)
        w_stream = TrainStream(bins, train["batch_size"], train["seq_len"], train["seed"] + 1)
        # the timed step's own path (graphs, clip, firewall, `step(ok=...)`): the optimizer's graphs compile here too
        w_step = stepper(w_model, w_scored, w_opts)
        t = time.time()
        for _ in range(warmup_steps):
            x, y = (a.to(device) for a in w_stream.next_batch())
            loss = w_step(x, y, Counter(), "warm-up")
        w_step.firewall.read("warm-up")
        evaluate(w_scored, ex[: train["batch_size"]], ey[: train["batch_size"]], train["batch_size"], device, train["dtype"], Counter())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        log(f"{name}: warm-up {warmup_steps} steps + one eval batch on a throwaway model: {time.time() - t:.1f} s")
        del w_model, w_scored, w_opts, w_step, w_stream, loss, x, y  # the loss's autograd chain holds the graphs too
        gc.collect()  # a GraphedLoss sits in a reference cycle: free its graphs and pool before the clock starts
        if device.type == "cuda":
            torch.cuda.empty_cache()

    torch.manual_seed(train["seed"])
    model, scored, opts, note = build(system, cfg, train, device)
    stream = TrainStream(bins, train["batch_size"], train["seq_len"], train["seed"])
    step_fn = stepper(model, scored, opts)
    rows, spent, step, next_eval = [], 0.0, 0, 0.0
    warm = max(1, int(PROGRESS_STEPS * train["warmup_steps"] / train["steps"]))  # the preset's warmup share
    model.train()
    if graphs == "graphed":  # captured off the clock; any batch of the shape will do (a capture changes no weight)
        blank = torch.zeros((train["batch_size"], train["seq_len"]), dtype=torch.long, device=device)
        step_fn.capture(blank, blank)
    note += f"; cuda_graphs {graphs}; {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"  # H100 or H200
    ckpt_root = state_dir / name.replace(":", "_") if state_dir else None
    last, snap = resume(ckpt_root, model, opts)
    if last is not None:
        key = {**(run_key or {}), "system": name, "budget_s": budget_s, "eval_every_s": eval_every_s}
        if snap["run_key"] != key:
            raise SystemExit(f"{last}: saved for {snap['run_key']}, not {key}: another run (a changed budget or "
                             f"eval interval would change its schedule); use another --state")
        stream.state = StreamState(**snap["stream"])
        rows, spent, step, next_eval = snap["rows"], snap["spent"], snap["step"], snap["next_eval"]
        step_fn.firewall.resume(snap["bad_in_row"])
        log(f"{name}: resumed from {last} at {spent:.1f} training seconds, step {step}")
    start_s = spent
    while True:
        if spent >= next_eval or spent >= budget_s:
            bpb = evaluate(scored, ex, ey, train["batch_size"], device, train["dtype"], counters)
            read = step * train["batch_size"] * train["seq_len"]
            rows.append({"system": name, "train_s": round(spent, 1), "step": step, "bytes": read,
                         "passes": round(read / stream.epoch_bytes, 4),  # past 1 the curve measures memorising too
                         "eval_bpb": round(bpb, 5), "eval_bytes": eval_bytes, "note": note})
            log(f"{name}: {json.dumps(rows[-1])}")
            while next_eval <= spent:  # past every point this eval covers: a slow stretch that crossed two would
                next_eval += eval_every_s  # leave one due, and a run paused now would repeat this eval on resuming
            if spent >= budget_s:
                return rows
        if pause_s is not None and spent - start_s >= pause_s:  # after any eval due now: resuming repeats none
            path = checkpoint.save(ckpt_root, step, model, opts, {
                "stream": stream.state.to_dict(), "rows": rows, "spent": spent, "next_eval": next_eval,
                "bad_in_row": step_fn.firewall.bad_in_row,
                "run_key": {**(run_key or {}), "system": name, "budget_s": budget_s, "eval_every_s": eval_every_s}})
            log(f"{name}: paused at {spent:.1f} of {budget_s} training seconds, step {step}: saved {path}")
            return rows
        t = time.time()
        progress = min(int(PROGRESS_STEPS * spent / budget_s), PROGRESS_STEPS - 1)
        set_lr(opts, wsd_multiplier(progress, PROGRESS_STEPS, warm, train["decay_frac"], train["min_lr_frac"]))
        for _ in range(10):  # ten steps between clock reads: the read syncs the device
            x, y = stream.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            step_fn(x, y, counters, f"step {step}")
            step += 1
        step_fn.firewall.read(f"step {step}")  # the sync that makes the clock honest, and the firewall's abort check
        spent += time.time() - t


def plot(rows: list[dict], path: Path, anchors: Path | None = None) -> None:
    """Both curves, eval BPB against training seconds and against bytes read, with the anchor ladder's
    best rungs (dormouse.tools.plots.best_anchors) when `anchors` (results/<preset>/anchors.json) is given."""
    from dormouse.core.figures import new_figure, save
    from dormouse.tools.plots import ANCHOR_COLORS, best_anchors

    fig, (by_clock, by_bytes) = new_figure(10, 8, rows=2)
    runs = dict.fromkeys((r["system"], r.get("date", "")) for r in rows)  # a TSV of several runs: one curve each
    dated = len({date for _, date in runs}) > 1
    for system, date in runs:
        pts = [r for r in rows if (r["system"], r.get("date", "")) == (system, date)
               and float(r["train_s"]) > 0]  # step 0 is 8 BPB: off scale
        label = f"{system} {date}" if dated else system
        by_clock.plot([float(r["train_s"]) for r in pts], [float(r["eval_bpb"]) for r in pts], "o-", ms=4, label=label)
        by_bytes.plot([int(r["bytes"]) for r in pts], [float(r["eval_bpb"]) for r in pts], "o-", ms=4, label=label)
    ladder = json.loads(anchors.read_text())["ladder"] if anchors else []
    for ax in (by_clock, by_bytes):
        for a, color in zip(best_anchors(ladder), ANCHOR_COLORS, strict=False):
            if a["bpb"] < 3:  # the lower rungs would stretch the axis past the curves
                ax.axhline(a["bpb"], ls="--", lw=1.2, color=color, label=f"{a['name']}-{a['order']} {a['bpb']:.2f}")
        ax.set_ylabel("eval bits per byte")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=9)
    by_clock.set_xlabel("training seconds (eval off the clock)")
    by_clock.set_title("held-out BPB at equal wall-clock (same data, eval window, optimizer split, schedule on the clock)",
                       fontsize=10)
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("bytes read")
    save(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", help="a pretrain job JSON (dormouse plan --stage pretrain), file or @file")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--budget-s", type=float, default=600.0, help="training seconds per system (eval excluded)")
    ap.add_argument("--eval-every-s", type=float, default=60.0)
    ap.add_argument("--warmup-steps", type=int, default=5, help="steps on a throwaway model before the clock starts")
    ap.add_argument("--pause-after-s", type=float, default=None,
                    help="stop after this many training seconds in this call and save the run in --state for the next")
    ap.add_argument("--model-preset", default=None,
                    help="train this preset's model (its model and train sections: lr, schedule shape, optimizer) on the "
                         "job's shards, scored on the job's eval window (eval_bytes, seq_len, batch_size and device stay "
                         "the job's, so every system reads and is scored alike); rows are labelled <system>:<preset>")
    ap.add_argument("--state", type=Path, default=None, help="directory of paused runs: one is resumed when present")
    ap.add_argument("--out", type=Path, default=None, help="TSV of the curve rows")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of both curves")
    ap.add_argument("--anchors", type=Path, default=None, help="the preset's anchors.json: its best rungs on the plot")
    ap.add_argument("--from-tsv", type=Path, nargs="+", default=None,
                    help="plot these TSVs (--out files, or a record's quality_h200.tsv under benchmarks/records/) instead of training")
    args = ap.parse_args(argv)
    if args.from_tsv:
        rows = [r for f in args.from_tsv for r in csv.DictReader(f.open(encoding="utf-8"), delimiter="\t")]
        if not rows or args.plot is None:
            ap.error("--from-tsv needs --plot and at least one row")
        plot(rows, args.plot, args.anchors)
        return 0
    if not args.job:
        ap.error("--job is required (unless --from-tsv)")
    if args.pause_after_s is not None and args.state is None:
        ap.error("--pause-after-s needs --state (where the paused run is saved)")
    text = args.job[1:] if args.job.startswith("@") else args.job
    job = json.loads(Path(text).read_text() if not text.lstrip().startswith("{") else text)
    cfg, train = ModelConfig.from_dict(job["params"]["model"]), dict(job["params"]["train"])
    if train["device"] == "cuda" and not torch.cuda.is_available():
        train["device"] = "cpu"
        print("[quality] no CUDA device: running on CPU (numbers are not H200 numbers)", flush=True)
    if args.model_preset:  # another preset's model on this job's data and eval window
        other = load_preset(args.model_preset)
        cfg = ModelConfig.from_dict(other["model"])
        train = {**other["train"], **{k: train[k] for k in ("eval_bytes", "seq_len", "batch_size", "device")}}
    device = torch.device(train["device"])
    shards = input_artifact(job, "shard")
    print(f"[quality] {versions()}; {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
    rows = []
    for system in args.systems:
        label = f"{system}:{args.model_preset}" if args.model_preset else system
        rows += train_for(system, cfg, train, shards, device, args.budget_s, args.eval_every_s, args.warmup_steps,
                          lambda m: print(f"[quality] {m}", flush=True), args.pause_after_s, args.state,
                          {"job": job["digest"]}, label)
    keys = ["system", "train_s", "step", "bytes", "passes", "eval_bpb", "eval_bytes", "note"]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\t".join(keys) + "\n" + "".join("\t".join(str(r.get(k, "")) for k in keys) + "\n" for r in rows))
    if args.plot:
        plot(rows, args.plot, args.anchors)
    curves = {}
    for r in rows:
        curves.setdefault(r["system"], []).append(r)
    for system, curve in curves.items():
        if curve[-1].get("passes", 0) > 1:
            print(f"[quality] {system} read the train shards {curve[-1]['passes']:g} times: past one pass its curve measures "
                  f"memorising as well as learning (a larger corpus, or a shorter --budget-s, keeps it to one)")
    print(f"\n{'system':<8} {'train_s':>8} {'steps':>7} {'bytes':>13} {'passes':>7} {'eval_bpb':>9}  best (at s)")
    for system, curve in curves.items():
        last, best = curve[-1], min(curve, key=lambda r: r["eval_bpb"])
        paused = f"  (paused: {args.budget_s:g} s not reached)" if float(last["train_s"]) < args.budget_s else ""
        print(f"{system:<8} {last['train_s']:>8} {last['step']:>7} {last['bytes']:>13,} {last.get('passes', ''):>7} "
              f"{last['eval_bpb']:>9}  {best['eval_bpb']} ({best['train_s']}){paused}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
