"""The load `benchmarks/serve_bench.py` and `benchmarks/serve_host_path.py` put on `dormouse serve`: the server on
loopback in this process (its decode thread and event loop), N streamed completions at a time over HTTP and SSE
from httpx, each arm under its own time limit. The timed load runs in a client process of its own (`ClientProcess`,
started once: the clients' Python would otherwise take the GIL from the server's decode thread and event loop).
This module imports no torch at the top, so that process starts in a fraction of a second."""

from __future__ import annotations

import asyncio
import atexit
import copy
import json
import threading
import time

import httpx

ARMS = ("batched", "graphed", "graphed_k1", "compiled", "unbatched")  # ours: graphed = `dormouse serve --decode
# graphed`, graphed_k1 = the same with `--decode-steps 1` (a host read a step, as before #57), compiled = graphed with
# `--compile cuda` (on a copy of the model: compiling binds to the modules it is given)


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
    import uvicorn

    from dormouse.serve import batcher as batcher_mod
    from dormouse.serve.app import create_app

    from dormouse.serve.weights import cast_for_autocast, stack_projections

    if arm == "compiled":
        model = copy.deepcopy(model)
    cast = cast_for_autocast(model, device) if device.type == "cuda" else {}  # as `dormouse serve` does (in place)
    cast.update(stack_projections(model))
    if arm == "compiled":
        b = batcher_mod.GraphedBatcher(model, device, bf16=True, max_batch=max_batch, compile=True)
    elif arm in ("graphed", "graphed_k1"):
        b = batcher_mod.GraphedBatcher(model, device, bf16=True, max_batch=max_batch,
                                       **({"decode_steps": 1} if arm == "graphed_k1" else {}))
    else:
        b = batcher_mod.Batcher(model, device, bf16=True, max_batch=max_batch)
    b.counters.update(cast)
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


def _serve_loads(conn) -> None:
    """The client process: each job (url, concurrency, prompts, max_tokens, end) is one `load` until the wall-clock
    `end` (time.time(): perf_counter is per process); (status, result) goes back. When a load ends it says "ended"
    and waits for "go" (the server counts what it decoded) before cancelling a cut load's requests. None: stop."""
    conn.send("ready")
    while (job := conn.recv()) is not None:
        url, concurrency, prompts, max_tokens, end = job

        def at_deadline():
            conn.send("ended")
            conn.recv()

        try:
            conn.send(("done", asyncio.run(load(url, concurrency, prompts, max_tokens, Deadline(end - time.time()),
                                                at_deadline))))
        except Exception as e:  # noqa: BLE001 - the parent raises it: a failed request fails the arm
            conn.send(("failed", f"{type(e).__name__}: {e}"))


class ClientProcess:
    """A spawned process that runs `load`s for this one. Started once and waited for (an arm's time limit must not
    pay a Python start); one that died is an error on the load it was running, and the next load starts another."""

    def __init__(self):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # fork is unsafe once CUDA is up
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_loads, args=(there,), daemon=True)
        self.proc.start()
        there.close()  # the child's end lives in the child only: its death is an EOF here
        if self._receive(timeout=300) != "ready":
            raise RuntimeError("the client process did not start")

    def _receive(self, timeout: float = float("inf")):
        t0 = time.monotonic()
        try:
            while not self.conn.poll(1):
                if not self.proc.is_alive() and not self.conn.poll(0) or time.monotonic() - t0 > timeout:
                    raise EOFError
            return self.conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"the client process ended without a reply (exit {self.proc.exitcode})") from None

    def load(self, url: str, concurrency: int, prompts: list[bytes], max_tokens: int, deadline: Deadline,
             at_deadline) -> tuple[list[dict], float, bool]:
        self.conn.send((url, concurrency, prompts, max_tokens, time.time() + deadline.left()))
        msg = self._receive()
        if msg == "ended":
            try:
                at_deadline()
            finally:  # the child waits for it whatever happened here
                self.conn.send("go")
            msg = self._receive()
        if msg[0] == "failed":
            raise RuntimeError(f"the client process: {msg[1]}")
        return msg[1]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


_clients: ClientProcess | None = None


def start_clients() -> ClientProcess:
    """The run's client process (started here if there is none alive): call it in set-up, before any arm's clock."""
    global _clients
    if _clients is None or not _clients.proc.is_alive():
        _clients = ClientProcess()
        atexit.register(_clients.close)
    return _clients


def load_elsewhere(url: str, concurrency: int, prompts: list[bytes], max_tokens: int, deadline: Deadline,
                   at_deadline) -> tuple[list[dict], float, bool]:
    """`load` from the client process (`start_clients`): on the dev VM's CPU, clients in the server's process halved
    its bytes/s; real clients are elsewhere."""
    return start_clients().load(url, concurrency, prompts, max_tokens, deadline, at_deadline)
