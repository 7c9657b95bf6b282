"""benchmarks/serve_load.py: the timed load from a process of its own."""

import multiprocessing as mp
import socket
import threading
import time

import pytest

from benchmarks.serve_load import Deadline, load_elsewhere


def test_a_client_process_that_dies_is_an_error_not_a_hang():
    """A server that never answers keeps the client process waiting; killed, it must raise in the parent."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # connections queue, nothing ever answers
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    got = {}

    def run():
        try:
            load_elsewhere(url, 2, [b"a", b"b"], 4, Deadline(120), lambda: None)
        except RuntimeError as e:
            got["error"] = str(e)

    t = threading.Thread(target=run)
    t.start()
    for _ in range(600):  # the spawned child: up to a minute to start on a busy machine
        children = mp.active_children()
        if children:
            break
        time.sleep(0.1)
    else:
        pytest.fail("no client process started")
    time.sleep(1)
    children[0].kill()
    t.join(timeout=30)
    sock.close()
    assert not t.is_alive() and "the client process" in got.get("error", ""), got
