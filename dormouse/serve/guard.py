"""What a request must pass before the API sees it: its Host, its Origin, the API key, its Content-Type.

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
        refusal = self.check(scope)
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
