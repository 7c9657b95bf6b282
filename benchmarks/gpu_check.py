"""The Python parts of benchmarks/gpu_check.sh: each prints its verdict line ("<part>: PASS ..." or "<part>: FAIL
...") and exits 0 on PASS, 1 on FAIL.

    gpu_check.py path --set SET --stage rl        the artifact dir the plan gives that stage under --config set=SET
    gpu_check.py view --set SET                   tiny's view folder under --config set=SET (results/tiny@<tag>)
    gpu_check.py chain --set SET                  the chain's manifests show every stage ran on the GPU's paths
    gpu_check.py decode --model DIR               step-by-step decode == what the parallel forward predicts
    gpu_check.py serve --port P                   the openai client streams one chat completion from `dormouse serve`
    gpu_check.py lm-eval-task DIR                 writes the local lm-eval task (the bench's tiny jsonl task)
    gpu_check.py lm-eval-result DIR               `dormouse lm-eval --output_path DIR` scored it on the GPU

They run on the CPU too (the torch paths), which is how tests/test_gpu_check.py checks them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("pretrain", "sft", "rl", "export", "bench")
TASK_JSONL = ROOT / "tests/data/bench_tiny_task.jsonl"


def verdict(part: str, problems: list[str], detail: str) -> int:
    if problems:
        print(f"{part}: FAIL {'; '.join(problems)}", flush=True)
        return 1
    print(f"{part}: PASS {detail}", flush=True)
    return 0


def plan_dir(set_: str, stage: str, preset: str = "tiny") -> Path:
    from dormouse.planner.plan import load_plan

    plan = load_plan(None, set_ or None)
    return Path(plan.artifact_dir(stage, plan.chain[preset][stage]))


def chain(set_: str, preset: str = "tiny") -> int:
    """Every model stage of `preset` under `set_` built, and on the GPU's paths: pretrain's CUDA graphs, compiled
    regions and FLA's chunk kernel; sft's and rl's FLA kernels; every stage's environment a GPU."""
    problems, facts = [], []
    manifests = {}
    for stage in STAGES:
        path = plan_dir(set_, stage, preset) / "manifest.json"
        if not path.exists():
            problems.append(f"{stage} not built ({path})")
            continue
        manifests[stage] = json.loads(path.read_text())
        device = manifests[stage].get("environment", {}).get("device", "cpu")
        if device == "cpu":
            problems.append(f"{stage}'s environment has no GPU ({path})")
    if "pretrain" in manifests:
        c, final = manifests["pretrain"]["counters"], manifests["pretrain"].get("final", {})
        need = {"cuda_graphs.captures": c.get("cuda_graphs.captures", 0),
                "train.kda_path.fla": c.get("train.kda_path.fla", 0),
                "compile regions": c.get("compile.regions", 0)}
        problems += [f"pretrain counted no {k}" for k, v in need.items() if not v]
        if not str(final.get("device", "")).startswith("cuda"):
            problems.append(f"pretrain's final.device is {final.get('device')!r}")
        facts.append(f"pretrain {final.get('eval_bpb', float('nan')):.3f} BPB, {need['cuda_graphs.captures']} graph "
                     f"captures, {c.get('cuda_graphs.replays_this_process', 0)} replays")
    for stage in ("sft", "rl"):
        if stage in manifests:
            c = manifests[stage]["counters"]
            fla = sum(v for k, v in c.items() if k.endswith(("kda_path.fla", "kda_path.fla_recurrent")))
            if not fla:
                problems.append(f"{stage} counted no FLA kernel call (kda_path.fla*)")
            torch_path = sum(v for k, v in c.items() if k.endswith(("kda_path.torch", "kda_path.torch_recurrent")))
            facts.append(f"{stage} FLA {fla} / torch {torch_path} KDA calls")
    if "rl" in manifests and not manifests["rl"]["counters"].get("rl.decode_graphed"):
        problems.append("rl sampled without CUDA graphs (rl.decode_graphed 0)")
    if "rl" in manifests and not manifests["rl"]["counters"].get("rl.replay_bytes"):  # gpu_check.sh sets replay_rows
        problems.append("rl replayed no corpus rows (rl.replay_bytes 0)")
    if "bench" in manifests:
        bench = json.loads((plan_dir(set_, "bench", preset) / "bench.json").read_text())
        facts.append(f"bench format {bench.get('format')}")
    walls = [f"{s} {m.get('wall_time_s', 0):.0f}s" for s, m in manifests.items()]
    return verdict("chain", problems, "; ".join(facts + [", ".join(walls)]))


def decode_agreement(model, prompts: list[bytes], max_new_bytes: int, margin: float = 1e-3) -> dict:
    """Greedy bytes from step-by-step decode (prefill, then one byte a step: the recurrent kernels and the conv
    caches) against the argmax of one parallel forward over prompt + those bytes (the chunk kernels), in fp32.
    Positions whose top two logits are within `margin` (either path may round either way) are counted apart."""
    import torch

    from dormouse.posttrain.decode import generate

    counters, forward = Counter(), Counter()  # the decode's own (its prefill included) and the parallel pass's
    replies = generate(model, prompts, max_new_bytes, temperature=0.0, stop_byte=None, bf16=False, counters=counters)
    device = next(model.parameters()).device
    seqs = [p + r for p, r in zip(prompts, replies, strict=True)]
    width = max(map(len, seqs))  # right-padded to one shape (causal: padding after a row changes none of its logits)
    idx = torch.tensor([list(q) + [0] * (width - len(q)) for q in seqs], dtype=torch.long, device=device)
    checked = mismatched = near_ties = 0
    first_bad = None
    with torch.inference_mode():
        logits, _ = model.prefill(idx, None, forward)
        for i in range(len(prompts)):
            start = len(prompts[i]) - 1  # the logits at position t predict byte t + 1
            lg = logits[i, start:start + len(replies[i])].float()
            top2 = lg.topk(2, -1)
            want = torch.tensor(list(replies[i]), device=device)
            agree = top2.indices[:, 0] == want
            tie = (top2.values[:, 0] - top2.values[:, 1]) < margin
            checked += int((~tie).sum())
            near_ties += int(tie.sum())
            bad = int((~agree & ~tie).sum())
            mismatched += bad
            if bad and first_bad is None:
                first_bad = (i, int((~agree & ~tie).nonzero()[0, 0]))
    return {"prompts": len(prompts), "bytes_checked": checked, "near_ties": near_ties, "mismatched": mismatched,
            "first_mismatch": first_bad, "counters": dict(counters), "forward_counters": dict(forward)}


def decode(model_dir: Path, max_new_bytes: int = 32) -> int:
    import torch

    from dormouse.planner.plan import load_plan
    from dormouse.core.store import open_artifact
    from dormouse.data import chat
    from dormouse.posttrain import task_eval
    from dormouse.posttrain.settings import TaskSettings
    from dormouse.train.runtime import load_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = load_model(open_artifact(model_dir), device)
    model.eval()
    task_set = TaskSettings.of(load_plan(None).presets["tiny"]["tasks"])
    prompts = [chat.prompt_bytes(it.prompt) for it in task_eval.heldout_items(task_set)]
    r = decode_agreement(model, prompts, max_new_bytes)
    c, f = r["counters"], r["forward_counters"]
    problems = []
    if r["mismatched"]:
        problems.append(f"{r['mismatched']} of {r['bytes_checked']} bytes differ from the parallel forward's argmax "
                        f"(first: prompt {r['first_mismatch'][0]}, byte {r['first_mismatch'][1]})")
    if device.type == "cuda" and not c.get("kda_path.fla_recurrent"):
        problems.append(f"the step-by-step decode took no FLA recurrent kernel ({c})")
    if device.type == "cuda" and not f.get("kda_path.fla"):
        problems.append(f"the parallel forward took no FLA chunk kernel ({f})")
    return verdict("decode", problems, f"{r['prompts']} prompts x {max_new_bytes} bytes on {device}: step-by-step "
                   f"(kda_path.fla_recurrent {c.get('kda_path.fla_recurrent', 0)}) == parallel forward "
                   f"(kda_path.fla {f.get('kda_path.fla', 0)}) on {r['bytes_checked']} bytes, "
                   f"{r['near_ties']} near-ties left out")


def serve(port: int, want_device: str) -> int:
    """One streamed chat completion through the official openai client, and /health naming the device."""
    import httpx
    from openai import OpenAI

    base = f"http://127.0.0.1:{port}"
    health = httpx.get(f"{base}/health", timeout=30).json()
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    model_id = client.models.list().data[0].id
    chunks, finish = [], None
    stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "12+30="}],
                                            stream=True, max_tokens=24, temperature=0)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    problems = []
    if not str(health.get("device", "")).startswith(want_device):
        problems.append(f"/health says device {health.get('device')!r}, not {want_device}")
    if finish not in ("stop", "length"):
        problems.append(f"the stream ended without a finish_reason (got {finish!r})")
    if not chunks and finish != "stop":
        problems.append("no content chunk")
    text = "".join(chunks)
    return verdict("serve", problems, f"{model_id} on {health.get('device')}: {len(chunks)} chunks, "
                   f"finish_reason {finish}, reply {text!r}")


def lm_eval_result(out_dir: Path, want_device: str, log: Path | None = None) -> int:
    """The harness's results file from `dormouse lm-eval --output_path out_dir`: the task scored, on the device (the
    harness records the --device asked; the adapter's log says when it fell back to the CPU)."""
    found = sorted(out_dir.rglob("results_*.json"))
    if not found:
        return verdict("lm-eval", [f"no results_*.json under {out_dir}"], "")
    r = json.loads(found[-1].read_text())
    res = r.get("results", {}).get("dormouse_tiny", {})
    device = r.get("config", {}).get("device")
    problems = [] if "acc,none" in res else ["no dormouse_tiny acc in the results"]
    if not str(device).startswith(want_device):
        problems.append(f"the harness ran on {device!r}")
    if log is not None and "running on cpu" in log.read_text(errors="replace") and want_device != "cpu":
        problems.append(f"the model fell back to the CPU ({log})")
    return verdict("lm-eval", problems, f"dormouse_tiny acc {res.get('acc,none')} acc_bytes "
                   f"{res.get('acc_bytes,none')} over {res.get('sample_len')} items on {device} "
                   f"({r.get('config', {}).get('model_args')})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("path")
    p.add_argument("--set", default="")
    p.add_argument("--stage", required=True)
    p = sub.add_parser("view")
    p.add_argument("--set", default="")
    p = sub.add_parser("chain")
    p.add_argument("--set", default="")
    p = sub.add_parser("decode")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--max-new-bytes", type=int, default=32)
    p = sub.add_parser("serve")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p = sub.add_parser("lm-eval-task")
    p.add_argument("dir", type=Path)
    p = sub.add_parser("lm-eval-result")
    p.add_argument("dir", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--log", type=Path, help="dormouse lm-eval's output, read for a fallback to the CPU")
    args = ap.parse_args(argv)
    if args.cmd == "path":
        print(plan_dir(args.set, args.stage))
        return 0
    if args.cmd == "view":  # a run with --config set= writes its own view folder, not results/tiny/
        from dormouse.planner.plan import load_plan

        print(f"results/{load_plan(None, args.set or None).view_name('tiny')}")
        return 0
    if args.cmd == "chain":
        return chain(args.set)
    if args.cmd == "decode":
        return decode(args.model, args.max_new_bytes)
    if args.cmd == "serve":
        return serve(args.port, args.device)
    if args.cmd == "lm-eval-result":
        return lm_eval_result(args.dir, args.device, args.log)
    from dormouse.tools.lm_eval_adapter import write_local_task

    print(write_local_task(args.dir, "dormouse_tiny", TASK_JSONL, args.dir / "hf_cache"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
