"""Plots of one preset's bench: training curves against the anchor ladder, export rungs, task scores.

    python -m dormouse.tools.plots --bench results/tiny/bench.json --store results/store --out-dir results/tiny/plots

Writes exactly three PNGs into --out-dir (matplotlib's Agg canvas, no pyplot, no display):
- curves.png: pretrain train BPB per logged step and eval BPB, sft's and rl's eval BPB on the same window,
  against the best n-gram anchors and the ladder's rungs just above and below the model (the legend sits
  outside the axes; a QAT finish's evals, through its rung, are drawn apart); below it the sft train BPB and the
  rl mean reward, one post-training step axis;
- rungs.png: each export rung's bytes on disk (log x) against its ΔBPB vs bf16 (BPB when bf16 is absent); a QAT
  chain's rungs (the one rl trained through marked "qat") beside its PTQ twin's (`rungs_ptq`: the same preset
  with every qat key off), both as BPB, since each series has its own bf16;
- tasks.png: grouped bars of task scores per model (pretrain, sft, rl, rl@<rung>, and a QAT chain's ptq@<rung>)
  against chance (1/choices, read from the bench artifact's params) and the best constant reply; a null score is
  written "n/a", a true zero "0".
The curves come from each stage's metrics.jsonl in the store, found through bench.json's
`upstream.<stage>.digest`; the rest is bench.json alone (dormouse/schemas/bench.schema.yaml).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dormouse.core.figures import new_figure, save
from dormouse.core.store import ArtifactError, open_artifact

CURVE_STAGES = ("pretrain", "sft", "rl")
RUNG_ORDER = ("bf16", "int8", "fp8", "mxfp4", "nvfp4", "ternary")  # widest first, as export writes them
TASK_SCORES = (  # (bench key, field, bar label)
    ("tasks_gen", "accuracy", "tasks_gen accuracy"),
    ("tasks_mc", "acc", "tasks_mc acc"),
    ("tasks_mc", "acc_bytes", "tasks_mc acc_bytes"),
    ("cloze", "acc", "cloze acc"),
)
ANCHOR_COLORS = ("tab:gray", "tab:purple", "tab:brown")  # one per line best_anchors keeps


# ---------------------------------------------------------------------------------------------
# inputs


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl; blank lines skipped, a malformed line is an error naming file:line."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not a JSON row ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def stage_metrics(store: Path, stage: str, digest: str) -> list[dict]:
    """metrics.jsonl of `<store>/<stage>/<digest>/`, checked against its manifest by the store's reader."""
    art_dir = Path(store) / stage / digest
    if not art_dir.is_dir():
        raise FileNotFoundError(f"{art_dir}: no {stage} artifact there (bench.json upstream.{stage}.digest "
                                f"{digest}); is --store the store bench ran against?")
    return read_metrics(open_artifact(art_dir, stage=stage).file("metrics.jsonl"))


def load_inputs(bench_path: str | Path, store: str | Path) -> dict:
    """{"bench": bench.json, "metrics": {stage: rows}} for pretrain, sft and rl."""
    bench = json.loads(Path(bench_path).read_text())
    metrics = {}
    for stage in CURVE_STAGES:
        up = bench.get("upstream", {}).get(stage)
        if not up or "digest" not in up:
            raise ValueError(f"{bench_path}: no upstream.{stage}.digest")
        metrics[stage] = stage_metrics(Path(store), stage, up["digest"])
    link = next((c for c in bench.get("digest_chain", []) if c.get("stage") == "bench"), None)
    bench_params = {}
    if link is not None and (Path(store) / "bench" / link["digest"]).is_dir():  # the choices behind the chance lines
        bench_params = open_artifact(Path(store) / "bench" / link["digest"], stage="bench").manifest["params"]["bench"]
    return {"bench": bench, "metrics": metrics, "bench_params": bench_params}


# ---------------------------------------------------------------------------------------------
# helpers


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the rows that hold a number under `key`."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def best_anchors(ladder: list[dict]) -> list[dict]:
    """The rungs worth a line: unigram, and backoff and kneser_ney at their highest order (uniform,
    8 BPB, and the lower orders would only crowd the plot)."""
    picked = [a for a in ladder if a["name"] == "unigram"][:1]
    for name in ("backoff", "kneser_ney"):
        same = [a for a in ladder if a["name"] == name]
        if same:
            picked.append(max(same, key=lambda a: a["order"]))
    return sorted(picked, key=lambda a: -a["bpb"])


def neighbour_anchors(ladder: list[dict], bpb: float | None, already: list[dict]) -> list[dict]:
    """The ladder's rungs just above and just below `bpb` (uniform aside), unless already drawn."""
    if bpb is None:
        return []
    rungs = [a for a in ladder if a["name"] != "uniform" and a not in already]
    above = [a for a in rungs if a["bpb"] > bpb]
    below = [a for a in rungs if a["bpb"] <= bpb]
    return ([min(above, key=lambda a: a["bpb"])] if above else []) + ([max(below, key=lambda a: a["bpb"])] if below else [])


def ordered_rungs(rungs: dict) -> list[str]:
    return [r for r in RUNG_ORDER if r in rungs] + sorted(r for r in rungs if r not in RUNG_ORDER)


def score(scores: dict, key: str, field: str) -> float:
    """A task score, NaN when absent or null (drawn as missing, not zero)."""
    v = (scores.get(key) or {}).get(field)
    return float(v) if isinstance(v, (int, float)) else math.nan


# ---------------------------------------------------------------------------------------------
# plots


def plot_curves(data: dict, path: Path) -> None:
    bench, metrics = data["bench"], data["metrics"]
    fig, (top, bottom) = new_figure(10, 8, rows=2)

    steps, bpb = series(metrics["pretrain"], "bpb")
    top.plot(steps, bpb, lw=1, alpha=0.8, label="train BPB")
    plain = [r for r in metrics["pretrain"] if "eval_rung" not in r]
    steps, eval_bpb = series(plain, "eval_bpb")
    top.plot(steps, eval_bpb, "o-", ms=4, label="pretrain eval BPB")
    finish = [r for r in metrics["pretrain"] if "eval_rung" in r]  # a QAT finish: the forward through its rung
    q_steps, q_bpb = series(finish, "eval_bpb")
    if q_steps:
        top.plot(q_steps, q_bpb, "D-", ms=5, color="C3", label=f"pretrain eval BPB through {finish[-1]['eval_rung']} (QAT finish)")
        eval_bpb, steps = eval_bpb + q_bpb, steps + q_steps
    last = max(steps, default=0)
    shown = list(eval_bpb)
    for stage, marker in (("sft", "s"), ("rl", "^")):  # the post-trained models on the same window, at the right edge
        v = (bench.get("stages", {}).get(stage) or {}).get("bpb")
        if isinstance(v, (int, float)):
            top.plot([last], [v], marker, ms=7, label=f"{stage} eval BPB {v:.3f}")
            shown.append(v)
    # labelled in the legend: the best two rungs often sit under 0.1 BPB apart, too close for inline text
    ladder = bench.get("anchors", {}).get("ladder", [])
    for a, color in zip(best_anchors(ladder), ANCHOR_COLORS):
        top.axhline(a["bpb"], ls="--", lw=1.2, color=color, label=f"{a['name']}-{a['order']} {a['bpb']:.2f}")
        shown.append(a["bpb"])
    final = eval_bpb[-1] if eval_bpb else None
    for a in neighbour_anchors(ladder, final, best_anchors(ladder)):  # where the model falls on the ladder
        top.axhline(a["bpb"], ls=":", lw=1.4, color="tab:olive" if a["bpb"] > final else "tab:cyan",
                    label=f"{a['name']}-{a['order']} {a['bpb']:.2f} ({'above' if a['bpb'] > final else 'below'} the model)")
        shown.append(a["bpb"])
    if shown:  # every anchor and eval point inside the axes, none on an edge; the train curve may start off scale
        lo, hi = min(shown), max(shown + [min(bpb[len(bpb) // 10:] or [0])])
        pad = 0.08 * max(hi - lo, 0.1)
        top.set_ylim(lo - pad, hi + pad)
    window = bench.get("eval_window", {}).get("bytes")
    top.set_title(f"{bench.get('preset', '?')}: pretrain BPB against n-gram anchors (dashed)\n"
                  f"both on the eval window's bytes{f' ({window:,} B)' if window else ''}; the anchors' context "
                  f"is the document, the model's its row", fontsize=10)
    top.set_xlabel("pretrain step")
    top.set_ylabel("bits per byte")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: it never covers a line
    top.grid(alpha=0.3)

    sft_steps, sft_bpb = series(metrics["sft"], "bpb")
    rl_steps, reward = series(metrics["rl"], "reward")
    offset = max(sft_steps, default=0)
    bottom.plot(sft_steps, sft_bpb, color="C0", label="sft train BPB (assistant bytes)")
    bottom.set_ylabel("sft BPB", color="C0")
    right = bottom.twinx()
    right.plot([s + offset for s in rl_steps], reward, color="C3", label="rl mean reward")
    right.set_ylabel("rl mean reward", color="C3")
    right.set_ylim(-0.05, 1.05)
    if sft_steps and rl_steps:
        bottom.axvline(offset, color="gray", lw=1, ls=":")
    bottom.set_xlabel("post-training step (sft, then rl)")
    bottom.set_title("sft loss and rl reward", fontsize=10)
    lines = bottom.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    bottom.legend(lines[0] + more[0], lines[1] + more[1], loc="center right")
    bottom.grid(alpha=0.3)
    save(fig, path)


def rung_series(bench: dict) -> tuple[str, list[tuple[str, list[tuple[str, int, float, bool]]]]]:
    """(y key, [(series label, [(rung, bytes, y, trained through it)])]) for rungs.png: one series of this chain's
    rungs as ΔBPB vs bf16 (BPB without a bf16 rung), or, with a PTQ twin, this chain's and the twin's as BPB."""
    chains = [(f"export rungs of {bench.get('rungs_of', 'rl')}", bench["rungs"])]
    if bench.get("rungs_ptq"):
        lineage = ", ".join(f"{q['stage']} {q['rung']}" for q in bench.get("qat", [])) or "none trained through"
        chains = [(f"QAT chain ({lineage})", bench["rungs"]), ("PTQ twin (the preset with qat off)", bench["rungs_ptq"])]
    use_delta = len(chains) == 1 and any(r.get("delta_bpb_vs_bf16") is not None for r in bench["rungs"].values())
    key = "delta_bpb_vs_bf16" if use_delta else "bpb"
    return key, [(label, [(r, rungs[r]["bytes"], rungs[r][key], rungs[r].get("method") == "qat")
                          for r in ordered_rungs(rungs) if rungs[r].get(key) is not None]) for label, rungs in chains]


def plot_rungs(bench: dict, path: Path) -> None:
    key, chains = rung_series(bench)
    use_delta = key == "delta_bpb_vs_bf16"
    fig, (ax,) = new_figure(7, 5)
    for j, (label, points) in enumerate(chains):
        ax.plot([p[1] for p in points], [p[2] for p in points], "os"[j % 2], color=f"C{j}", label=label)
        for i, (r, x, y, trained) in enumerate(points):  # int8 and fp8 share a size: labels above, below in turn
            name = f"{r} (qat)" if trained else r
            ax.annotate(f"{name} {y:+.4f}" if use_delta else f"{name} {y:.4f}", (x, y), textcoords="offset points",
                        xytext=(6, 5 if (i + j) % 2 == 0 else -13), fontsize=9, color=f"C{j}")
    ax.set_xscale("log")
    ax.set_xlabel("bytes on disk (log)")
    if use_delta:
        ax.axhline(0, color="gray", lw=1, ls="--")
        ax.set_ylabel("ΔBPB vs bf16")
        title = f"export rungs of {bench.get('rungs_of', 'rl')}: size against ΔBPB vs bf16"
    elif len(chains) > 1:
        ax.set_ylabel("BPB")
        title = "export rungs: the QAT chain's against its PTQ twin's, size against BPB"
        ax.legend(fontsize=8)
    else:
        ax.set_ylabel("BPB")
        title = f"export rungs of {bench.get('rungs_of', 'rl')}: size against BPB (no bf16 rung, so no ΔBPB)"
    missing = [r for r in ordered_rungs(bench["rungs"]) if bench["rungs"][r].get(key) is None]
    if missing:
        title += f"\nnot shown (null {key}): {', '.join(missing)}"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    save(fig, path)


def plot_tasks(bench: dict, path: Path, bench_params: dict | None = None) -> None:
    models = {s: bench["stages"][s] for s in CURVE_STAGES if s in bench["stages"]}
    models.update({f"{bench.get('rungs_of', 'rl')}@{r}" + (" (qat)" if bench["rungs"][r].get("method") == "qat" else ""):
                   bench["rungs"][r] for r in ordered_rungs(bench["rungs"])})
    models.update({f"ptq@{r}": bench["rungs_ptq"][r] for r in ordered_rungs(bench.get("rungs_ptq") or {})})
    names = list(models)
    width = 0.8 / len(TASK_SCORES)
    fig, (ax,) = new_figure(max(7, 1.1 * len(names) + 2), 5)
    for j, (key, field, label) in enumerate(TASK_SCORES):
        xs = [i + (j - (len(TASK_SCORES) - 1) / 2) * width for i in range(len(names))]
        vals = [score(models[m], key, field) for m in names]
        ax.bar(xs, vals, width, label=label, color=f"C{j}")
        for x, v in zip(xs, vals):  # a missing score and a true zero look alike as bars: say which
            if math.isnan(v) or v == 0:
                ax.text(x, 0.01, "n/a" if math.isnan(v) else "0", ha="center", va="bottom",
                        rotation=90 if math.isnan(v) else 0, fontsize=8,
                        color=f"C{j}")
    # what a score must beat: chance among the choices, and the best constant reply on the generation items
    params = bench_params or {}
    if params.get("mc_choices"):
        ax.axhline(1 / params["mc_choices"], color="C1", ls="--", lw=1, label=f"tasks_mc chance (1/{params['mc_choices']})")
    if (params.get("cloze") or {}).get("choices"):
        k = params["cloze"]["choices"]
        ax.axhline(1 / k, color="C3", ls=":", lw=1.2, label=f"cloze chance (1/{k})")
    const = next((m["tasks_gen"]["constant_baseline"] for m in models.values()
                  if isinstance((m.get("tasks_gen") or {}).get("constant_baseline"), (int, float))), None)
    if const is not None:
        ax.axhline(const, color="C0", ls="-.", lw=1, label=f"tasks_gen constant reply {const:.3f}")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("score")
    ax.set_title(f"{bench.get('preset', '?')}: task scores per model against chance (n/a = null: no item fit the "
                 "window; 0 = none right)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="y")
    save(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dormouse.tools.plots", description=__doc__.splitlines()[0])
    ap.add_argument("--bench", required=True, help="results/<preset>/bench.json")
    ap.add_argument("--store", default="results/store", help="the artifact store bench ran against")
    ap.add_argument("--out-dir", required=True, help="gets curves.png, rungs.png, tasks.png")
    args = ap.parse_args(argv)
    try:
        data = load_inputs(args.bench, args.store)
    except (FileNotFoundError, ArtifactError, ValueError) as e:
        raise SystemExit(f"plots: {e}") from None
    out = Path(args.out_dir)
    plot_curves(data, out / "curves.png")
    plot_rungs(data["bench"], out / "rungs.png")
    plot_tasks(data["bench"], out / "tasks.png", data.get("bench_params"))
    print(f"[plots] wrote curves.png, rungs.png, tasks.png to {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
