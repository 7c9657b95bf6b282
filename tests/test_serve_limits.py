"""dormouse serve against greedy, idle and hostile clients (issue #45): each a load test of the real uvicorn server
on a loopback port, each under 20 s on 2 cores."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from test_serve import JSON, Server, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRss:
    """The process's largest resident set while the block runs, sampled every 2 ms (the server runs in this process)."""

    def __enter__(self):
        self.base = self.peak = rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_mib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> float:
        return self.peak - self.base


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc (Linux)")
def test_a_400_mb_chunked_body_gets_its_413_while_the_server_reads_little_of_it(model):
    """A chunked body has no Content-Length to refuse up front: the server counts while it reads and answers 413 at
    the first chunk past the cap, closing the connection, so neither its memory nor its reading follow the body (it
    once read all 400 MB, 1.1 GB resident, before the check)."""
    s = Server(model)
    sent = 0

    def body():  # 400 chunks of 1 MiB, the same object each time: the client holds 1 MiB
        nonlocal sent
        chunk = b" " * (1 << 20)
        for _ in range(400):
            sent += 1
            yield chunk

    try:
        with PeakRss() as rss:
            r = httpx.post(s.url + "/v1/completions", content=body(), headers=JSON, timeout=60)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and str(1 << 20) in r.json()["error"]["message"]
        assert rss.growth < 64, f"resident set grew {rss.growth:.0f} MiB while a 400 MiB body was refused"
        assert sent < 100, f"the client sent {sent} MiB before the server closed"
        sent = 0
        with PeakRss() as rss:  # a declared Content-Length over the cap: refused before a byte of the body is read
            r = httpx.post(s.url + "/v1/completions", content=body(), headers={**JSON, "content-length": str(400 << 20)},
                           timeout=60)
        assert r.status_code == 413 and rss.growth < 64 and sent < 100, (r.text, rss.growth, sent)
        assert s.health()["status"] == "ok"
    finally:
        s.close()


def test_posts_are_json_from_this_origin_to_this_host_with_the_key(model):
    """A web page the user visits can post to a server on 127.0.0.1 (a "simple" text/plain request needs no
    preflight) or reach it by DNS rebinding under its own name: POSTs must be application/json, a browser's Origin
    must be the server's own, Host one it answers to, and with --api-key every /v1 call needs the Bearer key (all
    were served, keyless, before). Each refusal is OpenAI's error body, counted."""
    s = Server(model, api_key="sekret", allowed_hosts=["localhost", "127.0.0.1", "::1"])
    try:
        key = {"authorization": "Bearer sekret"}
        body = b'{"prompt": "hi", "max_tokens": 2}'
        own = s.url  # http://127.0.0.1:<port>, what the chat page's fetch sends as its Origin

        def post(headers):
            return httpx.post(s.url + "/v1/completions", content=body, headers=headers)

        cases = [  # (headers, status, code)
            ({"origin": "http://evil.example", "content-type": "text/plain"}, 403, "cross_origin"),  # the simple POST
            ({**key, **JSON, "origin": "http://evil.example"}, 403, "cross_origin"),
            ({**key, **JSON, "origin": "null"}, 403, "cross_origin"),  # a sandboxed frame or a file:// page
            ({**key, **JSON, "host": "evil.example:8000"}, 400, "invalid_host"),  # DNS rebinding
            ({**key, **JSON, "host": "evil.example:8000", "origin": "http://evil.example:8000"}, 400, "invalid_host"),
            ({**JSON}, 401, "invalid_api_key"),
            ({**JSON, "authorization": "Bearer wrong"}, 401, "invalid_api_key"),
            ({**JSON, "authorization": "sekret"}, 401, "invalid_api_key"),  # not a Bearer token
            ({**key, "content-type": "text/plain"}, 415, "unsupported_media_type"),
            ({**key, "content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),  # curl -d
            ({**key}, 415, "unsupported_media_type"),
        ]
        for headers, status, code in cases:
            r = post(headers)
            assert r.status_code == status and r.json()["error"]["code"] == code, (headers, r.status_code, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
        assert s.batcher.counters["serve.streams"] == 0  # none of them reached the model
        assert post({**key, **JSON}).status_code == 200
        assert post({**key, "content-type": "Application/JSON; charset=utf-8", "origin": own}).status_code == 200
        r = httpx.get(s.url + "/v1/models", headers={"origin": own})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(s.url + "/v1/models", headers=key).json()["data"][0]["id"] == "dormouse-test"
        page = httpx.get(s.url + "/")  # the page and the health check stay open; the page knows to ask for the key
        assert page.status_code == 200 and "const KEY_REQUIRED = true;" in page.text
        assert httpx.get(s.url + "/health").json()["counters"]["serve.rejected.invalid_api_key"] == 4
        openai = pytest.importorskip("openai")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong").models.list()
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret")
        assert client.completions.create(model="dormouse-test", prompt="hi", max_tokens=2).choices[0].finish_reason
    finally:
        s.close()
