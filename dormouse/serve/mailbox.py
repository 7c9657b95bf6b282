"""What the decode thread hands the server's event loop: each stream's text and its end, in order.

A decode step gives a byte to every live stream. Handing each one over with its own `loop.call_soon_threadsafe`
writes the loop's self-pipe and wakes it once per byte per stream (on the CPU, measured: the decode thread spent as
long waking the loop as running the model). A mailbox per loop gathers the items; the decode thread puts a whole
step's inside `one_wake()`, and the loop is woken once for them, which puts them into the streams' queues in the
order they came. An item put outside `one_wake` wakes the loop at once (unless a wake-up is already pending).
Hand-written: asyncio's only cross-thread entry, call_soon_threadsafe, wakes the loop once per call.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from contextlib import contextmanager

_boxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> its Mailbox, gone with the loop
_boxes_lock = threading.Lock()
_deferred = threading.local()  # .boxes: the mailboxes this thread put into inside one_wake() (None outside)


class Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # not the loop itself: _boxes' key must be able to die
        self._items: list[tuple[asyncio.Queue, object]] = []
        self._lock = threading.Lock()
        self._wake_pending = False

    def put(self, q: asyncio.Queue, item) -> None:
        """From any thread: `item` into `q` on the loop, after everything put before it."""
        with self._lock:
            self._items.append((q, item))
        deferred = getattr(_deferred, "boxes", None)
        if deferred is None:
            self.wake()
        else:
            deferred.add(self)

    def wake(self) -> None:
        """Have the loop deliver what is here (one wake-up, none if one is pending or nothing waits). A closed or
        collected loop (the server shut down) drops it: no one waits on its queues."""
        with self._lock:
            if self._wake_pending or not self._items:
                return
            self._wake_pending = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._items.clear()
                self._wake_pending = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._wake_pending = self._items, [], False
        for q, item in items:
            q.put_nowait(item)


def mailbox_of(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one mailbox (made on first use, gone with the loop)."""
    with _boxes_lock:
        box = _boxes.get(loop)
        if box is None:
            box = _boxes[loop] = Mailbox(loop)
        return box


@contextmanager
def one_wake():
    """What this thread puts inside goes out at the end, one wake-up per mailbox it put into (a decode step's
    bytes). Not reentrant: the decode thread opens one around each step's delivery."""
    _deferred.boxes = boxes = set()
    try:
        yield
    finally:
        _deferred.boxes = None
        for box in boxes:
            box.wake()
