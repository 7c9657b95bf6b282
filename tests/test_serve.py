"""dormouse serve: the OpenAI-compatible API through the real `openai` client and raw HTTP, the batched decode
scheduler, bad requests, clients that leave, and the decode state's size per stream."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
import torch
import uvicorn

from dormouse.core.store import ArtifactWriter, artifact_digest
from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM
from dormouse.data import chat
from dormouse.posttrain.decode import generate, prefill_prompts
from dormouse.serve.app import Limits, create_app, server_config
from dormouse.serve.batcher import PREFILL_CHUNK, Batcher, Stream
from dormouse.train.runtime import save_model_artifact

JSON = {"content-type": "application/json"}  # what httpx's json= sends; raw bodies must say it too
TINY = {"d_model": 32, "n_heads": 2, "head_dim": 16, "ffn_hidden": 64, "n_core": 1, "kda_chunk_size": 16,
        "engram": True, "engram_rows": 256, "engram_dim": 8}


def tiny_model(seed: int = 0) -> ByteLM:
    torch.manual_seed(seed)
    return ByteLM(ModelConfig.from_dict(TINY)).eval()


class Server:
    """The app under uvicorn on a free loopback port, in this process (its decode thread included)."""

    def __init__(self, model: ByteLM, limits: Limits | None = None, max_batch: int = 64, batcher=Batcher,
                 names=("dormouse-test",), **app_kw):
        self.batcher = batcher(model, torch.device("cpu"), bf16=False, max_batch=max_batch)
        self.batcher.start()
        app = create_app(self.batcher, list(names), limits, **app_kw)
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", 0, limits))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.batcher.stop()

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, Limits(max_prompt_bytes=2000))
    yield s
    s.close()


def test_the_openai_client_chats_and_completes_streaming_or_not(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["dormouse-test"]
    msgs = [{"role": "user", "content": "Reverse: abc"}]
    whole = client.chat.completions.create(model="dormouse-test", messages=msgs, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason in ("stop", "length")
    prompt = chat.encode_turns([("user", "Reverse: abc")]) + bytes([chat.ASSISTANT])
    assert whole.usage.prompt_tokens == len(prompt) and 1 <= whole.usage.completion_tokens <= 12  # bytes
    parts = list(client.chat.completions.create(model="dormouse-test", messages=msgs, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same reply, streamed
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens
    done = client.completions.create(model="dormouse-test", prompt="Once upon", max_tokens=16, temperature=0.8, seed=7)
    again = client.completions.create(model="dormouse-test", prompt="Once upon", max_tokens=16, temperature=0.8, seed=7)
    assert done.choices[0].text == again.choices[0].text and done.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="dormouse-test", prompt="Once upon", max_tokens=16, temperature=0.8, seed=7, stream=True))
    assert streamed == done.choices[0].text  # a seed fixes the draws, streamed or not


def test_the_reply_is_what_generate_decodes(server, model):
    """The server's greedy reply is decode.generate's bytes up to END, as whole UTF-8 characters."""
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                     {"role": "user", "content": "again"}], "max_tokens": 20, "temperature": 0}).json()
    prompt = chat.encode_turns([("user", "hello"), ("assistant", "hi"), ("user", "again")]) + bytes([chat.ASSISTANT])
    want = generate(model, [prompt], 20, bf16=False)[0]
    body = want.split(bytes([chat.END]))[0]
    assert r["choices"][0]["message"]["content"] == body.decode("utf-8", "replace")
    assert r["usage"]["completion_tokens"] == min(20, len(body) + 1)


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3.0}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": 0}, "top_k"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "a\x02b"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "be nice"}, {"role": "user", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "system", "content": "be nice"}]}, "messages"),  # no user turn to open
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content.str"),
])
def test_bad_chat_requests_get_a_400_with_a_json_error(server, body, param):
    kw = {"content": body, "headers": JSON} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/chat/completions", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param


def test_over_long_and_reserved_prompts_and_unknown_fields(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 2001})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a\x03"})
    assert r.status_code == 400 and "0x03" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2, "user": "me", "presence_penalty": 0})
    assert r.status_code == 200  # fields a client adds and we do not use are ignored


def test_streams_decode_together_and_each_gets_its_own_reply(model):
    """Eight concurrent greedy requests: each reply equals the one decoded alone, while the decode loop ran far
    fewer steps than the bytes it produced (one batched step serves every live stream)."""
    s = Server(model)
    try:
        prompts = [f"prompt number {i} " * (i + 1) for i in range(8)]

        def ask(p):
            return httpx.post(s.url + "/v1/completions", json={"prompt": p, "max_tokens": 40, "temperature": 0},
                              timeout=60).json()

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, prompts))
        c = s.health()["counters"]
        produced = sum(r["usage"]["completion_tokens"] for r in replies)
        assert c["serve.max_batch_seen"] >= 2 and c["serve.steps"] < produced
        for p, r in zip(prompts, replies):
            alone = generate(model, [p.encode()], 40, bf16=False)[0].split(bytes([chat.END]))[0]
            assert r["choices"][0]["text"] == alone.decode("utf-8", "replace")
    finally:
        s.close()


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_the_graphed_decode_serves_generates_greedy_bytes_and_a_seeds_bytes_whatever_the_company(model, decode_steps):
    """serve --decode graphed (on CPU the same static step, eagerly): concurrent greedy replies are generate's, and a
    seeded sampled reply is generate_static's for that seed, alone or among other streams (rows of a padded bucket);
    with --decode-steps 4 the same bytes, several steps a host read under load."""
    from dormouse.posttrain.decode import generate_static
    from dormouse.serve.batcher import GraphedBatcher

    s = Server(model, max_batch=8, batcher=partial(GraphedBatcher, decode_steps=decode_steps))
    try:
        assert s.batcher.step.buckets == [1, 2, 4, 8]

        def ask(p, **kw):
            return httpx.post(s.url + "/v1/completions", json={"prompt": p, "max_tokens": 30} | kw,
                              timeout=60).json()["choices"][0]["text"]

        prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]
        lengths = [30 - 4 * i for i in range(6)]  # the first rows finish first: the rows after them move down
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda p, n: ask(p, temperature=0, max_tokens=n), prompts, lengths))
        for p, n, r in zip(prompts, lengths, replies):
            want = generate(model, [p.encode()], n, bf16=False)[0].split(bytes([chat.END]))[0]
            assert r == want.decode("utf-8", "replace")
        c = s.health()["counters"]
        assert c["serve.max_batch_seen"] >= 2 and c["serve.steps"] < 6 * 30
        assert (c["serve.host_reads"] < c["serve.steps"]) == (decode_steps > 1) and c["serve.decode_k.1"] > 0
        seeded = dict(temperature=1.0, top_k=60, seed=2**64 - 3)
        want = generate_static(model, [b"tell me"], 30, temperature=1.0, top_k=60, seeds=[2**64 - 3], bf16=False)[0]
        alone = ask("tell me", **seeded)
        assert alone == want.split(bytes([chat.END]))[0].decode("utf-8", "replace")
        with ThreadPoolExecutor(5) as pool:
            others = [pool.submit(ask, p, temperature=1.0, max_tokens=60) for p in prompts[:4]]
            mine = pool.submit(ask, "tell me", **seeded)
            assert mine.result() == alone and all(isinstance(o.result(), str) for o in others)
    finally:
        s.close()


def test_a_compiled_graphed_decode_compiles_every_shape_at_start_and_never_while_serving():
    """serve --compile: the regions compiled (aot_eager here: the same graphs as inductor's, run by eager kernels)
    and every prefill and step shape compiled at start, so under torch's fail_on_recompile stance prompts of any
    length, whole or in pieces, and any number of streams decode; the replies are the uncompiled step's."""
    from functools import partial

    from torch._dynamo.utils import counters as dynamo_counters

    from dormouse.serve.batcher import GraphedBatcher

    plain, compiled = Server(tiny_model(), max_batch=8, batcher=GraphedBatcher), None
    try:
        compiled = Server(tiny_model(), max_batch=8,
                          batcher=partial(GraphedBatcher, compile=True, compile_backend="aot_eager", prefill_chunk=64))
        c = compiled.health()["counters"]
        assert c["serve.compiled_regions"] > 0 and c["serve.compiled_graphs_at_start"] > 0
        graphs = dynamo_counters["stats"]["unique_graphs"]
        # 150, 180: in pieces; 65: a 1-byte piece continuing; two of 129: 1-byte pieces continuing, two rows at once
        prompts = ["a", "two words", "x" * 150, "the quick brown fox " * 9, "yes", "no", "y" * 65, "z" * 129, "w" * 129]

        def ask(server, p):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0},
                           timeout=60).json()
            assert "choices" in r, r
            return r["choices"][0]["text"]

        torch.compiler.set_stance("fail_on_recompile")
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda p: ask(compiled, p), prompts))
            got.append(ask(compiled, "alone"))
        finally:
            torch.compiler.set_stance("default")
        assert dynamo_counters["stats"]["unique_graphs"] == graphs
        assert got == [ask(plain, p) for p in prompts] + [ask(plain, "alone")]
        assert compiled.health()["counters"]["serve.prefill_chunks"] >= 4
    finally:
        plain.close()
        if compiled is not None:
            compiled.close()


def test_a_client_that_leaves_mid_stream_frees_its_row(model):
    s = Server(model)
    try:
        with httpx.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "go on", "max_tokens": 4000, "stream": True, "temperature": 1.0}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 30
        while (h := s.health())["counters"].get("serve.streams_cancelled", 0) < 1:
            assert time.monotonic() < deadline, h
            time.sleep(0.05)
        assert h["live_streams"] == 0 and h["counters"].get("serve.finished.length", 0) == 0
    finally:
        s.close()


def test_the_decode_state_per_stream_does_not_grow_with_the_conversation(model, server):
    short = prefill_prompts(model, [b"hi"])[1]
    long = prefill_prompts(model, [b"a long conversation " * 200])[1]
    assert short.row_bytes() == long.row_bytes() > 0
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert server.health()["state_bytes_per_stream"] == short.row_bytes()


def test_text_goes_out_as_whole_characters_and_never_part_of_a_stop():
    got, done = [], []
    s = Stream(b"p", 100, emit=got.append, finish=lambda reason, usage: done.append(reason), stops=("END",))
    for b in "é€ab".encode():
        assert s.take(b) is None
    assert got == ["é", "€", "a", "b"]  # a character's first bytes are held until it is whole
    for b in b"EN":
        assert s.take(b) is None
    assert got == ["é", "€", "a", "b"]  # "EN" might start the stop sequence: held back
    assert s.take(ord("D")) == "stop" and "".join(got) == "é€ab"
    t = Stream(b"p", 3, emit=got.append, finish=lambda *a: None)
    assert [t.take(x) for x in b"xyz"] == [None, None, "length"]


def test_k_steps_a_read_unless_a_waiting_stream_could_join_at_the_next_turn(model):
    """GraphedBatcher's k: 1 for a lone stream, while a stream could join at the next turn (a free row, or a row
    paused for a request under its share) or is prefilled; decode_steps while the waiting line gets no row (overload:
    every row held by the one request that also waits), never past what the rows may still take."""
    from dormouse.serve.batcher import GraphedBatcher

    b = GraphedBatcher(model, torch.device("cpu"), bf16=False, max_batch=2, decode_steps=4)
    big, other = object(), object()
    rows = [greedy(b"a", 100, group=big), greedy(b"b", 100, group=big)]
    assert b._steps_this_turn(rows[:1]) == 1 and b._steps_this_turn(rows) == 4
    b.waiting[big] = deque([greedy(b"c", 100, group=big)])  # over its share already: no row for it
    assert b._steps_this_turn(rows) == 4
    b.waiting[other] = deque([greedy(b"d", 100, group=other)])  # under its share: a row pauses for it
    assert b._steps_this_turn(rows) == 1
    del b.waiting[other]
    rows[0].new_bytes, rows[1].new_bytes = 98, 99  # two and one bytes left: two steps
    assert b._steps_this_turn(rows) == 2
    b.prefilling[other] = deque([greedy(b"e" * 10, 1, group=other)])
    assert b._steps_this_turn(rows) == 1


def test_bytes_taken_in_blocks_give_the_text_and_finish_of_bytes_taken_one_by_one():
    """Stream.take_many (the bytes of k decode steps at once) against take a byte at a time: the same text, finish
    reason and byte count whatever the block edges (split characters, stop strings across blocks, a stop byte or the
    length limit mid-block), and at most one emit a block."""
    import random

    rng = random.Random(0)
    text = "aé€b END x😀yEND ab\x03zz".encode()
    for trial in range(300):
        data = bytes(rng.choice(text) for _ in range(rng.randint(1, 40)))
        kw = dict(stops=rng.choice([(), ("END",), ("ab", "€b")]), stop_bytes=frozenset({3}),
                  max_new_bytes=rng.randint(1, 45))
        one, many = [], []
        a = Stream(b"p", emit=one.append, finish=lambda *x: None, **kw)
        b = Stream(b"p", emit=many.append, finish=lambda *x: None, **kw)
        ra = next((r for r in map(a.take, data) if r is not None), None)
        rb, at, blocks = None, 0, 0
        while at < len(data) and rb is None:
            k = rng.randint(1, 8)
            n_before = len(many)
            rb = b.take_many(data[at:at + k])
            assert len(many) - n_before <= 1
            at, blocks = at + k, blocks + 1
        assert ("".join(one), ra, a.new_bytes, bytes(a.out)) == ("".join(many), rb, b.new_bytes, bytes(b.out)), trial


def test_the_chat_page_is_served(server, model):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "dormouse-test" in r.text and "/v1/chat/completions" in r.text
    s = Server(model, names=["runs/<b>a&b</b>"])  # a --model path goes into the page as text, not markup
    try:
        page = httpx.get(s.url + "/").text
        assert "runs/&lt;b&gt;a&amp;b&lt;/b&gt;" in page and "<b>a&b</b>" not in page
    finally:
        s.close()


def test_serve_loads_a_store_artifact_from_the_cli(tmp_path, model):
    """`dormouse serve --model DIR` resolves a store artifact (manifest-verified) and names the model by it."""
    import argparse

    from dormouse.serve.app import load

    params = {"model": model.cfg.to_dict(), "note": "serve test"}
    out = tmp_path / "store" / "pretrain" / artifact_digest("pretrain", 1, params, {}, [])
    with ArtifactWriter(out, "pretrain", 1, params, {}, []) as art:
        save_model_artifact(art, model, {"model": model.cfg.to_dict()}, [])
    loaded, device, _, model_id, info = load(argparse.Namespace(model=out, preset=None, rung=None, device="cpu",
                                                                config="config/config.yaml"))
    assert model_id == f"dormouse-pretrain-{out.name[:8]}" and info["stage"] == "pretrain" and not loaded.training
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    json.dumps(info)  # /health serves it


def test_serve_preset_with_set_loads_that_runs_model_and_says_which(workdir, model, monkeypatch, capsys):
    """`dormouse serve --preset tiny --set ...` (dormouse plan's --set/--corpus) resolves the rl model of the run
    `snakemake --config set=...` made, not the preset's own, and prints the artifact it loaded."""
    import argparse
    from pathlib import Path

    from dormouse.planner.plan import load_plan, override_tag
    from dormouse.serve.app import load, main

    monkeypatch.chdir(workdir)
    plan, own = load_plan(None, "train.steps=7"), load_plan(None)
    digest = plan.chain["tiny"]["rl"]
    assert digest != own.chain["tiny"]["rl"]
    job, out = plan.job("rl", digest), Path(plan.artifact_dir("rl", digest))
    with ArtifactWriter(out, "rl", job.format_version, job.params, {k: v["digest"] for k, v in job.inputs.items()},
                        job.retractions) as art:  # the overridden run's rl artifact, at its planned digest
        save_model_artifact(art, model, {"model": model.cfg.to_dict()}, [])
    args = dict(model=None, preset="tiny", rung=None, device="cpu", config=None, corpus=None)
    _, _, _, model_id, info = load(argparse.Namespace(**args, set="train.steps=7"))
    assert info["artifact"] == str(out) and model_id == f"dormouse-tiny-{digest[:8]}"
    assert f"[serve] preset tiny, set=train.steps=7: {out}\n" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=f"preset tiny's rl model results/store/rl/{own.chain['tiny']['rl']} is not "
                                         "built yet: snakemake results/tiny/bench.json "):
        load(argparse.Namespace(**args, set=None))  # the preset's own model: not built here
    with pytest.raises(SystemExit, match=f"snakemake results/tiny@{override_tag({'set': 'train.steps=8'})}/bench.json "
                                         "--config set=train.steps=8 "):  # what builds another run's model
        load(argparse.Namespace(**args, set="train.steps=8"))
    with pytest.raises(SystemExit):
        main(["--model", str(out), "--set", "train.steps=7"])  # --set picks a run of --preset, not of a model dir
    assert "--set/--corpus choose which run of --preset to serve" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["local-completions", "local-chat-completions"])
def test_lm_eval_harness_generates_through_the_server(server, tmp_path, kind):
    """lm-evaluation-harness's own OpenAI-API models against the server: every document is answered with the
    server's greedy reply (generation tasks; prompt log-probs are not served)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    docs = [{"question": f"Q{i}: 1+{i}=", "answer": str(1 + i)} for i in range(3)]
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    from dormouse.tools.lm_eval_adapter import write_local_task

    tasks = tmp_path / "tasks"
    write_local_task(tasks, "dormouse_serve_gen", data, tmp_path / "hf_cache", output_type="generate_until")
    endpoint = "chat/completions" if kind == "local-chat-completions" else "completions"
    before = server.health()["counters"].get("serve.streams", 0)
    r = lm_eval.simple_evaluate(
        model=kind, model_args=f"base_url={server.url}/v1/{endpoint},model=dormouse-test,tokenizer_backend=None,"
                               "tokenized_requests=False,num_concurrent=1,max_retries=1",
        tasks=["dormouse_serve_gen"], task_manager=TaskManager(include_defaults=False, include_path=str(tasks)),
        log_samples=True, apply_chat_template=kind == "local-chat-completions")
    samples = r["samples"]["dormouse_serve_gen"]
    assert len(samples) == 3 and server.health()["counters"]["serve.streams"] - before == 3
    assert "exact_match,none" in r["results"]["dormouse_serve_gen"]


def test_inverse_cdf_sampling_follows_the_distribution():
    """The scheduler's batched draw: a byte's frequency is its softmax probability, top-k cuts the rest."""
    from dormouse.serve.batcher import sample_with_uniforms

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    draws = sample_with_uniforms(logits, 1.0, None, torch.rand(20000, generator=g))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.015, rtol=0)
    top2 = sample_with_uniforms(logits, 1.0, 2, torch.rand(20000, generator=g))
    assert set(top2.tolist()) == {0, 1} and abs(float((top2 == 0).float().mean()) - 0.625) < 0.015


def test_the_load_benchmark_runs_both_arms(tmp_path):
    """benchmarks/serve_bench.py at a toy size: both arms serve every byte; the batched one in fewer steps."""
    import csv

    import benchmarks.serve_bench as bench
    out = tmp_path / "s.tsv"
    assert bench.main(["--concurrency", "4", "--requests", "8", "--max-tokens", "6", "--out", str(out),
                       "--arms", "batched,graphed,unbatched"]) == 0
    rows = {r["arm"]: r for r in csv.DictReader(out.open(), delimiter="\t")}
    assert rows["batched"]["bytes"] == rows["graphed"]["bytes"] == rows["unbatched"]["bytes"] == str(8 * 6)
    assert int(rows["batched"]["steps"]) < int(rows["unbatched"]["steps"]) and rows["batched"]["max_batch_seen"] == "4"
    assert int(rows["graphed"]["steps"]) < int(rows["unbatched"]["steps"]) and rows["graphed"]["max_batch_seen"] == "4"
    # without --keep-end no stream stops at END: its stop bytes are cleared as it is submitted
    b, server, thread, _ = bench.start_server(tiny_model(), torch.device("cpu"), 2, False)
    try:
        s = Stream(b"x", 1, emit=lambda t: None, finish=lambda *a: None)
        b.submit(s)
        assert s.stop_bytes == frozenset()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        b.stop()


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 5}, 400, "stop"),  # at most 4 stop sequences
    ("/v1/completions", {"prompt": "x", "stop": "y" * 65}, 400, "stop"),  # a stop is matched on every byte
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),  # over torch.Generator's range: was a 500
    ("/v1/completions", {"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate: valid JSON, no UTF-8 (was a 500)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
])
def test_requests_that_once_crashed_or_stalled_get_a_4xx(server, path, body, status, param):
    r = httpx.post(server.url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_a_system_message_opens_the_next_user_turn_and_is_counted(server, model):
    """Most chat clients send a system message first; the template has no such turn, so its text opens the user's."""
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        "max_tokens": 8, "temperature": 0}).json()
    prompt = chat.encode_turns([("user", "Be brief.\n\nhello")]) + bytes([chat.ASSISTANT])
    want = generate(model, [prompt], 8, bf16=False)[0].split(bytes([chat.END]))[0]
    assert r["choices"][0]["message"]["content"] == want.decode("utf-8", "replace")
    assert r["usage"]["prompt_tokens"] == len(prompt)
    assert httpx.get(server.url + "/health").json()["counters"]["serve.system_messages_folded"] >= 1


def test_models_are_named_as_openai_names_them_and_what_is_not_supported_says_so(server):
    """An unknown model is a 404 (as vLLM answers; it was served by whatever model ran), GET /v1/models/<id> is the
    model card (client.models.retrieve), and a sampling option we lack says "not supported" rather than a bound."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert client.models.retrieve("dormouse-test").id == "dormouse-test"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user",
                                                                                              "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and "dormouse-test" in r.text
    for path, body, param in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0.5},
                               "top_p"),
                              ("/v1/completions", {"prompt": "x", "logprobs": 1}, "logprobs")):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert "not supported" in r.json()["error"]["message"], r.text


def test_the_model_answers_to_its_started_name_its_artifact_and_served_names(model):
    """`--preset tiny` serves "tiny" (vLLM's served name defaults to its model argument), the artifact's name too, and
    --served-model-name adds more; replies carry the first; any other name is a 404 that lists them."""
    from dormouse.serve.app import arg_parser, served_names

    args = arg_parser().parse_args(["--preset", "tiny", "--served-model-name", "mine", "tiny"])
    names = served_names(args, "dormouse-tiny-0123abcd")
    assert names == ["tiny", "dormouse-tiny-0123abcd", "mine"]
    assert served_names(arg_parser().parse_args(["--model", "results/store/rl/x"]), "dormouse-rl-x") == \
        ["results/store/rl/x", "dormouse-rl-x"]
    s = Server(model, Limits(max_prompt_bytes=2000), names=names)
    try:
        assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == names
        for name in names:
            assert httpx.get(f"{s.url}/v1/models/{name}").json()["id"] == name
            r = httpx.post(s.url + "/v1/completions", json={"model": name, "prompt": "ab", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
        r = httpx.post(s.url + "/v1/completions", json={"model": "dormouse-test", "prompt": "ab", "max_tokens": 2})
        assert r.status_code == 404 and all(n in r.json()["error"]["message"] for n in names)
    finally:
        s.close()


def test_a_port_in_use_is_one_line_before_anything_loads(tmp_path):
    import socket

    from dormouse.serve.app import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port} .*--port"):
            main(["--model", str(tmp_path / "no-such-model"), "--port", str(port)])


def test_deep_json_an_over_large_body_and_unknown_routes_get_error_bodies(server):
    r = httpx.post(server.url + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, headers=JSON)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"  # RecursionError: was a 500
    r = httpx.post(server.url + "/v1/completions", content=b" " * ((1 << 20) + 1), headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "http_404"
    assert server.health()["status"] == "ok"


def test_a_decode_error_fails_its_streams_and_the_server_goes_on(model, monkeypatch):
    """A failed prefill (an out-of-memory on a long prompt) or step fails the streams it took down with a 500 (an SSE
    error event once streaming), counted; the decode thread lives and the next request is served (it once hung every
    request forever)."""
    from dormouse.serve import batcher as batcher_mod

    real_prefill = batcher_mod.prefill_prompts

    def prefill(model_, prompts, *a, **kw):
        if any(b"BOOM" in p for p in prompts):
            raise RuntimeError("CUDA out of memory (injected)")
        return real_prefill(model_, prompts, *a, **kw)

    monkeypatch.setattr(batcher_mod, "prefill_prompts", prefill)
    s = Server(model)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "BOOM", "max_tokens": 4}, timeout=30)
        assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]
        real_step, calls = model.step, {"n": 0}

        def step(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("a kernel failed (injected)")
            return real_step(*a, **kw)

        monkeypatch.setattr(model, "step", step)
        with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "go", "max_tokens": 50, "stream": True},
                          timeout=30) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert "a kernel failed" in events[-2] and events[-1] == "data: [DONE]"
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 4}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        h = s.health()
        assert h["status"] == "ok" and h["counters"]["serve.errors"] == 2 and "kernel failed" in h["last_error"]
    finally:
        s.close()


def test_a_client_that_leaves_a_whole_reply_frees_its_row(monkeypatch):
    """A non-streaming client that gives up: the server notices within a second (it polls) and cancels the stream
    (it once decoded on to max_tokens). Steps slowed to 5 ms so the reply cannot end first."""
    model = tiny_model()
    real_step = model.step

    def slow_step(*a, **kw):
        time.sleep(0.005)
        return real_step(*a, **kw)

    monkeypatch.setattr(model, "step", slow_step)
    s = Server(model)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(s.url + "/v1/completions", json={"prompt": "go on", "max_tokens": 4000, "temperature": 1.0},
                       timeout=0.5)
        deadline = time.monotonic() + 30
        while (h := s.health())["counters"].get("serve.streams_cancelled", 0) < 1:
            assert time.monotonic() < deadline, h
            time.sleep(0.05)
        assert h["live_streams"] == 0 and h["counters"].get("serve.finished.length", 0) == 0
        assert h["counters"]["serve.clients_gone"] == 1 and h["counters"]["serve.steps"] < 1000
    finally:
        s.close()


def test_a_chat_reply_stops_at_a_byte_that_would_open_a_turn_and_tiny_temperatures_are_greedy():
    from dormouse.serve.batcher import sample_with_uniforms

    got, chat_stops = [], frozenset({chat.USER, chat.ASSISTANT, chat.END})
    s = Stream(b"p", 100, emit=got.append, finish=lambda *a: None, stop_bytes=chat_stops)
    assert s.take(ord("a")) is None and s.take(chat.ASSISTANT) == "stop" and got == ["a"]  # 0x02 is not sent on
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    assert sample_with_uniforms(logits, 1.0, 2, torch.zeros(1)).item() == 1  # u = 0: the first byte top-k keeps, not 0
    server_batcher = Batcher(tiny_model(), torch.device("cpu"), bf16=False)
    rows = [Stream(b"p", 4, emit=lambda t: None, finish=lambda *a: None, temperature=1e-40)]
    assert server_batcher._sample(rows, logits).tolist() == [1]  # greedy, not a NaN softmax's 0xFF


# --------------------------------------------------------------------------------------------------
# Chunked prefill (issue #42): a long prompt is prefilled in pieces between the decode steps of the others
# --------------------------------------------------------------------------------------------------
def live_tiny() -> ByteLM:
    """TINY with every branch live (tiny_model's blocks are inert at init: its logits see the last byte only, so a
    state carried wrongly between pieces would change nothing)."""
    from model_util import live_model

    return live_model(ModelConfig.from_dict(TINY), seed=0, scale=0.05)


def rand_prompt(n: int, seed: int) -> bytes:
    from model_util import rand_bytes

    return bytes(rand_bytes(1, n, seed)[0].tolist())


def make_batcher(kind: str, model: ByteLM, max_batch: int, prefill_chunk: int, thread: bool = True,
                 prefill_ms: float | None = None):
    """prefill_ms None (default here): one piece's bytes a turn in all, so a test counts its turns' pieces exactly."""
    from dormouse.posttrain.decode import DecodeStep
    from dormouse.serve.batcher import GraphedBatcher

    b = (GraphedBatcher if kind == "graphed" else Batcher)(model, torch.device("cpu"), bf16=False, max_batch=max_batch,
                                                           prefill_chunk=prefill_chunk, prefill_ms=prefill_ms)
    if thread:
        b.start()
    elif kind == "graphed":
        b.step = DecodeStep(model, max_batch, bf16=False, max_steps=b.decode_steps)  # as start() builds it, no thread
    return b


def loop_turn(b: Batcher, carry: tuple) -> tuple:
    """One turn of the decode loop without its thread: admit (and prefill), then advance the rows there are."""
    rows, logits, state = b._admit(*carry)
    return b._advance(rows, logits, state) if rows else (rows, logits, state)


def run_streams(b: Batcher, streams: list[Stream]) -> None:
    done = threading.Semaphore(0)
    for s in streams:
        finish = s.finish
        s.finish = lambda *a, f=finish: (f(*a), done.release())
        b.submit(s)
    for _ in streams:
        assert done.acquire(timeout=30)


def greedy(prompt: bytes, n: int, **kw) -> Stream:
    return Stream(prompt, n, emit=lambda t: None, finish=lambda *a: None, temperature=0.0, stop_bytes=frozenset(),
                  **kw)


def test_a_prompt_prefilled_in_pieces_ends_in_the_whole_prompts_state(one_thread):
    """The batcher's pieces (64 bytes a turn, each continuing the last one's state) end where one whole prefill
    does, to fp32 rounding, counted per piece."""
    model, prompt = live_tiny(), rand_prompt(700, 3)
    b = make_batcher("eager", model, 4, 64, thread=False)
    s = greedy(prompt, 1, group=object())
    b.prefilling[s.group] = deque([s])
    seen = []
    with torch.inference_mode():
        while (whole := b._prefill_turn()) is None:
            seen.append(s.prefilled)
        want_lg, want_st = prefill_prompts(model, [prompt])
    assert seen == list(range(64, 700, 64)) and whole[0] == [s] and not b.prefilling and s.prefill_state is None
    torch.testing.assert_close(whole[1], want_lg, atol=5e-5, rtol=1e-5)  # test_decode's fp32 tolerance
    for got, want in zip(whole[2].tensors(), want_st.tensors()):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    c = b.counters
    assert (c["serve.prefills"], c["serve.prefill_chunks"], c["serve.prefill_bytes"]) == (11, 11, 700)


@pytest.mark.parametrize("decode", ["eager", "graphed"])
def test_chunked_prefill_changes_no_byte_greedy_or_seeded_alone_or_in_company(decode, one_thread):
    """Greedy: a 700-byte prompt prefilled in 64-byte pieces continues with generate's bytes (the whole prompt in
    one prefill). Seeded: a stream's bytes are the same prefilled whole or in pieces, alone or while other prompts
    are prefilled and decoded beside it."""
    model = live_tiny()
    long = rand_prompt(700, 3)
    want = generate(model, [long], 40, stop_byte=None, bf16=False)[0]
    for chunk in (64, 0):
        b = make_batcher(decode, model, 8, chunk)
        try:
            s = greedy(long, 40)
            run_streams(b, [s])
            assert bytes(s.out) == want, chunk
        finally:
            b.stop()
    seeded = {}
    for chunk, company in ((0, False), (64, False), (64, True)):
        b = make_batcher(decode, model, 8, chunk)
        try:
            mine = Stream(long, 40, emit=lambda t: None, finish=lambda *a: None, temperature=1.0, top_k=50, seed=11,
                          stop_bytes=frozenset())
            others = [Stream(rand_prompt(n, n), 60, emit=lambda t: None, finish=lambda *a: None, temperature=1.0,
                             stop_bytes=frozenset()) for n in (40, 130, 900)] if company else []
            run_streams(b, others + [mine])
            seeded[chunk, company] = bytes(mine.out)
            assert (b.counters["serve.max_batch_seen"] > 1) == company
        finally:
            b.stop()
    assert len(set(seeded.values())) == 1 and len(seeded[0, False]) == 40, seeded


@pytest.mark.parametrize("chunk", [512, 0])
@pytest.mark.parametrize("decode", ["eager", "graphed"])
def test_a_running_stream_gets_bytes_while_a_long_prompt_is_prefilled(decode, chunk, monkeypatch):
    """The decode steps of a running stream between an 8 KB request's admission (its first prefill piece) and its
    first byte: one per piece but the last in 512-byte pieces (15), none with whole prompts (the stall chunking
    removes), and counted."""
    model = tiny_model()
    events: list[str] = []
    real_prefill = model.prefill

    def prefill(idx, *a, **kw):  # ByteLM.step is a one-byte prefill: tell pieces and steps apart by length
        events.append("piece" if idx.shape[1] > 1 else "step")
        return real_prefill(idx, *a, **kw)

    monkeypatch.setattr(model, "prefill", prefill)
    b = make_batcher(decode, model, 4, chunk)
    try:
        running = greedy(b"go on", 10**6)
        b.submit(running)
        deadline = time.monotonic() + 10
        while running.new_bytes < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        at = len(events)
        first = threading.Event()
        b.submit(Stream(b"x" * 8192, 1, emit=lambda t: None, finish=lambda *a: (events.append("first"), first.set())))
        assert first.wait(timeout=30)
        after = events[at:]
        admitted = after.index("piece")
        assert after[admitted:].count("piece") == (16 if chunk else 1)
        assert after[admitted:after.index("first")].count("step") == (15 if chunk else 0)
        if chunk:
            assert b.counters["serve.steps_during_prefill"] >= 15 and b.counters["serve.prefill_chunks"] >= 17
    finally:
        running.cancel()
        b.stop()


def test_pieces_go_round_robin_over_requests_and_fill_the_turn(one_thread):
    """64 bytes a turn: request X's first prompt and request Y's take turns (a request's own prompts first come first
    served); Z's three short prompts fill a turn together (no piece fits beside them); a prompt is cut at multiples
    of 64 whatever shares the turn."""
    model = live_tiny()
    b = make_batcher("eager", model, 8, 64, thread=False)
    X, Y, Z = object(), object(), object()
    xs = [greedy(rand_prompt(200, 1), 1, group=X), greedy(rand_prompt(100, 2), 1, group=X)]
    ys = [greedy(rand_prompt(150, 3), 1, group=Y)]
    zs = [greedy(rand_prompt(10, i), 1, group=Z) for i in (4, 5, 6)]
    for s in xs + ys + zs:
        b.prefilling.setdefault(s.group, deque()).append(s)
    progress, whole = [], []
    with torch.inference_mode():
        while b.prefilling:
            done = b._prefill_turn()
            progress.append([s.prefilled for s in xs + ys + zs])
            whole.append([id(s) for s in done[0]] if done else [])
    assert progress[:4] == [[64, 0, 0, 0, 0, 0], [64, 0, 64, 0, 0, 0], [64, 0, 64, 10, 10, 10],
                            [128, 0, 64, 10, 10, 10]], progress
    assert whole[2] == [id(s) for s in zs]  # Z's three, whole in one turn
    assert progress[-1] == [200, 100, 150, 10, 10, 10] and b.counters["serve.prefill_bytes"] == 480
    for i, s in enumerate(xs + ys + zs):
        assert all(p[i] % 64 == 0 or p[i] == len(s.prompt) for p in progress)


def test_a_turns_prefill_is_bounded_by_time_while_streams_decode_and_takes_every_piece_when_none_do(one_thread):
    """--prefill-ms: with streams decoding, a turn takes the pieces the measured rate prefills in prefill_ms (at
    least one; one piece's bytes before any rate is measured), with none decoding every prompt's next piece; each
    prompt is still cut at multiples of prefill_chunk, and the rate is measured from the turns that ran."""
    model = live_tiny()
    b = make_batcher("eager", model, 8, 64, thread=False, prefill_ms=10)
    streams = [greedy(rand_prompt(200, 20 + i), 1, group=object()) for i in range(5)]  # five requests
    for s in streams:
        b.prefilling.setdefault(s.group, deque()).append(s)
    assert b.turn_budget(live=True) == 64 and b.turn_budget(live=False) == 64 * 8
    with torch.inference_mode():
        b._prefill_turn(live=True)  # no rate yet: one piece
        assert [s.prefilled for s in streams] == [64, 0, 0, 0, 0] and b.prefill_rate > 0
        b._measured = lambda n, s: None  # hold the rate at 19 200 bytes/s: 192 bytes in 10 ms, three pieces
        b.prefill_rate = 19_200
        assert b.turn_budget(live=True) == 192
        b._prefill_turn(live=True)
        assert [s.prefilled for s in streams] == [64, 64, 64, 64, 0]
        b._prefill_turn(live=False)  # nothing decodes: every prompt's next piece
        assert [s.prefilled for s in streams] == [128, 128, 128, 128, 64]
        b.prefill_rate = 1.0  # a slow device: still one piece a turn
        b._prefill_turn(live=True)
        assert sum(s.prefilled for s in streams) == 576 + 64
    assert all(s.prefilled % 64 == 0 for s in streams)


def test_a_graphed_row_paused_after_k_steps_waits_with_its_bytes_delivered(one_thread):
    """k decode steps leave up to k unread bytes a row; a row paused for another request gets them delivered as it
    pauses (its client waits with nothing held back), and every stream's greedy bytes are still generate's."""
    model = live_tiny()
    b = make_batcher("graphed", model, 2, 64, thread=False)
    big = object()
    streams = [greedy(rand_prompt(20, 30 + i), 40, group=big) for i in range(3)]  # three for two rows: one waits
    carry = ([], None, None)
    turn = partial(loop_turn, b)

    with torch.inference_mode():
        for s in streams:
            b.submit(s)
        while b.counters["serve.decode_k.8"] == 0:  # the waiting third gets no row: k steps a read
            carry = turn(carry)
        small = greedy(b"small", 6)
        b.submit(small)
        before = [s.new_bytes for s in streams[:2]]
        carry = turn(carry)  # a row of the big request pauses for it
        assert b.counters["serve.preempted"] == 1
        paused = next(s for s in streams[:2] if s.paused is not None)
        assert int(paused.paused.n_drawn.sum()) == 0 and paused.new_bytes > before[streams.index(paused)]
        while not all(s.done for s in streams + [small]):
            carry = turn(carry)
    for s in streams + [small]:
        assert bytes(s.out) == generate(model, [s.prompt], s.max_new_bytes, stop_byte=None, bf16=False)[0]


@pytest.mark.parametrize("decode", ["eager", "graphed"])
def test_a_stream_paused_while_prefilling_keeps_what_it_prefilled(decode, one_thread):
    """With the batch full, a request under its share takes the row of the big request's stream still being
    prefilled (the least decoded): it goes back to the waiting line with its pieces' state, rejoins later from
    there, and every stream's greedy bytes are generate's."""
    model = live_tiny()
    b = make_batcher(decode, model, 2, 32, thread=False)
    big = object()
    streams = [greedy(rand_prompt(100, 7), 12, group=big), greedy(rand_prompt(200, 8), 12, group=big)]
    carry = ([], None, None)
    turn = partial(loop_turn, b)

    with torch.inference_mode():
        for s in streams:
            b.submit(s)
        while streams[1].prefilled < 64:
            carry = turn(carry)
        assert carry[0] == [streams[0]] and streams[1].prefilled == 64
        small = greedy(b"small", 12)
        b.submit(small)
        carry = turn(carry)
        assert b.counters["serve.preempted"] == 1 and list(b.waiting[big]) == [streams[1]]
        assert streams[1].prefilled == 64 and streams[1].prefill_state is not None and streams[1].paused is None
        while not all(s.done for s in streams + [small]):
            carry = turn(carry)
    for s in streams + [small]:
        assert bytes(s.out) == generate(model, [s.prompt], 12, stop_byte=None, bf16=False)[0]
    assert b.counters["serve.prefill_bytes"] == 305  # the paused prompt's first 64 bytes were not prefilled again


def test_health_counts_prefill_pieces_and_the_cli_takes_the_chunk(server, capsys):
    """A 1 500-byte prompt through the server at --prefill-chunk 512 (the fixture's prompts stay under 2 000 bytes,
    the default chunk is 2 048): three pieces, counted in /health, the
    reply the one the whole prompt gives; --prefill-chunk is in --help and a negative one is refused before loading."""
    from dormouse.serve.app import main

    before = server.health()["counters"]
    prompt = "a long prompt, " * 100
    server.batcher.prefill_chunk = 512  # a module-scoped server: put back below
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
        h = server.health()
    finally:
        server.batcher.prefill_chunk = PREFILL_CHUNK
    alone = generate(server.batcher.model, [prompt.encode()], 8, bf16=False)[0].split(bytes([chat.END]))[0]
    assert r["choices"][0]["text"] == alone.decode("utf-8", "replace")
    assert h["prefill_chunk"] == 512 and h["prefilling_streams"] == 0 and PREFILL_CHUNK == 2048
    grew = {k: h["counters"][k] - before.get(k, 0) for k in ("serve.prefill_chunks", "serve.prefill_bytes")}
    assert grew == {"serve.prefill_chunks": 3, "serve.prefill_bytes": 1500}
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--prefill-chunk" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--model", "nowhere", "--prefill-chunk", "-1"])
    assert e.value.code == 2 and "--prefill-chunk must be >= 0" in capsys.readouterr().err
