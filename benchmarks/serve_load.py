"""The load `benchmarks/serve_bench.py` and `benchmarks/serve_host_path.py` put on `dormouse serve`: the server on
loopback in this process (its decode thread and event loop), N streamed completions at a time over HTTP and SSE
from httpx, in a process of their own for the timed load, each arm under its own time limit."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import uvicorn

from dormouse.serve import batcher as batcher_mod
from dormouse.serve.app import create_app

ARMS = {"batched": batcher_mod.Batcher, "graphed": batcher_mod.GraphedBatcher, "unbatched": batcher_mod.Batcher}


class Deadline:
    """An arm's time limit: its own --arm-timeout-s, never past the run's --budget-s."""

    def __init__(self, seconds: float, run_end: float = float("inf")):
        self.end = min(time.perf_counter() + seconds, run_end)

    def left(self) -> float:
        return max(0.0, self.end - time.perf_counter())

    def passed(self) -> bool:
        return time.perf_counter() >= self.end


def prompts_for(requests: int, prompt_bytes: int) -> list[bytes]:
    """The same prompts for every arm (ASCII: one byte each, ours' bytes = the peer's tokens)."""
    return [(f"request {i}: " + "the quick brown fox " * (prompt_bytes // 20 + 2))[:prompt_bytes].encode()
            for i in range(requests)]


def start_server(model, device, max_batch: int, keep_end: bool, arm: str = "batched"):
    b = ARMS[arm](model, device, bf16=True, max_batch=max_batch)
    b.bench_streams = []  # every stream submitted: their new_bytes are the bytes decoded, finished or not

    def submit(s, submit=b.submit):
        if not keep_end:  # every request decodes --max-tokens bytes: equal work in every arm
            s.stop_bytes = frozenset()
        b.bench_streams.append(s)
        return submit(s)

    b.submit = submit
    b.start()
    server = uvicorn.Server(uvicorn.Config(create_app(b, "bench"), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return b, server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


async def one(client: httpx.AsyncClient, url: str, prompt: bytes, max_tokens: int, seed: int, rec: dict) -> None:
    """One streamed completion; rec is filled as it goes, so a request cut by the time limit keeps what it had."""
    rec["t0"] = time.perf_counter()
    body = {"prompt": prompt.decode(), "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                rec["bytes"] = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"] and rec["first"] is None:
                rec["first"] = time.perf_counter()
    rec["end"] = time.perf_counter()


async def load(url: str, concurrency: int, prompts: list[bytes], max_tokens: int, deadline: Deadline,
               at_deadline=lambda: None) -> tuple[list[dict], float, bool]:
    """All prompts, `concurrency` at a time, until done or the deadline: (per-request records, wall seconds, cut).
    at_deadline() runs once the load ends, before a cut load's requests are cancelled."""
    sem = asyncio.Semaphore(concurrency)
    recs = [{"t0": None, "first": None, "end": None, "bytes": 0} for _ in prompts]

    async def guarded(client, i):
        async with sem:
            await one(client, url, prompts[i], max_tokens, i, recs[i])

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(guarded(client, i)) for i in range(len(prompts))]
        done, pending = await asyncio.wait(tasks, timeout=deadline.left())
        wall = time.perf_counter() - t0
        at_deadline()
        for t in pending:  # the clients go away; the server cancels their streams
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        failed = [t.exception() for t in done if t.exception() is not None]  # each one retrieved
        if failed:
            raise failed[0]  # a failed request fails the arm (its row says so)
    return recs, wall, bool(pending)


def _client(conn, url: str, concurrency: int, prompts: list[bytes], max_tokens: int, seconds: float) -> None:
    """The timed load in its own process: (recs, wall, cut) back through `conn`; when the load ends it says "ended"
    and waits for "go" (the server counts what it decoded) before cancelling a cut load's requests."""
    def at_deadline():
        conn.send("ended")
        conn.poll(60) and conn.recv()

    try:
        conn.send(("done", asyncio.run(load(url, concurrency, prompts, max_tokens, Deadline(seconds), at_deadline))))
    except BaseException as e:  # noqa: BLE001 - the parent raises it: a failed request fails the arm
        conn.send(("failed", f"{type(e).__name__}: {e}"))


def load_elsewhere(url: str, concurrency: int, prompts: list[bytes], max_tokens: int, deadline: Deadline,
                   at_deadline) -> tuple[list[dict], float, bool]:
    """`load` from a spawned process: a client in the server's process takes the GIL from its decode thread and
    event loop (on the dev VM's CPU it halved the bytes/s; real clients are elsewhere)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork is unsafe once CUDA is up
    here, there = ctx.Pipe()
    p = ctx.Process(target=_client, args=(there, url, concurrency, prompts, max_tokens, deadline.left()), daemon=True)
    p.start()
    try:
        msg = here.recv()
        if msg == "ended":
            at_deadline()
            here.send("go")
            msg = here.recv()
    except EOFError:
        raise RuntimeError(f"the client process died (exit {p.exitcode})") from None
    finally:
        p.join(timeout=30)
    if msg[0] == "failed":
        raise RuntimeError(f"the client process: {msg[1]}")
    return msg[1]
