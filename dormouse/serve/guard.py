"""What a request must pass before the API sees it: its Host, its Origin, the API key, its Content-Type; and
what a connection may hold: time to send its request, a place under the connection cap (h11_protocol).

A server on 127.0.0.1 is reachable from every web page its user opens: a page may post to it (a "simple"
cross-origin request, text/plain, is sent without asking), and a DNS-rebinding page reaches it under its own
name. So:

- Host must be one of `allowed_hosts` (localhost names and the bound host by default): a rebinding page's
  requests carry its own name.
- Origin, when a browser sends one, must be this server's own (the chat page at / is same-origin): a page
  elsewhere cannot drive it, whatever it sends.
- With an API key, every /v1 request needs `Authorization: Bearer <key>` (as vLLM and llama.cpp take it; / and
  /health stay open).
- A POST must say `Content-Type: application/json`: a cross-origin simple request cannot.

Written by hand as one ASGI middleware: Starlette's TrustedHostMiddleware answers plain text, not OpenAI's error
body, and neither Starlette nor uvicorn checks Origin, Bearer keys or a request's media type.
"""

from __future__ import annotations

import hmac
import json
from collections import Counter

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
OVER_LIMIT = "dormouse.over_connection_limit"  # scope["state"] key: this connection came over --max-connections
WILDCARD_BINDS = ("", "0.0.0.0", "::")


def error_body(message: str, param: str | None = None, code: str = "invalid_request_error") -> dict:
    """OpenAI's error body (its 401s too are type invalid_request_error, code invalid_api_key)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def host_name(host: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "localhost:8000" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def default_allowed_hosts(bind: str) -> list[str]:
    """The names a local client reaches `bind` by; a wildcard bind adds this machine's names (others: --allowed-hosts)."""
    import socket

    extra = [socket.gethostname(), socket.getfqdn()] if bind in WILDCARD_BINDS else [bind.strip("[]")]
    return sorted({n.lower() for n in (*LOCAL_HOSTS, *extra)})


class Guard:
    """ASGI middleware: refuses, with OpenAI's error body, what fails a check (counted `serve.rejected.<code>`)."""

    def __init__(self, app, counters: Counter, api_key: str | None = None, allowed_hosts: list[str] | None = None):
        self.app, self.counters = app, counters
        self.api_key = api_key.encode() if api_key else None
        self.allowed = None if allowed_hosts is None or "*" in allowed_hosts else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        over = scope.get("state", {}).get(OVER_LIMIT)
        refusal = (503, "too_many_connections", f"the server holds its limit of {over} connections, all busy; "
                   "retry shortly", [(b"connection", b"close")]) if over else self.check(scope)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, code, message, extra = refusal
        self.counters[f"serve.rejected.{code}"] += 1
        body = json.dumps(error_body(message, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *extra]})
        await send({"type": "http.response.body", "body": body})

    def check(self, scope) -> tuple[int, str, str, list] | None:
        headers = {}
        for k, v in scope["headers"]:
            headers.setdefault(k, v.decode("latin-1"))
        host = headers.get(b"host", "")
        if self.allowed is not None and host_name(host) not in self.allowed:
            return 400, "invalid_host", (f"Host {host!r} is not one this server answers to "
                                         f"({', '.join(sorted(self.allowed))}; dormouse serve --allowed-hosts)"), []
        origin = headers.get(b"origin")
        if origin is not None and origin.lower() != f"{scope.get('scheme', 'http')}://{host}".lower():
            return 403, "cross_origin", (f"a page at {origin} may not use this server (only its own pages, at "
                                         f"{scope.get('scheme', 'http')}://{host}/)"), []
        path = scope["path"]
        if self.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            auth = headers.get(b"authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key):
                why = "no API key given" if not auth else "the API key is not this server's"
                return 401, "invalid_api_key", (f"{why}: send the header 'Authorization: Bearer <key>' with the key "
                                                "dormouse serve was started with (--api-key)"), \
                    [(b"www-authenticate", b"Bearer")]
        if scope["method"] == "POST":
            media = headers.get(b"content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return 415, "unsupported_media_type", (f"Content-Type {media or 'none'!r}: the body must be JSON "
                                                       "sent as 'Content-Type: application/json'"), []
        return None


def h11_protocol(max_connections: int, read_timeout: float, counters: Counter):
    """uvicorn's h11 protocol with two things uvicorn lacks (its timeout_keep_alive starts only after a response,
    and any byte cancels it; its limit_concurrency counts idle sockets, so a client holding idle ones gets every
    new request a 503):

    - read_timeout: a connection gets this long, from its opening or the end of its last response, to send a whole
      request head; dribbling bytes does not extend it. Then it is closed.
    - max_connections: a connection over the cap closes the one idle longest (no request in progress: just opened,
      sending its head, or between requests), as nginx drains its reusable connections; when every one is busy,
      the newcomer's request gets a 503 (OpenAI's body, from Guard) and the connection is closed.

    One class per server: `idle` is that server's connections waiting for a request, oldest first. Counted:
    serve.connections_timed_out, serve.connections_evicted, serve.connections_over_limit."""
    import asyncio
    from collections import OrderedDict

    from uvicorn.protocols.http.h11_impl import H11Protocol

    idle: OrderedDict = OrderedDict()

    class GuardedH11(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            while len(self.connections) > max_connections and idle:
                idle.popitem(last=False)[0].close_idle("evicted")
            if len(self.connections) > max_connections:  # every other one is busy: Guard answers 503
                counters["serve.connections_over_limit"] += 1
                self.app_state = {**self.app_state, OVER_LIMIT: max_connections}
            self.await_request()

        def busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def await_request(self) -> None:
            idle[self] = None
            idle.move_to_end(self)
            self.stop_timer()
            self._timer = self.loop.call_later(read_timeout, self.close_idle, "timed_out")

        def stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def close_idle(self, why: str) -> None:
            idle.pop(self, None)
            self.stop_timer()
            if not self.busy() and not self.transport.is_closing():
                counters[f"serve.connections_{why}"] += 1
                self.connections.discard(self)  # counted out now: connection_lost comes a loop turn later
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.busy() and self in idle:  # a request's head arrived
                idle.pop(self)
                self.stop_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.busy() and not self.transport.is_closing():
                self.await_request()

        def connection_lost(self, exc) -> None:
            idle.pop(self, None)
            self.stop_timer()
            super().connection_lost(exc)

    return GuardedH11


def raise_file_limit(max_connections: int, spare: int = 256) -> int:
    """Raise this process's open-file soft limit to its hard limit (each connection is a file; running out once
    stopped /health answering) and return max_connections, lowered to fit under it with `spare` files left."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, max_connections + spare)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(1, min(max_connections, soft - spare))
