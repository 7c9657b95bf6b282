"""export: the final (rl) model in every quantization rung the preset lists, each loaded back and scored.

    dormouse export --job "$(dormouse plan --preset tiny --stage export)"

One file per rung, `rungs/<rung>.safetensors` (packed storage and recipe: dormouse/model/quant.py). Each file
is read back, dequantized into a fresh model (strict keys) and scored on the pretrain eval window; the
manifest's `final.rungs` gives bytes on disk, BPB and dBPB against the bf16 rung (and the unquantized
fp32 model, computed in fp32 without autocast, as `reference_bpb`). Embeddings, head, norms and (unless `quantize_tables`) the Engram
tables stay bf16 in every rung, as does a matrix narrower than an fp4 rung's block (listed and
counted): the recipe in each file lists what was quantized.

When stages trained through a rung (train.qat, sft.qat, rl.qat: the source's config.json `qat` lineage, copied to
`final.qat`), each rung says its `method`: "qat" for the rung the source stage itself trained through (the file's
forward is that training's forward, tests/test_qat.py), "ptq" for every other (quantized after training). A QAT
rung whose file quantizes other tensors than the training did (export.quantize_tables) is "ptq", counted.
"""

from __future__ import annotations

import json
from collections import Counter


from dormouse.data import shards as layout
from dormouse.data.byte_stream import eval_window
from dormouse.core import progress
from dormouse.planner.job import input_artifact, parse_job, summary, writer
from dormouse.model import quant
from dormouse.train.runtime import check_arms_active, deterministic_cpu, device_for, evaluate, load_model


def main(argv=None) -> int:
    job = parse_job(argv, "export", __doc__)
    params = job["params"]
    device = device_for(params["device"], "export")
    deterministic_cpu(device)
    src, shards = input_artifact(job, "rl"), input_artifact(job, "shard")
    model, cfg = load_model(src, device)
    ex, ey, eval_bytes = eval_window(layout.eval_bin(shards), params["eval"]["eval_bytes"], params["eval"]["seq_len"])
    batch = params["eval"]["batch_size"]
    state = quant.rung_source_state(model)
    lineage = json.loads(src.file("config.json").read_text()).get("qat", [])
    last = lineage[-1] if lineage else None
    trained_for = last["rung"] if last and last["stage"] == src.stage and last["steps"] > 0 else None

    with writer(job) as art:
        c = art.counters
        counters = Counter()
        # the reference is computed in fp32: under the preset's bf16 autocast it would be the bf16 rung's arithmetic
        reference = evaluate(model, ex, ey, batch, device, "float32", counters)
        rungs = {}
        for rung in params["export"]["rungs"]:
            path = art.path(f"rungs/{rung}.safetensors")
            path.parent.mkdir(parents=True, exist_ok=True)
            narrow: list[str] = []
            recipe = quant.save_rung(path, state, rung, eligible=quant.eligible_for(rung, params["export"]["quantize_tables"], narrow))
            rung_counters = Counter()
            bpb = evaluate(quant.load_rung_model(path, cfg, device), ex, ey, batch, device, params["dtype"], rung_counters)
            check_arms_active(cfg, rung_counters, f"rung {rung}", "export")
            quantized = sorted(n for n, t in recipe["tensors"].items() if t["rule"] not in ("bf16", "keep"))
            rungs[rung] = {"file": f"rungs/{rung}.safetensors", "bytes": path.stat().st_size, "bpb": round(bpb, 5),
                           "quantized_tensors": len(quantized), "kept_bf16_narrower_than_block": narrow,
                           "rules": recipe["rules"]}
            if lineage:
                rungs[rung]["method"] = "ptq"
                if rung == trained_for and len(quantized) == last["tensors"]:
                    rungs[rung]["method"] = "qat"
                elif rung == trained_for:  # quantize_tables: the file quantizes tensors the training kept bf16
                    c[f"rungs.{rung}.qat_tensors_differ"] = 1
            c[f"rungs.{rung}.kept_bf16_narrower_than_block"] = len(narrow)
            c[f"rungs.{rung}.bytes"] = path.stat().st_size
            progress.note(f"[export] {rung}: {path.stat().st_size:,} bytes, bpb {bpb:.4f}"
                          f"{' (' + rungs[rung]['method'] + ')' if lineage else ''}")
        base = rungs.get("bf16", {}).get("bpb")
        for r in rungs.values():
            r["delta_bpb_vs_bf16"] = None if base is None else round(r["bpb"] - base, 5)
        art.path("config.json").write_text(json.dumps({"model": cfg.to_dict(), "export": params["export"]}, indent=1))
        art.extra["final"] = {"reference_bpb": round(reference, 5), "eval_bytes": eval_bytes, "rungs": rungs,
                              "source": {"stage": src.stage, "digest": src.digest}}
        if lineage:
            art.extra["final"]["qat"] = lineage
        for k, v in counters.items():
            c[f"eval.{k}"] = v
        summary("export", c)
    return 0
