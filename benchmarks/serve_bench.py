"""Load test of `dormouse serve` on loopback (issues #27 item 5, #42), with a Transformer peer at equal parameters in the
same run. Per preset and concurrency, each arm serves the same requests (`--requests`, N at a time):

  batched     the server with the batched decode (every live stream in one step)
  graphed     `dormouse serve --decode graphed`: the static-shape step, CUDA graphs per batch bucket (built before
              its clock starts, inside its time limit)
  unbatched   the server with max_batch 1: one stream at a time (the baseline of the batched / unbatched ratio)
  hf_static   the peer: a decoder-only Llama (SDPA attention, RMSNorm, SwiGLU, RoPE) through Hugging Face
              `generate` with `cache_implementation="static"`; on CUDA generate compiles its decode forward
              (`CompileConfig(fullgraph=True)`, mode reduce-overhead: CUDA graphs), transformers' fastest
              documented mode. The requests go in waves of N prompts, one `generate` call a wave.
  hf_dynamic  the same peer with generate's default dynamic cache (eager)

The peer has ours' width, applied depth and head layout and the SwiGLU width that brings its non-embedding
parameters closest to ours (`benchmarks.peers.sdpa_layout`, the pretrain benchmark's SDPA row); vocabulary 256 bytes
+ 3 specials; random init; bf16 on CUDA (fp32 on CPU), as ours runs under bf16 autocast. Both sample at
temperature 1 over the whole vocabulary and ignore END / EOS (`--keep-end` honours END in ours), so every request
decodes exactly --max-tokens bytes and all arms do the same work.

Every arm runs under its own time limit (`--arm-timeout-s`, and `--budget-s` for the whole run): set-up, warm-up
and the timed load all count against it. An arm that runs out is stopped (ours: its clients disconnect, the server
cancels their streams; the peer: a stopping criterion ends `generate` at the next step) and its row says `cut`,
with the bytes decoded up to the limit and the requests it finished; the run goes on with the next arm. Each row
is appended to --out as soon as its arm ends, so a run killed from outside keeps the rows it finished.

Rows: bytes/s in total and per stream (median over finished requests), time to first byte p50/p99 (ours: the first
streamed text over HTTP; the peer: the first new token on the host, stamped by a streamer), decode steps, the arm's
GPU memory (peak_gib: its model's weights plus the most it allocated beyond what was resident when it started, so
the preset's other model is not counted), and state bytes per stream: ours measured from the LMState tensors after
prefilling `--state-contexts` bytes (constant), the peer's KV cache from its config (2 x layers x kv_heads x
head_dim x context x dtype bytes, checked against a DynamicCache after a prefill of that length); the state columns
of a peer row are its KV. Ours is measured through its HTTP server and SSE (what a client sees; the timed load's
clients run in a process of their own, as real clients do), the peer in-process
(`generate` has no server): the comparison favours the peer.

    .venv/bin/python -m benchmarks.serve_bench --concurrency 32 --requests 64 --max-tokens 128            # tiny, CPU
    python3 -m benchmarks.serve_bench --presets small --device cuda --concurrency 64 --requests 128 \
        --max-tokens 256 --arms graphed,batched,unbatched,hf_static,hf_dynamic \
        --arm-timeout-s 35,unbatched=25,hf_static=90 --budget-s 240 --out $OUT/serve_bench.tsv              # GPU

(benchmarks/README.md has the whole GPU call: its wheels, small at 1 stream, b1 and medium.)

Without --model each preset's model is its architecture at initialisation (seed 0): the decode cost is the
architecture's, the text is noise. transformers is a benchmark dependency only (requirements-bench.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gc
import importlib.metadata
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import httpx
import torch
import uvicorn

from benchmarks.bench_env import git_rev
from benchmarks.peers import sdpa_layout
from benchmarks.serve_load import ARMS, Deadline, load, load_elsewhere, prompts_for, start_clients, start_server
from dormouse.core.config import load_preset  # noqa: E402
from dormouse.core.store import open_artifact  # noqa: E402
from dormouse.model.config import ModelConfig  # noqa: E402
from dormouse.model.gpt import ByteLM, count_params  # noqa: E402
from dormouse.posttrain.decode import prefill_prompts  # noqa: E402
from dormouse.serve.app import MAX_NEW_BYTES  # noqa: E402
from dormouse.train.runtime import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEER_ARMS = ("hf_static", "hf_dynamic")
ALL_ARMS = (*ARMS, *PEER_ARMS)
PAD, BOS, EOS = 256, 257, 258  # the peer's specials after the 256 bytes
COLUMNS = ["date", "device", "versions", "model", "preset", "arm", "status", "concurrency", "requests", "requests_done",
           "max_tokens", "prompt_bytes", "bytes", "wall_s", "setup_s", "total_bytes_per_s", "stream_bytes_per_s_p50",
           "ttfb_p50_ms", "ttfb_p99_ms", "steps", "max_batch", "max_batch_seen", "state_bytes_per_stream",
           "state_bytes_by_context", "params_nonemb", "peak_gib", "arm_timeout_s", "note", "step_ms_in_process",
           "step_bytes_per_s_in_process", "host_share"]
STEP_ARMS = ("graphed", "graphed_k1")  # ours over DecodeStep: its step alone is timed beside the HTTP row


def versions() -> str:
    import platform

    import fastapi

    try:  # the metadata only: importing transformers costs seconds and the peer arms may not run
        hf = f" transformers {importlib.metadata.version('transformers')}"
    except importlib.metadata.PackageNotFoundError:
        hf = ""
    return (f"py {platform.python_version()} torch {torch.__version__} fastapi {fastapi.__version__} "
            f"uvicorn {uvicorn.__version__} httpx {httpx.__version__}{hf} dormouse {git_rev() or '?'}")


def parse_timeouts(spec: str) -> tuple[float, dict[str, float]]:
    """'60' or '60,hf_static=120,unbatched=20': the default limit of an arm, and some arms' own."""
    default, own = None, {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" in part:
            arm, s = part.split("=", 1)
            if arm not in ALL_ARMS:
                raise ValueError(f"--arm-timeout-s: unknown arm {arm!r} (arms: {', '.join(ALL_ARMS)})")
            own[arm] = float(s)
        else:
            default = float(part)
    if default is None:
        raise ValueError(f"--arm-timeout-s {spec!r}: give a default number of seconds")
    return default, own


def summarize(recs: list[dict], n_bytes: int, wall: float) -> dict:
    """Totals and percentiles of one timed load. recs: one per request, with t0 (sent), first (first byte),
    end (finished; None when cut) and bytes."""
    done = [r for r in recs if r["end"] is not None]
    ttfb = [r["first"] - r["t0"] for r in recs if r["first"] is not None]
    rates = [r["bytes"] / (r["end"] - r["t0"]) for r in done if r["end"] > r["t0"]]
    return {
        "requests_done": len(done), "bytes": n_bytes, "wall_s": round(wall, 3),
        "total_bytes_per_s": round(n_bytes / wall, 1) if wall > 0 else "",
        "stream_bytes_per_s_p50": round(statistics.median(rates), 1) if rates else "",
        "ttfb_p50_ms": round(1e3 * pct(ttfb, 0.5), 1) if ttfb else "",
        "ttfb_p99_ms": round(1e3 * pct(ttfb, 0.99), 1) if ttfb else "",
    }


# -------------------------------------------------------------------------------------------------
# ours: dormouse serve on loopback
# -------------------------------------------------------------------------------------------------
def run_ours(model, device, arm: str, concurrency: int, prompts: list[bytes], max_tokens: int, keep_end: bool,
             deadline: Deadline) -> dict:
    max_batch = 1 if arm == "unbatched" else concurrency
    t_setup = time.perf_counter()
    b, server, thread, url = start_server(model, device, max_batch, keep_end, arm)
    try:
        asyncio.run(load(url, 2, prompts[:2], 8, deadline))  # warm-up (graphs, allocator), inside the limit
        setup = time.perf_counter() - t_setup
        b.bench_streams.clear()
        decoded = {}
        recs, wall, cut = load_elsewhere(url, concurrency, prompts, max_tokens, deadline, at_deadline=lambda:
                                         decoded.setdefault("bytes", sum(s.new_bytes for s in b.bench_streams)))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        b.stop()
    return {"status": "cut" if cut else "ok", "setup_s": round(setup, 3), "steps": b.counters["serve.steps"],
            "max_batch": max_batch, "max_batch_seen": b.counters["serve.max_batch_seen"],
            "state_bytes_per_stream": b.state_bytes_per_stream, **summarize(recs, decoded["bytes"], wall)}


def step_in_process(model, device, rows: int, http_bytes_per_s: float) -> dict:
    """The arm's decode step alone at its concurrency, no server (benchmarks/decode_step.py: the step and its one host
    read, graphed on CUDA), and the share of that rate the host path (delivery, the event loop, SSE, HTTP) costs."""
    from benchmarks.decode_step import time_step

    cuda = device.type == "cuda"
    t = time_step(model, rows, graphed=cuda, bf16=cuda, steps=100, warmup=10, profile=False)
    return {"step_ms_in_process": t["ms_step_with_read"], "step_bytes_per_s_in_process": t["bytes_per_s"],
            "host_share": round(1 - http_bytes_per_s / t["bytes_per_s"], 3)}


def ours_state_by_context(model, device, contexts: list[int]) -> dict[int, int]:
    """Bytes of one stream's LMState after prefilling `ctx` bytes, as the server prefills (bf16 autocast on CUDA)."""
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode(), amp:
        for ctx in contexts:
            prompt = bytes(torch.randint(32, 127, (ctx,), generator=g).tolist())
            _, st = prefill_prompts(model, [prompt])
            out[ctx] = st.row_bytes()
    return out


# -------------------------------------------------------------------------------------------------
# the peer: Hugging Face generate at equal parameters
# -------------------------------------------------------------------------------------------------
def build_peer(cfg: ModelConfig, device: torch.device, max_positions: int):
    """A LlamaForCausalLM of sdpa_layout(cfg)'s shape, random init (seed 0), SDPA attention,
    bf16 on CUDA. Returns (model, layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    lay = sdpa_layout(cfg)
    hc = LlamaConfig(vocab_size=256 + 3, hidden_size=lay["d"], intermediate_size=lay["ffn_hidden"],
                     num_hidden_layers=lay["n_layers"], num_attention_heads=lay["n_heads"],
                     num_key_value_heads=lay["n_heads"], head_dim=lay["head_dim"],
                     max_position_embeddings=max_positions, rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std,
                     tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                     pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    hc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: b1's peer is a 1B-parameter model
        peer = LlamaForCausalLM(hc)
    peer = peer.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    assert all(torch.isfinite(p).all() for p in peer.parameters()), "the peer's init left non-finite weights"
    nonemb = sum(p.numel() for n, p in peer.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    return peer, {**lay, "params_nonemb": nonemb}


def peer_kv_bytes(peer, context: int) -> int:
    """The KV cache of one stream at `context` tokens, from the config: K and V per layer, kv_heads x head_dim."""
    c = peer.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * peer.dtype.itemsize


def peer_kv_measured(peer, context: int) -> int:
    """The KV bytes a DynamicCache holds for one stream after a prefill of `context` tokens."""
    ids = torch.randint(0, 256, (1, context), generator=torch.Generator().manual_seed(0)).to(peer.device)
    with torch.inference_mode():
        cache = peer(input_ids=ids, use_cache=True).past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _peer_hooks(deadline: Deadline, stop_after: int | None = None):
    """(streamer, stopping criteria) for one generate call: the streamer stamps the first new token on the host
    (generate's first put is the prompt); the criterion ends generation once the deadline passed, or after
    stop_after new tokens (the warm-up)."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.puts, self.t_first = 0, None

        def put(self, value):
            self.puts += 1
            if self.puts == 2:
                self.t_first = time.perf_counter()

        def end(self):
            pass

    class Stop(StoppingCriteria):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            stop = deadline.passed() or (stop_after is not None and self.calls >= stop_after)
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    return FirstToken(), StoppingCriteriaList([Stop()])


def run_peer(peer, arm: str, concurrency: int, prompts: list[bytes], max_tokens: int, deadline: Deadline) -> dict:
    """The prompts in waves of `concurrency`, one generate call a wave, after a warm-up wave of the same shape
    (compile and CUDA-graph recording before the clock, the cache sized for the full length) that stops after 8
    new tokens."""
    from transformers import CompileConfig, GenerationConfig

    static = arm == "hf_static"
    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=None, pad_token_id=PAD, cache_implementation="static" if static else None,
                           # generate compiles on CUDA only; on the CPU a compile_config would only draw a warning
                           compile_config=CompileConfig(fullgraph=True) if static and peer.device.type == "cuda" else None)
    dev = peer.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def generate(ids, streamer, stopping):
        # generate runs under its own no_grad, as documented: no inference_mode around its compiled graphs
        out = peer.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                            streamer=streamer, stopping_criteria=stopping)
        sync()
        return out.shape[1] - ids.shape[1]

    def wave(i):
        return torch.tensor([list(p) for p in prompts[i:i + concurrency]], dtype=torch.long, device=dev)

    t_setup = time.perf_counter()
    if not deadline.passed():
        generate(wave(0), *_peer_hooks(deadline, stop_after=8))
    setup = time.perf_counter() - t_setup
    recs, steps, cut = [], 0, False
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        if deadline.passed():
            cut = True
            break
        ids = wave(i)
        streamer, stopping = _peer_hooks(deadline)
        w0 = time.perf_counter()
        n_new = generate(ids, streamer, stopping)
        w1 = time.perf_counter()
        steps += n_new
        cut |= n_new < max_tokens
        recs += [{"t0": w0, "first": streamer.t_first, "end": w1 if n_new == max_tokens else None, "bytes": n_new}
                 for _ in range(ids.shape[0])]
    wall = time.perf_counter() - t0
    compiled = hasattr(peer, "_compiled_call")  # generate compiled its forward (CUDA; never on CPU)
    return {"status": "cut" if cut else "ok", "setup_s": round(setup, 3), "steps": steps, "max_batch": concurrency,
            "max_batch_seen": min(concurrency, len(prompts)),
            "note": f"compiled {compiled}", **summarize(recs, sum(r["bytes"] for r in recs), wall)}


# -------------------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def append_row(path: Path | None, row: dict) -> None:
    if path is None:
        return
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, delimiter="\t", extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def weight_bytes(m: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a model artifact (pretrain, sft, rl); default presets at init")
    ap.add_argument("--presets", "--preset", default="tiny", help="without --model: these presets' architectures at init")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", default="32", help="streams at a time; comma-separated for several rows")
    ap.add_argument("--requests", type=int, default=64, help="requests per row (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-bytes", default="64", help="prompt bytes of each request; comma-separated for several rows")
    ap.add_argument("--long-prompts", default=None,
                    help="extra rows BYTES:c1,c2,... (prompts of BYTES at those concurrencies); default on CUDA "
                         "8192:1,8,64 (issue #57: TTFB and bytes/s with long prompts), none on the CPU; '' for none")
    ap.add_argument("--keep-end", action="store_true")
    ap.add_argument("--arms", default="batched,unbatched", help=f"comma-separated, in order, of {', '.join(ALL_ARMS)}")
    ap.add_argument("--arm-timeout-s", default="120",
                    help="each arm's limit, set-up and warm-up included: '60' or '60,hf_static=120' (per arm)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="the whole run's limit: later arms are skipped")
    ap.add_argument("--state-contexts", default="256,8192", help="contexts (bytes) at which state per stream is printed")
    ap.add_argument("--out", type=Path, default=None, help="TSV rows, appended as each arm ends")
    args = ap.parse_args(argv)
    run_end = time.perf_counter() + args.budget_s
    arms = args.arms.split(",")
    if not arms or any(a not in ALL_ARMS for a in arms):
        ap.error(f"--arms {args.arms}: each one of {', '.join(ALL_ARMS)}")
    try:
        default_timeout, own_timeout = parse_timeouts(args.arm_timeout_s)
    except ValueError as e:
        ap.error(str(e))
    if not 1 <= args.max_tokens <= MAX_NEW_BYTES:  # the server answers 400 above its max_tokens ceiling
        ap.error(f"--max-tokens {args.max_tokens}: 1 to {MAX_NEW_BYTES}")
    levels = [int(c) for c in args.concurrency.split(",")]
    long_spec = args.long_prompts if args.long_prompts is not None else ("8192:1,8,64" if args.device.startswith("cuda") else "")
    try:
        cases = [(int(b), c) for b in args.prompt_bytes.split(",") for c in levels]
        if long_spec:
            long_bytes, long_levels = long_spec.split(":")
            cases += [(int(long_bytes), int(c)) for c in long_levels.split(",")]
    except ValueError:
        ap.error(f"--prompt-bytes {args.prompt_bytes!r} / --long-prompts {long_spec!r}: integers, BYTES:c1,c2,...")
    cases = list(dict.fromkeys(cases))  # (prompt bytes, concurrency) rows, in order
    contexts = [int(c) for c in args.state_contexts.split(",")]
    device = torch.device(args.device)
    dev_name = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    presets = [None] if args.model else args.presets.split(",")
    vers = versions()
    rows: list[dict] = []
    states: list[tuple[str, str, dict[int, int]]] = []

    def emit(row: dict) -> None:
        rows.append(row)
        append_row(args.out, row)
        print(f"[serve_bench] {json.dumps({k: v for k, v in row.items() if k not in ('versions', 'date')})}", flush=True)

    print(f"[serve_bench] {vers}; {dev_name}; presets {','.join(p or str(args.model) for p in presets)}; arms "
          f"{args.arms}; concurrency {args.concurrency}; {args.max_tokens} bytes a request; limit {args.arm_timeout_s} "
          f"s an arm, budget {args.budget_s} s", flush=True)
    if any(a in ARMS for a in arms):
        start_clients()  # the timed loads' client process, started once, before any arm's clock
    for preset in presets:
        name = f"{args.model.parent.name}/{args.model.name[:8]}" if args.model else f"{preset}@init"
        model = peer = lay = None
        ours_state: dict[int, int] = {}
        failed = peer_failed = None  # set-up errors: the arms they stop still get their rows
        if run_end - time.perf_counter() < 1.0:  # no set-up either (a first prefill may autotune for minutes)
            for pb, conc in cases:
                for arm in arms:
                    emit({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": dev_name, "versions": vers,
                          "model": name, "preset": preset or "", "arm": arm, "concurrency": conc, "prompt_bytes": pb,
                          "status": "skipped", "note": "the run's --budget-s was spent"})
            continue
        try:
            if args.model:
                model, _ = load_model(open_artifact(args.model), device)
            else:
                torch.manual_seed(0)
                model = ByteLM(ModelConfig.from_dict(load_preset(preset, ROOT)["model"])).to(device)
            model.eval()
            ours_state = ours_state_by_context(model, device, contexts)
            states.append((name, "ours (LMState, measured)", ours_state))
            ours_nonemb = count_params(model.cfg)["non_embedding"]
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: this preset's rows say so, the run goes on
            failed = f"set-up: {type(e).__name__}: {e}"[:300]
        if not failed and any(a in PEER_ARMS for a in arms):
            try:
                peer, lay = build_peer(model.cfg, device, max(contexts + [pb + args.max_tokens for pb, _ in cases]) + 1)
                kv = {ctx: peer_kv_bytes(peer, ctx) for ctx in contexts}
                measured = {ctx: peer_kv_measured(peer, ctx) for ctx in contexts}
                if measured != kv:  # the formula is what the rows report: it must be the cache's real size
                    raise RuntimeError(f"peer KV bytes: formula {kv}, DynamicCache {measured}")
                states.append((name, f"peer KV cache ({peer.dtype}, measured = formula)", kv))
                print(f"[serve_bench] {name}: ours {ours_nonemb} non-embedding parameters, peer {lay['params_nonemb']} "
                      f"(Llama d{lay['d']} L{lay['n_layers']} {lay['n_heads']}x{lay['head_dim']} ffn "
                      f"{lay['ffn_hidden']})", flush=True)
            except Exception as e:  # noqa: BLE001 - the peer's arms get error rows, ours run
                peer_failed, peer = f"peer set-up: {type(e).__name__}: {e}"[:300], None
        for pb, conc in cases:
            prompts = prompts_for(max(args.requests, conc), pb)
            for arm in arms:
                limit = own_timeout.get(arm, default_timeout)
                deadline = Deadline(limit, run_end)
                row = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": dev_name, "versions": vers,
                       "model": name, "preset": preset or "", "arm": arm, "concurrency": conc,
                       "requests": len(prompts), "max_tokens": args.max_tokens, "prompt_bytes": pb,
                       "arm_timeout_s": limit}
                peer_arm = arm in PEER_ARMS
                if failed or (peer_arm and peer_failed):
                    row.update(status="error", note=failed or peer_failed)
                    emit(row)
                    continue
                ctx_bytes = {ctx: peer_kv_bytes(peer, ctx) for ctx in contexts} if peer_arm else ours_state
                row["state_bytes_by_context"] = ",".join(f"{c}={b}" for c, b in ctx_bytes.items())
                row["params_nonemb"] = lay["params_nonemb"] if peer_arm else ours_nonemb
                if run_end - time.perf_counter() < 1.0:  # not worth starting: nothing would be timed
                    row.update(status="skipped", note="the run's --budget-s was spent")
                else:
                    free(device)  # the last arm's leftovers collected before this one's baseline
                    if device.type == "cuda":
                        resident = torch.cuda.memory_allocated(device)
                        torch.cuda.reset_peak_memory_stats(device)
                    try:
                        if peer_arm:
                            row.update(run_peer(peer, arm, conc, prompts, args.max_tokens, deadline))
                            # static: allocated for the whole request; dynamic: grows to this by its last byte
                            row["state_bytes_per_stream"] = peer_kv_bytes(peer, pb + args.max_tokens)
                        else:
                            row.update(run_ours(model, device, arm, conc, prompts, args.max_tokens, args.keep_end,
                                                deadline))
                            if arm in STEP_ARMS and row.get("total_bytes_per_s"):
                                row.update(step_in_process(model, device, conc, row["total_bytes_per_s"]))
                    except Exception as e:  # noqa: BLE001 - one arm's failure is its row; the run goes on
                        row.update(status="error", note=f"{type(e).__name__}: {e}"[:300])
                    if device.type == "cuda":
                        own = weight_bytes(peer if peer_arm else model)
                        row["peak_gib"] = round((torch.cuda.max_memory_allocated(device) - resident + own) / 2**30, 3)
                emit(row)
        del model, peer
        if any(a == "hf_static" for a in arms):
            torch._dynamo.reset()  # the compiled peer's graphs and CUDA-graph pool go with its preset
        free(device)
    report(rows, states, contexts)
    return 0


def report(rows: list[dict], states: list, contexts: list[int]) -> None:
    print(f"\n{'model':<16} {'prompt':>6} {'conc':>4} {'arm':<10} {'status':<7} {'total B/s':>10} {'stream B/s p50':>14} "
          f"{'TTFB p50 ms':>11} {'TTFB p99 ms':>11} {'steps':>6} {'state B/stream':>14} {'peak GiB':>8} "
          f"{'step alone B/s':>14} {'host share':>10}")
    for r in rows:
        print(f"{r['model']:<16} {r.get('prompt_bytes', ''):>6} {r['concurrency']:>4} {r['arm']:<10} {r['status']:<7} "
              f"{r.get('total_bytes_per_s', ''):>10} {r.get('stream_bytes_per_s_p50', ''):>14} {r.get('ttfb_p50_ms', ''):>11} "
              f"{r.get('ttfb_p99_ms', ''):>11} {r.get('steps', ''):>6} {r.get('state_bytes_per_stream') or '':>14} "
              f"{r.get('peak_gib', ''):>8} {r.get('step_bytes_per_s_in_process', ''):>14} {r.get('host_share', ''):>10}")
    print(f"\nstate bytes per stream at context (bytes): {' '.join(f'{c:>12}' for c in contexts)}")
    for name, what, by_ctx in states:
        print(f"  {name:<16} {what:<40} {' '.join(f'{by_ctx[c]:>12}' for c in contexts)}")
    by = {(r["model"], r.get("prompt_bytes"), r["concurrency"], r["arm"]): r for r in rows}

    def tput(case, arm):  # (bytes/s, cut) of a row that timed something
        r = by.get((*case, arm))
        ok = r and r.get("status") in ("ok", "cut") and r.get("total_bytes_per_s")
        return (r["total_bytes_per_s"], r["status"] == "cut") if ok else None

    for case in dict.fromkeys((r["model"], r.get("prompt_bytes"), r["concurrency"]) for r in rows):
        ours = max(filter(None, (tput(case, a) for a in ("batched", "graphed", "compiled"))), default=None)
        parts = [f"{what} {a[0] / b[0]:.2f}x{' (a cut arm: its rate until its limit)' if a[1] or b[1] else ''}"
                 for what, a, b in (("batched / unbatched", tput(case, "batched"), tput(case, "unbatched")),
                                    ("graphed / graphed_k1", tput(case, "graphed"), tput(case, "graphed_k1")),
                                    ("ours best / hf_static", ours, tput(case, "hf_static")),
                                    ("ours best / hf_dynamic", ours, tput(case, "hf_dynamic"))) if a and b]
        if parts:
            print(f"{case[0]} at {case[2]} streams, {case[1]}-byte prompts, total bytes/s: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(main())
