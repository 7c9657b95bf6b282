"""bench: score every model the chain made — pretrain, sft, rl and each exported rung of rl.

    dormouse bench --job "$(dormouse plan --preset tiny --stage bench)"

Per model: held-out corpus BPB on the pretrain eval window (stages here; rungs as export measured
them on the same window), and task scores:
- tasks_mc: the verifiable families as byte-level multiple choice (context = the chat prompt,
  choice = answer + END; distractors from dormouse/posttrain/tasks.py), `acc` and `acc_bytes` (dormouse/posttrain/mc.py);
- tasks_gen: greedy generation exact match on the same held-out items sft and rl report, with each item's
  correctness, so that `paired` compares sft with pretrain, rl with sft and each rung with bf16 item by item (the
  sign test rl's acceptance reads);
- cloze: real continuations of the eval tail against real spans from elsewhere in it;
- every lm-eval-style jsonl file under config `bench_tasks` (question, choices, answer).
An item longer than the window (the eval seq_len) is dropped and counted, never truncated.
bench.json also carries the anchor ladder and every upstream stage's final numbers, counters and
wall time; `dormouse view bench` adds the digest chain and the retractions applied.

A chain with a qat key on (train.qat, sft.qat, rl.qat) has a twin, the same preset with every qat key off (planned
by dormouse/planner/plan.py, input `export_ptq`): its rungs, quantized after training, are scored as `rungs_ptq`
beside this chain's `rungs` (each with export's `method`: "qat" for the rung rl trained through), and `qat` holds
the lineage of stages that trained through a rung.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np

from dormouse.data import shards as layout
from dormouse.data.byte_stream import eval_window
from dormouse.core import progress
from dormouse.data.raw import expand_raw
from dormouse.planner.job import check_raw_input, input_artifact, parse_job, summary, writer
from dormouse.posttrain import mc, task_eval
from dormouse.posttrain.settings import TaskSettings
from dormouse.model import quant
from dormouse.train.runtime import deterministic_cpu, device_for, evaluate, load_model, model_config_of

BENCH_FORMAT = 5  # the layout of bench.json (documented in docs/posttraining.md); 2: items_correct and paired; 3: paired per
# distinct prompt (units); 4: within_one_se, and a QAT chain's rungs against its twin's bf16 (rungs_vs_twin_bf16);
# 5: held-out items are distinct prompts (tasks.distinct_items), counted per cell in heldout_cells


def score_model(model, suites: dict[str, list[mc.McItem]], heldout, params, device, counters) -> dict:
    window = params["eval"]["seq_len"]
    scores = {name: mc.evaluate_mc(model, items, window, device, counters) for name, items in suites.items()}
    scores["tasks_gen"] = task_eval.heldout_accuracy(model, heldout, TaskSettings.of(params["tasks"]), device, params["dtype"], per_item=True)
    return scores


def paired(base: dict, new: dict, prompts: list[str]) -> dict:
    """`new` against `base` on the same held-out items, greedy: the paired sign test over distinct prompts
    (task_eval.paired_sign; `units` of them), the accuracy difference over every item, and the standard error of
    base's accuracy (what "within one standard error" reads)."""
    b, n = base["tasks_gen"], new["tasks_gen"]
    sign = task_eval.paired_sign([c == "1" for c in b["items_correct"]], [c == "1" for c in n["items_correct"]], prompts)
    p = b["correct"] / b["n"]
    delta, se = (n["correct"] - b["correct"]) / b["n"], (p * (1 - p) / b["n"]) ** 0.5
    return {**sign, "z": round(sign["z"], 3), "n": b["n"], "delta_accuracy": round(delta, 5), "se_base": round(se, 5),
            "within_one_se": abs(delta) <= se}


def comparisons(models: dict, rungs: dict, rungs_ptq: dict | None, prompts: list[str]) -> dict:
    """The paired comparisons a reader of bench.json asks for: did sft and rl each improve on the stage before (rl's
    acceptance: z >= 2 against sft), and does each rung keep the bf16 model's answers (QAT's acceptance)."""
    out = {"sft_vs_pretrain": paired(models["pretrain"], models["sft"], prompts),
           "rl_vs_sft": paired(models["sft"], models["rl"], prompts)}
    for key, rows in (("rungs_vs_bf16", rungs), ("rungs_ptq_vs_bf16", rungs_ptq)):
        if rows and "bf16" in rows:
            out[key] = {r: paired(rows["bf16"], s, prompts) for r, s in rows.items() if r != "bf16"}
    if rungs_ptq and "bf16" in rungs_ptq:  # #28's bar: each rung against the bf16 model of the same budget (the twin's
        # bf16, trained without any qat key), not this chain's own bf16, which the finish may already have moved
        out["rungs_vs_twin_bf16"] = {r: paired(rungs_ptq["bf16"], s, prompts) for r, s in rungs.items()}
    return out


def score_rungs(export_art, label: str, suites, heldout, params, device, eval_bytes: int, c) -> dict:
    """Every rung file of an export artifact loaded back and scored; BPB and bytes as export measured them."""
    export = export_art.manifest["final"]
    if export["eval_bytes"] != eval_bytes:
        raise SystemExit(f"bench: export {export_art.digest} scored {export['eval_bytes']} eval bytes, bench {eval_bytes}: "
                         "not one window")
    cfg = model_config_of(export_art.path)
    rungs = {}
    for rung, r in export["rungs"].items():
        model = quant.load_rung_model(export_art.file(r["file"]), cfg, device)
        counters = Counter()
        rungs[rung] = {"bytes": r["bytes"], "bpb": r["bpb"], "delta_bpb_vs_bf16": r["delta_bpb_vs_bf16"],
                       **({"method": r["method"]} if "method" in r else {}),
                       "eval_bytes": eval_bytes, **score_model(model, suites, heldout, params, device, counters)}
        c.update({f"{label}@{rung}.{k}": v for k, v in counters.items()})
        progress.note(f"[bench] {label}@{rung}: bpb {r['bpb']:.4f} tasks_gen {rungs[rung]['tasks_gen']['accuracy']}")
    return rungs


def upstream_summary(art) -> dict:
    m = art.manifest
    return {"digest": art.digest, "final": m.get("final"), "counters": m["counters"],
            "wall_time_s": m.get("wall_time_s"), "device": m["environment"].get("device"),
            **({"warnings": m["warnings"]} if m.get("warnings") else {})}  # the run's closing summary prints them


def main(argv=None) -> int:
    job = parse_job(argv, "bench", __doc__)
    params = job["params"]
    device = device_for(params["device"], "bench")
    deterministic_cpu(device)
    names = ("pretrain", "sft", "rl", "export", "anchors", "shard") + (("export_ptq",) if "export_ptq" in job["inputs"] else ())
    arts = {name: input_artifact(job, name) for name in names}
    tail_path = layout.eval_bin(arts["shard"])
    ex, ey, eval_bytes = eval_window(tail_path, params["eval"]["eval_bytes"], params["eval"]["seq_len"])
    heldout = task_eval.heldout_items(TaskSettings.of(params["tasks"]))
    cz = params["bench"]["cloze"]
    suites = {
        "tasks_mc": task_eval.mc_items(heldout, params["bench"]["mc_choices"]),
        "cloze": mc.cloze_items(np.fromfile(tail_path, dtype=np.uint8).tobytes(), cz["items"], cz["context_bytes"],
                                cz["span_bytes"], cz["choices"], cz["seed"]),
    }
    extra_files = []
    if "bench_tasks" in job["inputs"]:
        for spec in check_raw_input(job, "bench_tasks"):
            for f in expand_raw(spec):
                if f.name.endswith(".jsonl"):
                    suites[f"file:{f.name}"] = mc.load_jsonl_task(f)
                    extra_files.append(str(f))

    with writer(job) as art:
        c = art.counters
        models, t0 = {}, time.time()
        for stage in ("pretrain", "sft", "rl"):
            model, _ = load_model(arts[stage], device)
            model.eval()
            counters = Counter()
            bpb = evaluate(model, ex, ey, params["eval"]["batch_size"], device, params["dtype"], counters)
            models[stage] = {"bpb": round(bpb, 5), "eval_bytes": eval_bytes,
                             **score_model(model, suites, heldout, params, device, counters)}
            c.update({f"{stage}.{k}": v for k, v in counters.items()})
            progress.note(f"[bench] {stage}: bpb {bpb:.4f} tasks_gen {models[stage]['tasks_gen']['accuracy']}")
        export = arts["export"].manifest["final"]
        rungs = score_rungs(arts["export"], "rl", suites, heldout, params, device, eval_bytes, c)
        twin = {}
        if "export_ptq" in arts:
            twin = {"rungs_ptq": score_rungs(arts["export_ptq"], "ptq", suites, heldout, params, device, eval_bytes, c),
                    "rungs_ptq_of": "the same preset with train.qat, sft.qat and rl.qat off (its own pretrain, sft and "
                                    "rl), every rung quantized after training"}
        anchors = json.loads(arts["anchors"].file("anchors.json").read_text())
        if anchors["eval_bytes"] != eval_bytes:
            raise SystemExit(f"bench: the anchors scored {anchors['eval_bytes']} eval bytes, bench {eval_bytes}: not one window")
        bench = {
            "format": BENCH_FORMAT,
            "eval_window": {"bytes": eval_bytes, "seq_len": params["eval"]["seq_len"], "source": f"{layout.EVAL_BIN} from its start"},
            "anchors": anchors,
            "stages": models,
            "rungs": rungs,
            "rungs_of": "rl",
            **twin,
            "paired": comparisons(models, rungs, twin.get("rungs_ptq"), [it.prompt for it in heldout]),
            **({"qat": export["qat"]} if "qat" in export else {}),
            "reference_bpb_fp32": export["reference_bpb"],
            "suites": {name: {"items": len(items)} for name, items in suites.items()},
            "extra_task_files": extra_files,
            "heldout_items": len(heldout),
            "heldout_cells": task_eval.cell_counts(heldout),
            "upstream": {name: upstream_summary(a) for name, a in arts.items()},
            "scoring_wall_time_s": round(time.time() - t0, 2),
        }
        art.path("bench.json").write_text(json.dumps(bench, indent=1) + "\n")
        summary("bench", c)
    return 0
