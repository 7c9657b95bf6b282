"""Which prompts can RL learn from (issue #23 item 1): for a post-trained model, per task family x difficulty, the
distribution of per-prompt pass rates over G samples on rl-split prompts (the ones the rl stage trains on).

A group of G samples of one prompt teaches only if its rewards differ: with the prompt's pass rate p that happens
with probability 1 - p^G - (1 - p)^G. A cell whose mean pass rate is 0.3 can still be useless when its prompts are
each ~0 or ~1; this script measures the per-prompt rates instead of assuming them.

    python3 -m benchmarks.rl_diagnosis --artifact results/store/sft/<digest> --group-size 8 --prompts-per-cell 64 \
        --out $OUT/rl_diagnosis.tsv --json $OUT/rl_diagnosis.json
    .venv/bin/python -m benchmarks.rl_diagnosis --artifact <a tiny sft artifact> --prompts-per-cell 4   # CPU

Rows (one per cell, then "all"): prompts (items drawn as rl draws them), distinct_prompts (a small cell repeats), G, pass1 (mean of k/G), passG (share with k >= 1: pass@G), informative
(share with 0 < k < G: groups rl trains on), informative_if_uniform (1 - p^G - (1 - p)^G at the cell's mean p:
what a cell of equal prompts would give), greedy (exact match of the greedy reply on the same prompts), malformed
(share of samples), k_hist (prompts with k = 0..G successes). Sampling uses the rl stage's temperature and top-k
by default and a seeded CPU generator.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from dormouse.core.store import open_artifact  # noqa: E402
from dormouse.data import chat
from dormouse.posttrain import task_eval, tasks  # noqa: E402
from dormouse.posttrain.decode import generate  # noqa: E402
from dormouse.train.runtime import autocast, deterministic_cpu, load_model, uses_bf16  # noqa: E402

KEYS = ["family", "difficulty", "prompts", "distinct_prompts", "G", "pass1", "passG", "informative", "informative_if_uniform", "greedy",
        "malformed", "k_hist"]


def informative_if_uniform(p: float, g: int) -> float:
    return 1.0 - p**g - (1.0 - p) ** g


def cell_row(family: str, difficulty, ks: list[int], g: int, greedy: list[bool], malformed: int,
             distinct: int | None = None) -> dict:
    """distinct: how many different prompts the n items ask (a one-digit cell repeats its few; default n)."""
    n = len(ks)
    p = sum(ks) / (n * g)
    hist = Counter(ks)
    return {"family": family, "difficulty": difficulty, "prompts": n, "distinct_prompts": n if distinct is None else distinct, "G": g, "pass1": round(p, 4),
            "passG": round(sum(k > 0 for k in ks) / n, 4), "informative": round(sum(0 < k < g for k in ks) / n, 4),
            "informative_if_uniform": round(informative_if_uniform(p, g), 4),
            "greedy": round(sum(greedy) / n, 4), "malformed": round(malformed / (n * g), 4),
            "k_hist": ",".join(str(hist[k]) for k in range(g + 1))}


@torch.no_grad()
def diagnose(model, items: list[tasks.Item], g: int, max_new: int, temperature: float, top_k, device, dtype: str,
             seed: int, batch_items: int) -> tuple[list[int], list[bool], int]:
    """(successes out of g per item, greedy correctness per item, malformed samples)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ks, malformed = [], 0
    for i in range(0, len(items), batch_items):
        chunk = items[i : i + batch_items]
        with autocast(device, dtype):
            replies = generate(model, [chat.prompt_bytes(it.prompt) for it in chunk], max_new, temperature=temperature,
                               top_k=top_k, generator=gen, samples_per_prompt=g, bf16=uses_bf16(dtype))
        grades = [task_eval.grade(chunk[j // g], r) for j, r in enumerate(replies)]
        malformed += sum(x == "malformed" for x in grades)
        ks += [sum(x == "correct" for x in grades[j * g : (j + 1) * g]) for j in range(len(chunk))]
    greedy = task_eval.correct(model, items, max_new, device, dtype)
    return ks, greedy, malformed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True, help="an sft (or rl) artifact directory")
    ap.add_argument("--group-size", type=int, default=8, help="G: samples per prompt (the rl stage's group_size)")
    ap.add_argument("--prompts-per-cell", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=None, help="default: the preset's rl.temperature, else 1.0")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--difficulties", type=int, nargs="+", default=None, help="default: the preset's tasks.difficulties")
    ap.add_argument("--device", default=None, help="default: cuda when visible")
    ap.add_argument("--batch-items", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="TSV, a row per cell and one for all")
    ap.add_argument("--json", type=Path, default=None, help="the rows plus the run's settings")
    args = ap.parse_args(argv)

    art = open_artifact(args.artifact)
    params = art.manifest["params"]
    task_params = params["tasks"]
    rl = params.get("rl", {})
    temperature = args.temperature if args.temperature is not None else rl.get("temperature", 1.0)
    top_k = args.top_k if args.top_k is not None else rl.get("top_k")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = params["dtype"] if device.type == "cuda" else "float32"
    deterministic_cpu(device)
    model, cfg = load_model(art, device)
    g, n = args.group_size, args.prompts_per_cell
    difficulties = args.difficulties or task_params["difficulties"]
    print(f"[rl_diagnosis] {art.manifest['stage']} {art.path.name} on {device} ({dtype}); G {g}, {n} rl-split prompts "
          f"per cell, T {temperature}, top-k {top_k}", flush=True)
    rows, every_k, every_greedy, every_malformed, every_distinct = [], [], [], 0, 0
    t0 = time.time()
    for fam in task_params["families"]:
        for d in difficulties:
            items = list(tasks.items("rl", fam, d, n))
            ks, greedy, malformed = diagnose(model, items, g, task_params["max_new_bytes"], temperature, top_k, device,
                                             dtype, args.seed, args.batch_items)
            distinct = len({it.prompt for it in items})
            rows.append(cell_row(fam, d, ks, g, greedy, malformed, distinct))
            every_distinct += distinct
            every_k += ks
            every_greedy += greedy
            every_malformed += malformed
            print(f"[rl_diagnosis] {json.dumps(rows[-1])}", flush=True)
    rows.append(cell_row("all", "all", every_k, g, every_greedy, every_malformed, every_distinct))
    learnable = [f"{r['family']}/{r['difficulty']}" for r in rows[:-1] if r["informative"] >= 0.25]
    print(f"\n{'cell':<14} {'pass1':>6} {'passG':>6} {'inform':>7} {'if unif':>8} {'greedy':>7}  k_hist (k = 0..G)")
    for r in rows:
        print(f"{r['family'] + '/' + str(r['difficulty']):<14} {r['pass1']:>6} {r['passG']:>6} {r['informative']:>7} "
              f"{r['informative_if_uniform']:>8} {r['greedy']:>7}  {r['k_hist']}")
    print(f"[rl_diagnosis] cells where at least a quarter of the groups teach: {', '.join(learnable) or 'none'} "
          f"({time.time() - t0:.1f} s)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            w = csv.DictWriter(f, KEYS, delimiter="\t")
            w.writeheader()
            w.writerows(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"artifact": str(art.path), "stage": art.manifest["stage"], "device": str(device),
                                         "dtype": dtype, "G": g, "prompts_per_cell": n, "temperature": temperature,
                                         "top_k": top_k, "seed": args.seed, "rows": rows, "learnable": learnable},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
