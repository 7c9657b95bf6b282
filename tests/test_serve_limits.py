"""dormouse serve against greedy, idle and hostile clients (issue #45): each a load test of the real uvicorn server
on a loopback port, each under 20 s on 2 cores."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from test_serve import Server, tiny_model


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
            r = httpx.post(s.url + "/v1/completions", content=body(), timeout=60)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and str(1 << 20) in r.json()["error"]["message"]
        assert rss.growth < 64, f"resident set grew {rss.growth:.0f} MiB while a 400 MiB body was refused"
        assert sent < 100, f"the client sent {sent} MiB before the server closed"
        sent = 0
        with PeakRss() as rss:  # a declared Content-Length over the cap: refused before a byte of the body is read
            r = httpx.post(s.url + "/v1/completions", content=body(), headers={"content-length": str(400 << 20)},
                           timeout=60)
        assert r.status_code == 413 and rss.growth < 64 and sent < 100, (r.text, rss.growth, sent)
        assert s.health()["status"] == "ok"
    finally:
        s.close()
