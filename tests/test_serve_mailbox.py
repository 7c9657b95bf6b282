"""The decode thread's hand-over to the server loop (dormouse/serve/mailbox.py) and the SSE events it feeds."""

import asyncio
import json
import threading

from dormouse.serve import app, mailbox


def test_a_step_worth_of_items_wakes_the_loop_once_and_keeps_their_order():
    async def run():
        loop = asyncio.get_running_loop()
        box = mailbox.mailbox_of(loop)
        assert mailbox.mailbox_of(loop) is box  # one per loop
        qs = [asyncio.Queue() for _ in range(8)]
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]

        def step(n):  # what a decode thread does: a byte to every stream, n steps
            for i in range(n):
                for j, q in enumerate(qs):
                    box.put(q, ("text", f"{j}:{i}"))
            for q in qs:
                box.put(q, ("done", "length", {}))

        t = threading.Thread(target=step, args=(50,))
        t.start()
        t.join()  # all 408 items put while the loop was busy here: one wake-up
        got = []
        for q in qs:
            items = [await q.get() for _ in range(51)]
            got.append(items)
        del loop.call_soon_threadsafe
        return wakes, got

    wakes, got = asyncio.run(run())
    assert len(wakes) == 1
    for j, items in enumerate(got):
        assert items == [("text", f"{j}:{i}") for i in range(50)] + [("done", "length", {})]


def test_items_put_inside_one_wake_go_out_at_its_end_and_others_at_once():
    async def run():
        loop = asyncio.get_running_loop()
        box, q = mailbox.mailbox_of(loop), asyncio.Queue()
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]
        seen_inside = []

        def step():
            with mailbox.one_wake():
                for i in range(64):
                    box.put(q, i)
                seen_inside.append(len(wakes))  # nothing woke the loop yet
            box.put(q, "after")  # outside one_wake: at once, but the step's wake-up is still pending

        t = threading.Thread(target=step)
        t.start()
        t.join()
        got = [await asyncio.wait_for(q.get(), 5) for _ in range(65)]
        del loop.call_soon_threadsafe
        return wakes, seen_inside, got

    wakes, seen_inside, got = asyncio.run(run())
    assert seen_inside == [0] and len(wakes) == 1  # the second put found the first wake-up still pending
    assert got == list(range(64)) + ["after"]


def test_items_put_after_a_delivery_wake_the_loop_again():
    async def run():
        loop = asyncio.get_running_loop()
        box, q = mailbox.mailbox_of(loop), asyncio.Queue()
        for i in range(3):
            threading.Thread(target=box.put, args=(q, i)).start()
            assert await asyncio.wait_for(q.get(), 5) == i  # each delivered, none left pending
    asyncio.run(run())


def test_a_closed_loop_drops_what_is_put():
    loop = asyncio.new_event_loop()
    box, q = mailbox.mailbox_of(loop), asyncio.Queue()
    loop.close()
    box.put(q, ("text", "x"))  # the server shut down: no error in the decode thread, nothing kept
    box.put(q, ("text", "y"))
    assert box._items == [] and q.empty()


class _Stream:
    cancelled = False

    def cancel(self):
        self.cancelled = True


def test_waiting_text_goes_out_in_one_event_and_the_end_after_it():
    def chunk(text, reason, first=False, usage_only=False):
        return None if first else {"text": text, "reason": reason}

    async def run():
        q = asyncio.Queue()
        for t in ("a", "b", "é"):
            q.put_nowait(("text", t))
        q.put_nowait(("done", "stop", {"completion_tokens": 4}))
        return [e async for e in app.sse_events(_Stream(), q, chunk, include_usage=False)]

    events = asyncio.run(run())
    assert events == [app.sse({"text": "abé", "reason": None}), app.sse({"text": None, "reason": "stop"}),
                      "data: [DONE]\n\n"]


def test_an_event_whose_text_holds_a_unicode_line_break_stays_one_line_for_a_splitlines_client():
    from httpx._decoders import LineDecoder  # what httpx's Response.iter_lines splits a stream with

    obj = {"choices": [{"text": "a\u2028b\x85c\u2029d\né\r"}]}
    lines = LineDecoder().decode(app.sse(obj))
    assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == obj
