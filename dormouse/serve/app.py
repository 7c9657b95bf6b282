"""`dormouse serve`: a finished model behind an OpenAI-compatible HTTP API, with a chat page.

    dormouse serve --preset small                    # the preset's rl model (the artifact the chain ships)
    dormouse serve --preset small --rung int8        # one of its exported rungs
    dormouse serve --preset tiny --set train.steps=50   # the rl model of `snakemake --config set=train.steps=50`
    dormouse serve --model results/store/sft/<digest> --port 8001   # any pretrain/sft/rl artifact

Endpoints: POST /v1/chat/completions and /v1/completions (OpenAI's request and response shapes, `stream: true` as
server-sent events, `usage` counted in bytes: this is a byte model), GET /v1/models, /health (live streams, the
decode state's bytes per stream, streams whose prompts are being prefilled, counters) and / (a chat page). Chat turns go through the chat template
(dormouse/data/chat.py: user and assistant roles); completions continue the raw prompt text. Every live
stream decodes in one batched step (dormouse/serve/batcher.py), rows shared fairly between requests; a new prompt is
prefilled --prefill-chunk bytes at a time between those steps, so a long one does not stall the others. Bad requests
get a 400 (413 for a body over --max-body-bytes, counted while it is read, chunked included) with OpenAI's error
body ({"error": {"message", "type", "param", "code"}}); a client that goes away frees its row (counted); a decode
error fails only its streams (500, or an SSE error event).

Against other clients and web pages (dormouse/serve/guard.py): POSTs must be application/json, a browser's Origin
the server's own, Host one of --allowed-hosts; --api-key requires a Bearer key on /v1; a connection gets
--read-timeout to send its request, at most --max-connections are open (the longest idle closed first), and one
request may carry --max-prompts prompts and ask for --max-request-tokens bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from dormouse.data import chat
from dormouse.model.regions import uncompile_regions
from dormouse.serve.batcher import DECODE_STEPS, PREFILL_CHUNK, PREFILL_MS, Batcher, GraphedBatcher, Stream
from dormouse.serve.guard import Guard, default_allowed_hosts, error_body, raise_file_limit
from dormouse.serve.mailbox import mailbox_of
from dormouse.serve.page import PAGE
from dormouse.serve.weights import cast_for_autocast, stack_projections

MAX_NEW_BYTES = 4096  # max_tokens ceiling (bytes)
MAX_STOPS, MAX_STOP_CHARS = 4, 64  # OpenAI's up-to-4 stop sequences; a stop is matched on every byte decoded


class Limits(BaseModel):
    max_prompt_bytes: int = 16384
    max_body_bytes: int = 1 << 20  # the request body before it is parsed (413 above)
    read_timeout: float = 15.0  # seconds to send a request's head (from connecting or the last reply), then its body
    max_connections: int = 1000  # open connections; over it the one idle longest is closed
    max_messages: int = 64
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_request_tokens: int = 65536  # bytes one request may ask for: its prompts times max_tokens
    default_max_tokens: int = 256


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Sampling(BaseModel):
    """The fields both endpoints share; unknown fields are ignored (clients send many), known ones are typed."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_BYTES)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=1, le=256)
    top_p: float | None = None  # only 1 (no nucleus sampling): anything else is refused by name
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="torch.Generator's range")
    stream_options: dict | None = None

    @field_validator("top_p")
    @classmethod
    def _no_nucleus(cls, v):
        if v is not None and v != 1:
            raise ValueError("not supported: nucleus sampling (only top_p 1; use temperature or top_k)")
        return v

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stops):
            raise ValueError(f"at most {MAX_STOPS} stop sequences of at most {MAX_STOP_CHARS} characters")
        return v

    def stops(self) -> tuple[str, ...]:
        s = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(x for x in s if x)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_BYTES)
    logprobs: bool | None = None  # refused when true: log-probs are not served
    top_logprobs: int | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = None  # refused when > 0: log-probs are not served

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("not supported: log-probs are not served")
        return v


class ClientGone(Exception):
    """The client closed its connection before its reply was whole (its stream is cancelled)."""


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"], where or None


def chat_prompt(req: ChatRequest, limits: Limits) -> bytes:
    if len(req.messages) > limits.max_messages:
        raise BadRequest(f"messages: {len(req.messages)} messages, at most {limits.max_messages}", "messages")
    turns, system = [], []
    for i, m in enumerate(req.messages):
        if m.role in ("system", "developer"):  # no such turn in the template: its text opens the next user turn
            system.append(m.text())
            continue
        if m.role not in chat.ROLE_OPENERS:
            raise BadRequest(f"messages.{i}.role: {m.role!r} is not in this model's chat template "
                             f"(roles: {', '.join(sorted(chat.ROLE_OPENERS))}, and system, folded into the next user "
                             f"turn)", f"messages.{i}.role")
        text = m.text()
        if system and m.role == "user":
            text, system = "\n\n".join([*system, text]), []
        turns.append((m.role, text))
    if not turns:
        raise BadRequest("messages: no user message (system messages open the next user turn)", "messages")
    if turns[-1][0] != "user":
        raise BadRequest("messages: the last message must be the user's (the model writes the assistant turn)", "messages")
    try:
        return chat.encode_turns(turns) + bytes([chat.ASSISTANT])
    except chat.ChatTemplateError as e:
        raise BadRequest(f"messages: {e}", "messages") from None
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") is valid JSON and no UTF-8
        raise BadRequest(f"messages: not encodable as UTF-8 ({e.reason} at index {e.start})", "messages") from None


def completion_prompts(req: CompletionRequest) -> list[bytes]:
    """Each prompt's bytes (a list of prompts gets one choice each, `index` in order)."""
    if req.echo:
        raise BadRequest("echo is not served (nor are prompt log-probs)", "echo")
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if req.stream and len(prompts) > 1:
        raise BadRequest("prompt: stream one prompt per request", "prompt")
    out = []
    for i, p in enumerate(prompts):
        found = chat.RESERVED_PATTERN.search(p)
        if found:
            raise BadRequest(f"prompt: byte 0x{ord(found.group()):02x} at index {found.start()} (prompt {i}) is reserved "
                             "for the chat template's turn boundaries", "prompt")
        if not p:
            raise BadRequest(f"prompt: prompt {i} is empty (there is no context to continue)", "prompt")
        try:
            out.append(p.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate is valid JSON and no UTF-8
            raise BadRequest(f"prompt: prompt {i} is not encodable as UTF-8 ({e.reason} at index {e.start})", "prompt") from None
    return out


@dataclass(frozen=True, slots=True)
class ServeState:
    """What the handlers share, on app.state.serve (one app per server; tests build several in one process)."""

    batcher: Batcher
    names: tuple[str, ...]  # every name the model answers to; the first is the one replies carry
    limits: Limits
    info: dict | None
    api_key: str | None

    @property
    def model_id(self) -> str:
        return self.names[0]

    def card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "dormouse"}


def serve_state(request: Request) -> ServeState:
    return request.app.state.serve


async def read_body(request: Request, limits: Limits) -> bytes:
    """The body, refused with a 413 as soon as it passes max_body_bytes: a Content-Length over it before a byte is
    read, a chunked one when its running total does (neither uvicorn nor Starlette caps a request body)."""
    too_big = BadRequest(f"the request body is over {limits.max_body_bytes} bytes", code="request_too_large",
                         status=413)
    if int(request.headers.get("content-length") or 0) > limits.max_body_bytes:  # h11 checked it is a number
        raise too_big
    parts, size = [], 0
    try:
        async with asyncio.timeout(limits.read_timeout):  # a body trickled byte by byte holds its connection
            async for part in request.stream():
                size += len(part)
                if size > limits.max_body_bytes:
                    raise too_big
                parts.append(part)
    except TimeoutError:
        raise BadRequest(f"the request body took over {limits.read_timeout:g} s to arrive ({size} bytes came)",
                         code="request_timeout", status=408) from None
    return b"".join(parts)


async def parse(request: Request, kind: type[Sampling], limits: Limits) -> Sampling:
    raw = await read_body(request, limits)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"the request body is not JSON: {type(e).__name__}: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise BadRequest(*validation_message(e)) from None


def check_length(prompt: bytes, limits: Limits) -> None:
    if len(prompt) > limits.max_prompt_bytes:
        raise BadRequest(f"the prompt is {len(prompt)} bytes, at most {limits.max_prompt_bytes}",
                         code="context_length_exceeded")


def check_request_size(prompts: list[bytes], max_new: int, limits: Limits) -> None:
    """A request's share of the server: at most max_prompts prompts and max_request_tokens bytes asked for (the
    batcher shares rows fairly between requests; these bound what one request queues)."""
    if len(prompts) > limits.max_prompts:
        raise BadRequest(f"prompt: {len(prompts)} prompts in one request, at most {limits.max_prompts} (send "
                         "the rest in other requests)", "prompt", code="too_many_prompts")
    if len(prompts) * max_new > limits.max_request_tokens:
        raise BadRequest(f"max_tokens: {len(prompts)} prompt(s) x {max_new} max_tokens = {len(prompts) * max_new} "
                         f"bytes asked for, at most {limits.max_request_tokens} per request (lower max_tokens or "
                         "split the prompts)", "max_tokens", code="too_many_tokens")


def check_model(name: str | None, names: tuple[str, ...]) -> None:
    if name not in (None, "", *names):  # as vLLM and OpenAI: a model this server does not serve is a 404
        raise BadRequest(f"the model {name!r} does not exist here; this server serves "
                         f"{' or '.join(map(repr, names))} (GET /v1/models)", "model", code="model_not_found", status=404)


def start(batcher: Batcher, prompt: bytes, req: Sampling, max_new: int, stop_bytes=frozenset({chat.END}),
          group: object = None) -> tuple[Stream, asyncio.Queue]:
    box, q = mailbox_of(asyncio.get_running_loop()), asyncio.Queue()
    deliver = partial(box.put, q)  # from the decode thread: one loop wake-up for what a step delivers
    stream = Stream(prompt, max_new, emit=lambda text: deliver(("text", text)),
                    finish=lambda reason, usage: deliver(("done", reason, usage)),
                    temperature=req.temperature, top_k=req.top_k, stops=req.stops(), seed=req.seed,
                    stop_bytes=stop_bytes, group=group)
    batcher.submit(stream)
    return stream, q


async def collect(request: Request, stream: Stream, q: asyncio.Queue) -> tuple[str, str, dict]:
    """A whole reply; a client that went away meanwhile (polled every second) cancels its stream, freeing its row."""
    parts, checked = [], time.monotonic()
    try:
        while True:
            try:
                item = await asyncio.wait_for(q.get(), timeout=1.0)
            except asyncio.TimeoutError:
                item = None
            if time.monotonic() - checked >= 1.0:  # text arrives every step: poll by the clock, not on silence
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone()
            if item is None:
                continue
            if item[0] == "text":
                parts.append(item[1])
            elif item[1] == "error":
                raise BadRequest(f"the model failed to decode this request: {item[2]['error']}", code="server_error",
                                 status=500)
            else:
                return "".join(parts), item[1], item[2]
    finally:
        stream.cancel()  # a no-op for a stream that finished


async def collect_all(request: Request, started) -> list[tuple[str, str, dict]]:
    try:
        return [await collect(request, stream, q) for stream, q in started]
    finally:
        for stream, _ in started:  # a client gone or an error: the prompts not yet collected stop too
            stream.cancel()


# JSON leaves U+0085, U+2028 and U+2029 raw, and clients that split a stream with str.splitlines (httpx's
# iter_lines) cut a data line there: escaped, each event stays one line (serve_bench's
# graphed arm at 64 streams drew one at init on an H100 and its client failed)
_LINE_BREAKS_SPLITLINES_SEES = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS_SPLITLINES_SEES)}\n\n"


async def sse_events(stream: Stream, q: asyncio.Queue, chunk, include_usage: bool):
    done = False
    try:
        first = chunk(None, None, first=True)
        if first is not None:
            yield sse(first)
        while True:
            item, texts = await q.get(), []
            while item is not None and item[0] == "text":  # what waits already goes in one event: under load the
                texts.append(item[1])  # loop falls behind the decode and events carry several bytes, not one each
                item = q.get_nowait() if not q.empty() else None
            if texts:
                yield sse(chunk("".join(texts), None))
            if item is None:
                continue
            done = True
            if item[1] == "error":  # the stream is already open: the error goes in it, then it ends
                yield sse(error_body(f"the model failed to decode this request: {item[2]['error']}",
                                     code="server_error"))
                yield "data: [DONE]\n\n"
                return
            yield sse(chunk(None, item[1]))
            if include_usage:
                yield sse({**chunk(None, None, usage_only=True), "usage": item[2]})
            yield "data: [DONE]\n\n"
            return
    finally:
        if not done:  # the client went away: free its row
            stream.cancel()


def streaming(stream: Stream, q: asyncio.Queue, chunk, include_usage: bool) -> StreamingResponse:
    return StreamingResponse(sse_events(stream, q, chunk, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def chat_chunk(base: dict, text, reason, first=False, usage_only=False) -> dict:
    if usage_only:
        return {**base, "choices": []}
    delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
    return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}


def completion_chunk(base: dict, text, reason, first=False, usage_only=False) -> dict | None:
    if first:  # completions have no role chunk
        return None
    if usage_only:
        return {**base, "choices": []}
    return {**base, "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}


# No return annotations on the routes: FastAPI would take one as a response_model and re-serialise through it.
async def chat_completions(request: Request):
    s = serve_state(request)
    req = await parse(request, ChatRequest, s.limits)
    check_model(req.model, s.names)
    if req.logprobs or req.top_logprobs is not None:
        raise BadRequest("not supported: log-probs are not served", "logprobs" if req.logprobs else "top_logprobs")
    prompt = chat_prompt(req, s.limits)
    s.batcher.counters["serve.system_messages_folded"] += sum(m.role in ("system", "developer") for m in req.messages)
    check_length(prompt, s.limits)
    max_new = req.max_completion_tokens or req.max_tokens or s.limits.default_max_tokens
    check_request_size([prompt], max_new, s.limits)
    # a reply ends at the turn's END, or at a byte that would open another turn (the next request would refuse it)
    stream, q = start(s.batcher, prompt, req, max_new, stop_bytes=frozenset({chat.USER, chat.ASSISTANT, chat.END}))
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    if not req.stream:
        text, reason, usage = (await collect_all(request, [(stream, q)]))[0]
        return {"id": rid, "object": "chat.completion", "created": created, "model": s.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}],
                "usage": usage}
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": s.model_id}
    return streaming(stream, q, partial(chat_chunk, base), bool((req.stream_options or {}).get("include_usage")))


async def completions(request: Request):
    s = serve_state(request)
    req = await parse(request, CompletionRequest, s.limits)
    check_model(req.model, s.names)
    prompts = completion_prompts(req)
    for prompt in prompts:
        check_length(prompt, s.limits)
    max_new = req.max_tokens or s.limits.default_max_tokens
    check_request_size(prompts, max_new, s.limits)
    group = object()  # the request's prompts share its rows (batcher: fair between requests)
    started = [start(s.batcher, prompt, req, max_new, group=group) for prompt in prompts]
    rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    if not req.stream:
        done = await collect_all(request, started)
        usage = {k: sum(u[k] for _, _, u in done) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {"id": rid, "object": "text_completion", "created": created, "model": s.model_id, "usage": usage,
                "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                            for i, (text, reason, _) in enumerate(done)]}
    stream, q = started[0]
    base = {"id": rid, "object": "text_completion", "created": created, "model": s.model_id}
    return streaming(stream, q, partial(completion_chunk, base), bool((req.stream_options or {}).get("include_usage")))


async def models(request: Request):  # each name a card, as vLLM lists its served names
    s = serve_state(request)
    return {"object": "list", "data": [s.card(n) for n in s.names]}


async def model(request: Request, name: str):  # client.models.retrieve
    s = serve_state(request)
    check_model(name, s.names)
    return s.card(name)


async def health(request: Request):
    s = serve_state(request)
    batcher = s.batcher
    alive = batcher.alive()  # the decode thread: without it nothing decodes
    body = {"status": "ok" if alive else "error", "model": s.model_id, **(s.info or {}), "live_streams": batcher.live,
            "waiting_streams": batcher.waiting_streams(), "prefilling_streams": batcher.prefilling_now,
            "max_batch": batcher.max_batch, "prefill_chunk": batcher.prefill_chunk, "prefill_ms": batcher.prefill_ms,
            "prefill_bytes_per_s": None if batcher.prefill_rate is None else round(batcher.prefill_rate),
            "state_bytes_per_stream": batcher.state_bytes_per_stream,
            "last_error": batcher.last_error,
            "counters": {k: v for k, v in sorted(batcher.counters.items()) if k.startswith("serve.")}}
    return body if alive else JSONResponse(body, status_code=503)


async def page(request: Request):
    s = serve_state(request)
    return PAGE.replace("{{MODEL}}", html.escape(s.model_id)).replace("{{KEY_REQUIRED}}", "true" if s.api_key else "false")


async def on_bad_request(request: Request, e: BadRequest):
    serve_state(request).batcher.counters[f"serve.rejected.{e.code}"] += 1
    # a body refused unread: close the connection rather than read (and drop) the rest of it
    headers = {"Connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(error_body(e.message, e.param, e.code), status_code=e.status, headers=headers)


async def on_http_error(request: Request, e: StarletteHTTPException):  # 404, 405: OpenAI's body, not {"detail"}
    return JSONResponse(error_body(str(e.detail), code=f"http_{e.status_code}"), status_code=e.status_code)


async def on_client_gone(request: Request, e: ClientGone):
    serve_state(request).batcher.counters["serve.clients_gone"] += 1
    return JSONResponse(error_body("client closed the request", code="client_closed_request"), status_code=499)


def create_app(batcher: Batcher, names: str | list[str], limits: Limits | None = None, info: dict | None = None, *,
               api_key: str | None = None, allowed_hosts: list[str] | None = None):
    """The API behind Guard (dormouse/serve/guard.py): allowed_hosts None or ["*"] takes any Host; api_key None
    takes requests without a key. `names`: what the model answers to, the first the one replies carry."""
    app = FastAPI(title="dormouse", docs_url=None, redoc_url=None)
    names = (names,) if isinstance(names, str) else tuple(dict.fromkeys(names))
    app.state.serve = ServeState(batcher, names, limits or Limits(), info, api_key)
    app.state.counters = batcher.counters  # server_config's connection counters go to /health beside the rest
    app.add_middleware(Guard, counters=batcher.counters, api_key=api_key, allowed_hosts=allowed_hosts)
    app.add_exception_handler(BadRequest, on_bad_request)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/", page, methods=["GET"], response_class=HTMLResponse)
    return app


def server_config(app, host: str, port: int, limits: Limits | None = None, **kw):
    """uvicorn's config for the app: its h11 protocol with a read timeout and a connection cap (guard.h11_protocol),
    its own keep-alive timeout (5 s) between requests."""
    import uvicorn

    from dormouse.serve.guard import h11_protocol

    limits = limits or Limits()
    http = h11_protocol(limits.max_connections, limits.read_timeout, app.state.counters)
    return uvicorn.Config(app, host=host, port=port, http=http, **{"log_level": "warning", **kw})


def load(args) -> tuple:
    """(model, device, bf16, model id, info) from --preset/--rung or --model."""
    import torch

    from dormouse.core.store import open_artifact
    from dormouse.train.runtime import device_for, load_model

    device = device_for(args.device or ("cuda" if torch.cuda.is_available() else "cpu"), "serve")
    if args.model:
        art = open_artifact(args.model)
        label = f"{art.manifest['stage']}-{art.path.name[:8]}"
    else:
        from dormouse.planner.plan import plan_from_args

        plan = plan_from_args(args)  # with --set/--corpus: the run `snakemake --config set=... corpus=...` made
        if args.preset not in plan.chain:
            raise SystemExit(f"dormouse serve: no preset {args.preset!r} (known: {', '.join(p for p in plan.presets)})")
        stage = "rl"
        path = Path(plan.artifact_dir(stage, plan.chain[args.preset][stage]))
        if not (path / "manifest.json").exists():
            raise SystemExit(f"dormouse serve: preset {args.preset}'s rl model {path} is not built yet: snakemake "
                             f"results/{plan.view_name(args.preset)}/bench.json{plan.overrides_args()} (or --model DIR "
                             f"for another artifact)")
        art = open_artifact(path)
        label = f"{args.preset}-{path.name[:8]}"
    model, cfg = load_model(art, device)
    if args.rung:
        from dormouse.model import quant

        if not args.preset:
            raise SystemExit("dormouse serve: --rung needs --preset (the rungs are the preset's export artifact)")
        export = open_artifact(Path(plan.artifact_dir("export", plan.chain[args.preset]["export"])))
        rung_file = f"rungs/{args.rung}.safetensors"
        if rung_file not in export.manifest["files"]:
            known = sorted(n[len("rungs/"):-len(".safetensors")] for n in export.files("rungs/"))
            raise SystemExit(f"dormouse serve: export has no rung {args.rung!r} (rungs: {', '.join(known)})")
        model = quant.load_rung_model(export.file(rung_file), cfg, device)
        label += f"-{args.rung}"
    if args.preset:  # which run's model: the overrides pick another artifact than the preset's own
        said = "".join(f", {k}={v}" for k, v in plan.overrides.items())
        rung = f", rung {args.rung} of {export.path}" if args.rung else ""
        print(f"[serve] preset {args.preset}{said}: {art.path}{rung}", flush=True)
    model.eval()
    info = {"artifact": str(art.path), "stage": art.manifest["stage"], "rung": args.rung, "device": str(device)}
    return model, device, True, f"dormouse-{label}", info


def arg_parser() -> argparse.ArgumentParser:
    from dormouse.planner.plan import add_plan_arguments

    ap = argparse.ArgumentParser(prog="dormouse serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", help="serve this preset's finished rl model")
    which.add_argument("--model", type=Path, help="serve this model artifact (pretrain, sft or rl) instead")
    ap.add_argument("--rung", help="one of the preset's export rungs (bf16, int8, fp8, mxfp4, nvfp4, ternary)")
    ap.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                    help="more names the model answers to, beside the --preset or --model it was started with (the "
                         "name replies carry, as vLLM's served name defaults to its model argument) and its artifact's "
                         "name (dormouse-<preset or stage>-<digest>)")
    add_plan_arguments(ap)  # --config, and --set/--corpus to find a run made with those overrides
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when visible)")
    ap.add_argument("--max-batch", type=int, default=64, help="streams decoded together in one step")
    ap.add_argument("--decode", choices=("auto", "eager", "graphed"), default="auto",
                    help="graphed: the static-shape step (dormouse/posttrain/decode.py DecodeStep), one CUDA graph "
                         "replay per byte on CUDA (eager on CPU), sampling on the device with a per-stream seed; a "
                         "seed gives other bytes than eager's (another generator). auto (default): graphed on CUDA "
                         "(small at 64 streams on one H100: 17 678 bytes/s against eager's 2 358, two runs on one machine; "
                         "benchmarks/records/2026-12-06-serve-h100), eager on CPU")
    ap.add_argument("--compile", choices=("auto", "never", "cuda"), default="auto",
                    help="cuda: torch.compile the model's regions (dormouse/model/regions.py) for the graphed decode on "
                         "CUDA, every prefill and step shape compiled at start ($DORMOUSE_COMPILE_CACHE keeps them), so "
                         "a step's elementwise chains fuse. auto (default): cuda whenever the decode is graphed on CUDA, "
                         "else never. Small on one H100 (benchmarks/records/2026-12-07-h100, one run): 15 475 bytes/s at "
                         "64 streams against 11 747 uncompiled, 1 936 against 1 573 to one stream; 20.5 s to start "
                         "against 1.3 s, with a cold compile cache")
    ap.add_argument("--decode-steps", type=int, default=DECODE_STEPS,
                    help="graphed decode: at most this many steps between two host reads while two or more streams "
                         "decode and none waits or is prefilled (a lone stream: 1), each stream's bytes of those steps "
                         "one SSE event (default %(default)s, vLLM's multi-step default; its GPU figures are not yet "
                         "measured, issue #57)")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                    help="prefill a new prompt at most this many bytes at a time, one piece between two decode steps "
                         "of the running streams, so a long prompt does not stall them for its whole prefill "
                         "(default %(default)s; 0: each prompt whole before the next step)")
    ap.add_argument("--prefill-ms", type=float, default=PREFILL_MS,
                    help="while streams decode, a loop turn prefills the waiting prompts' next pieces that fit in about "
                         "this many milliseconds at the measured prefill rate (at least one piece), so the decoding "
                         "streams wait at most about that long a turn; with none decoding, every prompt's next piece "
                         "(up to --max-batch of them) at once (default %(default)s)")
    ap.add_argument("--max-prompt-bytes", type=int, default=Limits().max_prompt_bytes)
    ap.add_argument("--max-body-bytes", type=int, default=Limits().max_body_bytes,
                    help="a request body over this gets a 413 as soon as that many bytes are read (default 1 MiB)")
    ap.add_argument("--max-prompts", type=int, default=Limits().max_prompts,
                    help="prompts in one /v1/completions request at most (default %(default)s)")
    ap.add_argument("--max-request-tokens", type=int, default=Limits().max_request_tokens,
                    help="bytes one request may ask for, its prompts times max_tokens, at most (default %(default)s); "
                         "rows are shared fairly between requests whatever their size")
    ap.add_argument("--read-timeout", type=float, default=Limits().read_timeout,
                    help="seconds a connection gets to send a request's head (from opening, or from its last reply), "
                         "then again its body; then it is closed (default %(default)s)")
    ap.add_argument("--max-connections", type=int, default=Limits().max_connections,
                    help="open connections at most (default %(default)s, lowered to fit the open-file limit, which "
                         "is raised to its hard limit); over it the one idle longest is closed, and when all are busy "
                         "a newcomer gets a 503")
    ap.add_argument("--api-key", default=os.environ.get("DORMOUSE_API_KEY"),
                    help="require 'Authorization: Bearer <key>' on /v1 requests (default: $DORMOUSE_API_KEY, else none); "
                         "the chat page asks for it")
    ap.add_argument("--allowed-hosts", default=None,
                    help="comma-separated names clients reach the server by (the Host header; '*' for any); default: "
                         "localhost, 127.0.0.1, ::1 and --host (this machine's names when --host is 0.0.0.0 or ::)")
    return ap


def batcher_class(decode: str, device) -> type[Batcher]:
    """--decode: graphed or eager, auto = graphed on CUDA (the eager batcher is launch-bound there) else eager."""
    return GraphedBatcher if decode == "graphed" or (decode == "auto" and device.type == "cuda") else Batcher


def start_batcher(cls: type[Batcher], args, model, device, bf16: bool) -> Batcher:
    """The batcher started. A compiled graphed step that cannot start (a compile that fails on this machine) falls back
    to the graphed step uncompiled under --compile auto; a graphed step that cannot start (a capture that fails) to the
    eager batcher under --decode auto; each said, its compiled regions unbound first, and counted in /health
    (serve.compiled_start_failed, serve.graphed_start_failed). A failure nothing may fall back from is raised."""
    compile_on = args.compile == "cuda" or (args.compile == "auto" and device.type == "cuda")
    cast = cast_for_autocast(model, device) if bf16 and device.type == "cuda" else {}  # same bits, no per-step casts
    cast.update(stack_projections(model))  # after the cast: the stacked copy in the served dtype
    graphed = {"decode_steps": args.decode_steps}
    tries = []  # (what, batcher class, its extra arguments, the counter its failure leaves)
    if cls is GraphedBatcher:
        if compile_on:
            tries.append(("compiled graphed", GraphedBatcher, graphed | {"compile": True}, "serve.compiled_start_failed"))
        if not compile_on or args.compile == "auto":
            tries.append(("graphed", GraphedBatcher, graphed, "serve.graphed_start_failed"))
        if args.decode == "auto":
            tries.append(("eager", Batcher, {}, None))
    else:
        tries.append(("eager", Batcher, {}, None))
    failed = Counter()
    for i, (what, kind, extra, counter) in enumerate(tries):
        batcher = kind(model, device, bf16, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                       prefill_ms=args.prefill_ms, **extra)
        batcher.counters.update(cast)
        try:
            batcher.start()
        except Exception as e:
            if i == len(tries) - 1:
                raise
            uncompile_regions(model)  # a failed compile must not stay bound under the next try
            failed[counter] += 1
            print(f"[serve] the {what} decode did not start ({type(e).__name__}: {e}); serving with the {tries[i + 1][0]} "
                  "decode (--decode and --compile choose explicitly)", flush=True)
            continue
        batcher.counters.update(failed)
        return batcher
    raise AssertionError("unreachable: the last try raises")


def served_names(args, artifact_name: str) -> list[str]:
    """What the model answers to: the --preset or --model it was started with (the name replies carry), its
    artifact's name, then --served-model-name's, each once."""
    return list(dict.fromkeys([args.preset or str(args.model), artifact_name, *args.served_model_name]))


def check_port_free(host: str, port: int) -> None:
    """Fails in one line before a minute of loading the model, not after it."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as e:
            raise SystemExit(f"dormouse serve: cannot listen on {host}:{port} ({e.strerror}); another server "
                             "there? (--port)") from None


def main(argv=None) -> int:
    ap = arg_parser()
    args = ap.parse_args(argv)
    if args.model and (args.set or args.corpus):
        ap.error("--set/--corpus choose which run of --preset to serve; --model names the artifact itself")
    if args.prefill_chunk < 0:
        ap.error(f"--prefill-chunk must be >= 0 (0: whole prompts), got {args.prefill_chunk}")
    if args.prefill_ms <= 0:
        ap.error(f"--prefill-ms must be > 0, got {args.prefill_ms}")
    if args.decode_steps < 1:
        ap.error(f"--decode-steps must be >= 1, got {args.decode_steps}")
    import uvicorn

    check_port_free(args.host, args.port)
    model, device, bf16, model_id, info = load(args)
    cls = batcher_class(args.decode, device)
    if args.compile == "cuda" and not (cls is GraphedBatcher and device.type == "cuda"):
        ap.error(f"--compile cuda compiles the graphed decode on CUDA; this server would run {cls.__name__} on "
                 f"{device} (--decode {args.decode})")
    batcher = start_batcher(cls, args, model, device, bf16)
    allowed = args.allowed_hosts.split(",") if args.allowed_hosts else default_allowed_hosts(args.host)
    max_connections = raise_file_limit(args.max_connections)
    if max_connections < args.max_connections:
        print(f"[serve] --max-connections {args.max_connections} lowered to {max_connections} (the open-file limit, "
              "ulimit -Hn)", flush=True)
    limits = Limits(max_prompt_bytes=args.max_prompt_bytes, max_body_bytes=args.max_body_bytes,
                    max_prompts=args.max_prompts, max_request_tokens=args.max_request_tokens,
                    read_timeout=args.read_timeout, max_connections=max_connections)
    names = served_names(args, model_id)
    app = create_app(batcher, names, limits, info,
                     api_key=args.api_key or None, allowed_hosts=[h.strip() for h in allowed if h.strip()])
    decode = "graphed" if isinstance(batcher, GraphedBatcher) else "eager"
    print(f"[serve] {' = '.join(names)} on {device}, {decode} decode: http://{args.host}:{args.port}/ (OpenAI API under /v1)",
          flush=True)
    try:
        uvicorn.Server(server_config(app, args.host, args.port, limits)).run()
    finally:
        batcher.stop()
    return 0
