"""The decode scheduler: every live stream advances in one batched recurrent step; streams join and leave
between steps. Written by hand because no serving library batches a recurrent byte model's fixed-size states.

A stream's state (`LMState` rows: the KDA recurrent matrix and short-conv tails per block, Engram's last bytes) has
the same size whatever the conversation's length, so a step costs the same for a 10-byte and a 100 000-byte
conversation, and memory grows with the number of streams only (`state_bytes_per_stream`).

One thread owns the model. Each loop: admit waiting streams, prefill at most `prefill_chunk` bytes of their
prompts (below), put the streams whose prompts are now whole onto the running batch, sample one byte per row (rows
grouped by temperature and top-k, one uniform per row: a stream with a seed draws it from its own generator), hand
each byte to its stream, drop the rows that finished (stop byte, a stop sequence, max bytes, or a client that went
away), and step the rest. The text a stream sees is whole UTF-8 characters (an incremental decoder holds back a
partial one) and never part of a stop sequence. An error in a prefill fails the streams whose pieces it ran, one in
a step the batch's streams (finish reason "error", counted); the thread goes on.

Fair between requests: a stream belongs to a request (`group`: a completions request's prompts are one group), and
rows go round-robin over the requests waiting, not first come first served over rows. When the batch is full and a
waiting request holds fewer rows than its fair share (max_batch over the requests with work), the request holding
the most rows pauses one: its state row and logits wait beside it and rejoin later with no prefill, since the
state is a fixed size (counted serve.preempted). So a small request starts within a step or two even while one
request of 2 000 prompts fills the batch (it once waited for all 2 000).

Chunked prefill: an admitted prompt is prefilled in pieces of at most `prefill_chunk` bytes (the chunked KDA kernel,
each piece continuing the state the last one left: `ByteLM.prefill`), and a loop turn prefills the pieces that fit in
`prefill_ms` at the measured prefill rate before it steps the running rows (one piece's bytes until a rate is
measured; every prompt's next piece when no stream decodes), so an 8 KB prompt no longer stalls every stream for
its whole prefill, and many long prompts go in together rather than 2 048 bytes a turn in all. A stream joins the
batch when its prompt is whole. The pieces go round-robin over the requests prefilling (a request's own prompts
first come first served), each turn filled with the pieces that fit. A prompt is cut at multiples of `prefill_chunk`
whatever else is served, so its state does not depend on its company. A stream being prefilled holds a row (it
counts toward its request's share) and is the first to pause, its prefill so far kept. prefill_chunk 0: whole
prompts, all at admission (as before).
"""

from __future__ import annotations

import codecs
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import zip_longest

import torch

from dormouse.model.gpt import ByteLM, LMState, cat_states
from dormouse.model.regions import compile_regions
from dormouse.posttrain.decode import DecodeStep, prefill_prompts
from dormouse.posttrain.rowrng import GREEDY_BELOW
from dormouse.serve.mailbox import one_wake
from dormouse.train import compile_cache

DECODE_STEPS = 8  # graphed decode steps between two host reads under load (`dormouse serve --decode-steps`; vLLM's
# multi-step scheduling default): the host's cost, an event and an SSE write per stream, is paid once per 8 bytes
PREFILL_MS = 25  # while streams decode, a turn's prefill runs about this long (`--prefill-ms`): at the measured prefill
# rate, every prompt's next piece that fits, so 64 long prompts go in together instead of 2 048 bytes a turn in all
PREFILL_CHUNK = 2048  # bytes of prompt prefilled between two decode steps (`dormouse serve --prefill-chunk`): an 8 KB
# prompt goes in 4 pieces with a decode step of the running streams after each; ~20 chat prompts of 100 bytes share one


def sample_with_uniforms(logits: torch.Tensor, temperature: float, top_k: int | None, u: torch.Tensor) -> torch.Tensor:
    """logits [B, V], uniforms u [B] in [0, 1) -> one byte per row from softmax(logits / temperature) over the top_k
    largest logits: the first byte whose cumulative probability passes u."""
    z = logits.float() / temperature
    if top_k is not None:
        kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    cdf = z.softmax(-1).cumsum(-1)
    # right=True: a uniform of exactly 0 picks the first byte of non-zero probability, never a masked one before it
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp_max(z.shape[-1] - 1)


@dataclass
class Stream:
    """One request's generation. `emit(text)` and `finish(reason)` are called from the decode thread (the server
    passes thread-safe callbacks); `cancel()` may be called from anywhere."""

    prompt: bytes
    max_new_bytes: int
    emit: Callable[[str], None]
    finish: Callable[[str, dict], None]
    temperature: float = 1.0
    top_k: int | None = None
    stop_bytes: frozenset[int] = frozenset({0x03})  # a chat stream also stops on 0x01/0x02 (a turn it may not write)
    stops: tuple[str, ...] = ()
    seed: int | None = None
    new_bytes: int = 0
    done: bool = False  # finished (set by the decode thread)
    out: bytearray = field(default_factory=bytearray)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _held: str = ""  # decoded text not yet emitted: it may be the start of a stop sequence
    generator: torch.Generator | None = None
    group: object = None  # the request it belongs to (rows are shared between requests); its own when None
    paused: tuple | None = None  # (logits row, state row) of a stream paused to give its row to another request
    prefilled: int = 0  # prompt bytes prefilled so far (chunked prefill)
    prefill_state: LMState | None = None  # the state after prompt[:prefilled] while the prompt is not whole
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def take(self, byte: int) -> str | None:
        """Consume one generated byte; the finish reason when the stream is done, else None."""
        return self.take_many((byte,))

    def take_many(self, new) -> str | None:
        """Consume generated bytes in order, up to the first that finishes the stream (the rest are not its), and
        emit their text at once: one event for k decode steps. The finish reason, or None."""
        reason = None
        for byte in new:
            reason = self._consume(byte)
            if reason is not None:
                break
        self._flush(final=reason is not None)
        return reason

    def _consume(self, byte: int) -> str | None:
        self.new_bytes += 1
        if byte in self.stop_bytes:
            return "stop"
        self.out.append(byte)
        self._held += self._decoder.decode(bytes([byte]))
        for s in self.stops:
            at = self._held.find(s)
            if at >= 0:
                self._held = self._held[:at]
                return "stop"
        if self.new_bytes >= self.max_new_bytes:
            return "length"
        return None

    def _flush(self, final: bool) -> None:
        if final:
            self._held += self._decoder.decode(b"", final=True)
            keep = 0
        else:  # hold back the longest tail that could still grow into a stop sequence
            keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(self._held)), 0, -1)
                        if self._held.endswith(s[:k])), default=0)
        text = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        if text:
            if self.t_first is None:
                self.t_first = time.perf_counter()
            self.emit(text)


class Batcher:
    """The decode loop on its own thread (`start`/`stop`); `submit` from any thread."""

    def __init__(self, model: ByteLM, device: torch.device, bf16: bool, max_batch: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, prefill_ms: float | None = PREFILL_MS):
        assert not model.training
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: whole prompts), got {prefill_chunk}")
        if prefill_ms is not None and prefill_ms <= 0:
            raise ValueError(f"prefill_ms must be > 0 (None: prefill_chunk bytes a turn in all), got {prefill_ms}")
        self.model, self.device, self.max_batch, self.prefill_chunk = model, device, max_batch, prefill_chunk
        self.prefill_ms = prefill_ms
        self.prefill_rate: float | None = None  # prompt bytes a second prefill measured (a running mean)
        self.amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and bf16 else nullcontext()
        self.waiting: OrderedDict[object, deque[Stream]] = OrderedDict()  # per request, served round-robin
        # admitted streams whose prompts are not whole yet, per request, served round-robin (the decode thread's own)
        self.prefilling: OrderedDict[object, deque[Stream]] = OrderedDict()
        self.prefilling_now = 0  # len(_prefilling_streams()), for /health (another thread)
        self.cv = threading.Condition()
        self.counters: Counter = Counter()
        self.state_bytes_per_stream: int | None = None
        self.live = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.last_error: str | None = None
        self._shared_gen = torch.Generator().manual_seed(0)  # CPU: the same draws whatever the model's device

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dormouse-decode", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.cv:
            self._stopping = True
            self.cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, stream: Stream) -> None:
        if stream.seed is not None:
            stream.generator = torch.Generator().manual_seed(stream.seed)
        if stream.group is None:
            stream.group = object()
        with self.cv:
            self.waiting.setdefault(stream.group, deque()).append(stream)
            self.counters["serve.streams"] += 1
            self.cv.notify()

    def waiting_streams(self) -> int:
        with self.cv:
            return sum(len(q) for q in self.waiting.values())

    def _take(self, rows: list[Stream]) -> list[Stream]:
        """Waiting streams for the free rows: first to the requests under their fair share, up to it, then to any,
        one per request in turn (a request served goes to the back of the line). Under self.cv."""
        held = Counter(s.group for s in rows)
        fair = max(1, self.max_batch // max(1, len(set(held) | set(self.waiting))))
        new: list[Stream] = []
        for cap in (fair, self.max_batch):
            while self.waiting and len(rows) + len(new) < self.max_batch:
                group = next((g for g in self.waiting if held[g] < cap), None)
                if group is None:
                    break
                q = self.waiting[group]
                new.append(q.popleft())
                held[group] += 1
                if q:
                    self.waiting.move_to_end(group)
                else:
                    del self.waiting[group]
        return new

    def _to_pause(self, rows: list[Stream]) -> list[int]:
        """With the batch full, a row for each waiting request under its fair share, from the request holding the
        most rows over its own (its newest row: the least decoded): the rows to pause. Under self.cv."""
        if len(rows) < self.max_batch or not self.waiting:
            return []
        held = Counter(s.group for s in rows)
        fair = max(1, self.max_batch // len(set(held) | set(self.waiting)))
        wanted = sum(min(fair - held[g], len(q)) for g, q in self.waiting.items() if held[g] < fair)
        pause: list[int] = []
        for _ in range(wanted):
            donor, most = held.most_common(1)[0]
            if most <= fair:
                break
            pause.append(max(i for i, s in enumerate(rows) if s.group is donor and i not in pause))
            held[donor] -= 1
        return pause

    def _prefilling_streams(self) -> list[Stream]:
        return [s for q in self.prefilling.values() for s in q]

    def _unqueue_prefill(self, s: Stream) -> None:
        q = self.prefilling[s.group]
        del q[next(i for i, x in enumerate(q) if x is s)]  # by identity: a Stream's == compares its fields
        if not q:
            del self.prefilling[s.group]

    def _preempt(self, rows: list[Stream], logits, state):
        """The streams `_to_pause` picks, paused: back to the front of their requests' lines. A row takes its logits
        and state with it (`_pause_rows`); a stream being prefilled, what it has prefilled (it holds a row too, listed
        after the live ones, so a request's stream still prefilling pauses first). Under self.cv."""
        pre = self._prefilling_streams()
        pause = self._to_pause(rows + pre)
        if not pause:
            return rows, logits, state
        streams = [(rows + pre)[i] for i in sorted(pause, reverse=True)]
        for i in pause:
            if i >= len(rows):
                self._unqueue_prefill(pre[i - len(rows)])
        live = [i for i in pause if i < len(rows)]
        if live:
            rows, logits, state = self._pause_rows(rows, logits, state, live)
        for s in streams:  # in reverse: each request's line keeps their order at its front
            if not s.done:  # (a graphed row's unread bytes, delivered as it paused, may have finished it)
                self.waiting.setdefault(s.group, deque()).appendleft(s)
        self.counters["serve.preempted"] += len(pause)
        return rows, logits, state

    def _pause_rows(self, rows: list[Stream], logits, state, pause: list[int]):
        """Rows `pause` leave the batch, each stream's logits and state row kept beside it (its `paused`)."""
        for i in pause:
            rows[i].paused = (logits[i:i + 1].clone(), state.select([i]))  # not a view: the batch's logits go
        keep = [i for i in range(len(rows)) if i not in pause]
        sel = torch.tensor(keep)
        return [rows[i] for i in keep], logits[sel.to(logits.device)], state.select(sel)

    def _admit(self, rows: list[Stream], logits, state):
        """Waiting streams onto the free rows (a paused one straight back into the batch, the others to the prefill
        line), one turn of prefill, and the streams it made whole onto the batch: (rows, logits, state) after."""
        with self.cv:
            while not self.waiting and not rows and not self.prefilling and not self._stopping:
                self.cv.wait()
            rows, logits, state = self._preempt(rows, logits, state)
            new = self._take(rows + self._prefilling_streams())
        new = [s for s in new if not self._drop_cancelled(s)]
        resumed, fresh = [s for s in new if s.paused], [s for s in new if not s.paused]
        if resumed:  # no prefill: the state they paused with
            rows, logits, state = self._resume(rows, logits, state, resumed)
            for s in resumed:
                s.paused = None
        for s in fresh:  # a stream paused while prefilling goes on from where it was (s.prefilled)
            self.prefilling.setdefault(s.group, deque()).append(s)
        whole = self._prefill_turn(live=bool(rows))
        if whole is not None:
            rows, logits, state = self._join(rows, logits, state, *whole)
        self.prefilling_now = sum(len(q) for q in self.prefilling.values())
        return rows, logits, state

    def turn_budget(self, live: bool) -> int | None:
        """Prompt bytes one turn may prefill in all (None: no bound). While streams decode (`live`), what the measured
        rate prefills in prefill_ms, at least one piece; with none decoding nothing waits on the turn, so every
        prompt's next piece up to max_batch pieces (a memory bound); prefill_ms None: one piece's bytes in all."""
        if not self.prefill_chunk:
            return None
        if self.prefill_ms is None:
            return self.prefill_chunk
        most = self.prefill_chunk * self.max_batch
        if not live:
            return most
        if self.prefill_rate is None:
            return self.prefill_chunk
        return max(self.prefill_chunk, min(most, int(self.prefill_rate * self.prefill_ms / 1e3)))

    def _measured(self, n_bytes: int, seconds: float) -> None:
        rate = n_bytes / max(seconds, 1e-6)
        self.prefill_rate = rate if self.prefill_rate is None else 0.5 * (self.prefill_rate + rate)

    def _prefill_turn(self, live: bool = True) -> tuple[list[Stream], torch.Tensor, LMState] | None:
        """One loop turn's prefill: the next piece (at most prefill_chunk bytes, the rest of the prompt at 0) of the
        streams picked round-robin over the requests prefilling, every piece that fits in `turn_budget` bytes in all
        (all of them at 0), in one `prefill_prompts` call (equal lengths share a batch). Returns the streams whose
        prompts are now whole, with their next-byte logits and states, or None."""
        for s in [s for s in self._prefilling_streams() if s.cancelled]:
            self._unqueue_prefill(s)
            s.prefill_state = None
            self._drop_cancelled(s)
        budget = self.turn_budget(live)
        picked: list[tuple[Stream, int]] = []
        for tier in zip_longest(*self.prefilling.values()):  # each request's first stream, then each one's second, ...
            for s in tier:
                rest = len(s.prompt) - s.prefilled if s is not None else 0
                n = rest if budget is None else min(rest, self.prefill_chunk)  # cut at multiples of prefill_chunk
                if n == 0 or (budget is not None and n > budget):
                    continue
                picked.append((s, n))
                if budget is not None:
                    budget -= n
        if not picked:
            return None
        for group in dict.fromkeys(s.group for s, _ in picked):  # the requests served go to the back of the line
            self.prefilling.move_to_end(group)
        streams = [s for s, _ in picked]
        cuda = self.device.type == "cuda"
        if cuda:  # the decode steps queued before it are not the prefill's time
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            lg, st = prefill_prompts(self.model, [s.prompt[s.prefilled:s.prefilled + n] for s, n in picked],
                                     self.counters, [s.prefill_state for s in streams])
            if cuda:  # the rate is the device's, not the launches'
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - a failed prefill (out of memory on long prompts) fails those streams only
            for s in streams:
                self._unqueue_prefill(s)
                s.prefill_state = None
            self._fail(streams, e)
            return None
        n_bytes = sum(n for _, n in picked)
        if n_bytes >= self.prefill_chunk:  # a turn of a few short prompts is mostly fixed cost: its rate would
            self._measured(n_bytes, time.perf_counter() - t0)  # understate a long prompt's
        self.counters["serve.prefills"] += 1
        self.counters["serve.prefill_chunks"] += len(picked)
        self.counters["serve.prefill_bytes"] += n_bytes
        if self.state_bytes_per_stream is None:
            self.state_bytes_per_stream = st.row_bytes()
        whole = []
        for i, (s, n) in enumerate(picked):
            s.prefilled += n
            if s.prefilled < len(s.prompt):
                s.prefill_state = st.select([i])
            else:
                s.prefill_state = None
                self._unqueue_prefill(s)
                whole.append(i)
        if len(whole) == len(picked):
            return streams, lg, st
        if not whole:
            return None
        sel = torch.tensor(whole)
        return [streams[i] for i in whole], lg[sel.to(lg.device)], st.select(sel)

    def _join(self, rows: list[Stream], logits, state, new: list[Stream], lg: torch.Tensor, st: LMState):
        """Streams onto the batch after its rows, with their next-byte logits and states."""
        logits = lg if logits is None else torch.cat([logits, lg])
        state = st if state is None else cat_states([state, st])
        return rows + new, logits, state

    def _resume(self, rows: list[Stream], logits, state, resumed: list[Stream]):
        return self._join(rows, logits, state, resumed, torch.cat([s.paused[0] for s in resumed]),
                          cat_states([s.paused[1] for s in resumed]))

    def _drop_cancelled(self, s: Stream) -> bool:
        if s.cancelled:
            self.counters["serve.streams_cancelled"] += 1
            s.finish("cancelled", self._usage(s))
        return s.cancelled

    def _sample(self, rows: list[Stream], logits: torch.Tensor) -> torch.Tensor:
        """One byte per row. Each row's draw is inverse-CDF sampling of one uniform taken from its own generator (a
        stream with a seed) or the shared one, so rows of equal temperature and top-k sample in one batched op and
        a seeded stream's bytes do not depend on the streams beside it."""
        out = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(rows):
            groups.setdefault((s.temperature, s.top_k), []).append(i)
        for (temperature, top_k), idx in groups.items():
            sel = torch.tensor(idx, device=logits.device)
            if temperature < GREEDY_BELOW:  # logits / 1e-40 overflow to inf and the softmax to NaN
                out[sel] = logits[sel].argmax(-1)
                continue
            u = torch.stack([torch.rand((), generator=rows[i].generator or self._shared_gen) for i in idx])
            out[sel] = sample_with_uniforms(logits[sel], temperature, top_k, u.to(logits.device))
        return out

    @staticmethod
    def _usage(s: Stream) -> dict:
        return {"prompt_tokens": len(s.prompt), "completion_tokens": s.new_bytes,
                "total_tokens": len(s.prompt) + s.new_bytes}

    def _fail(self, streams: list[Stream], e: BaseException) -> None:
        """Streams a decode error took down: each finishes with "error" (the server answers 500 or an SSE error
        event), counted; the loop goes on with the others."""
        self.counters["serve.errors"] += 1
        self.counters[f"serve.errors.{type(e).__name__}"] += 1
        self.last_error = f"{type(e).__name__}: {e}"
        for s in streams:
            self.counters["serve.finished.error"] += 1
            s.done = True
            s.finish("error", {**self._usage(s), "error": self.last_error})

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        rows: list[Stream] = []
        logits = state = None
        with torch.inference_mode(), self.amp:
            while True:
                rows, logits, state = self._admit(rows, logits, state)
                if self._stopping:
                    for s in rows + self._prefilling_streams() + [s for q in self.waiting.values() for s in q]:
                        s.finish("cancelled", self._usage(s))
                    return
                if not rows:
                    continue
                self.live = len(rows)
                self.counters["serve.max_batch_seen"] = max(self.counters["serve.max_batch_seen"], len(rows))
                if self.prefilling:  # a step the prompts being prefilled did not hold up (whole, they would have)
                    self.counters["serve.steps_during_prefill"] += 1
                try:
                    rows, logits, state = self._advance(rows, logits, state)
                except Exception as e:  # noqa: BLE001 - the batch's streams get the error; the server goes on
                    self._fail([s for s in rows if not s.done], e)
                    rows, logits, state = [], None, None
                    self.live = 0

    def _advance(self, rows: list[Stream], logits, state):
        """One byte for every row, then the step of the rows that go on: (rows, logits, state) after it."""
        nxt = self._sample(rows, logits)
        keep = self._deliver(rows, [(b,) for b in nxt.cpu().tolist()])
        self.counters["serve.steps"] += 1
        if not keep:
            self.live = 0
            return [], None, None
        if len(keep) < len(rows):
            sel = torch.tensor(keep)
            rows = [rows[i] for i in keep]
            nxt, state = nxt[sel.to(nxt.device)], state.select(sel)
        logits, state = self.model.step(nxt, state, self.counters)
        return rows, logits, state

    def _deliver(self, rows: list[Stream], new: list) -> list[int]:
        """Each row's new bytes (a sequence a row: one a step, or the steps since the last host read) to its stream,
        as one event; the streams that finished are finished (counted). Returns the rows that go on."""
        keep = []
        with one_wake():  # the step's bytes reach the server's loop in one wake-up, before the next step runs
            for i, (s, bs) in enumerate(zip(rows, new)):
                reason = "cancelled" if s.cancelled else s.take_many(bs)
                if reason is None:
                    keep.append(i)
                    continue
                if reason == "cancelled":
                    self.counters["serve.streams_cancelled"] += 1
                self.counters[f"serve.finished.{reason}"] += 1
                self.counters["serve.bytes_out"] += s.new_bytes
                s.done = True
                s.finish(reason, self._usage(s))
        return keep


class GraphedBatcher(Batcher):
    """`dormouse serve --decode graphed`: the same scheduler (fair shares, pausing, stops, cancels, errors) over a
    `DecodeStep`. The live rows sit in the step's slots [0, n) in the order of `rows`; a loop turn is one host read
    of the bytes the last step drew, their delivery, and one step (a CUDA graph replay of the smallest bucket that
    holds the rows; eager on CPU). Each row samples on the device from its stream's seed (`rowrng`; a stream with
    none gets one from the shared generator when it is admitted), so a seeded stream's bytes do not depend on the
    streams beside it; they are not the eager Batcher's bytes for that seed (another generator). In the loop's
    (rows, logits, state) logits and state are None: the rows' bytes and states live in the step. A paused stream
    keeps its `Rows` (state, pending byte, counter, seed, ...) and is put back into a free slot, no prefill."""

    def __init__(self, model: ByteLM, device: torch.device, bf16: bool, max_batch: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, buckets: list[int] | None = None, compile: bool = False,
                 compile_backend: str = "inductor", decode_steps: int = DECODE_STEPS,
                 prefill_ms: float | None = PREFILL_MS):
        super().__init__(model, device, bf16, max_batch, prefill_chunk, prefill_ms)
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        self.bf16, self.buckets, self.compile, self.compile_backend = bf16, buckets, compile, compile_backend
        self.decode_steps = decode_steps
        self.step: DecodeStep | None = None

    def start(self) -> None:
        if self.compile:  # before the step's warm-up calls: they compile, its capture records the fused kernels
            compile_cache.load(self.device, self.counters)
            # a region's graphs: batch and length each 1 or more, from the start or continuing a state (Engram's
            # region branches on it), sliced step buffers: over dynamo's default 8 per function, all made at start
            import torch._dynamo

            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.counters["serve.compiled_regions"] = len(compile_regions(self.model, backend=self.compile_backend))
            self._warm_prefill_shapes()
        # built (graphs captured) here, on the caller's thread: a capture that fails stops `dormouse serve` at start
        self.step = DecodeStep(self.model, self.max_batch, buckets=self.buckets, bf16=self.bf16,
                               max_steps=self.decode_steps)
        if self.compile:
            if not self.step.graphed:
                self.step.warm()
            compile_cache.save(self.device, self.counters)
            from torch._dynamo.utils import counters as dynamo_counters

            self.counters["serve.compiled_graphs_at_start"] = dynamo_counters["stats"]["unique_graphs"]
        super().start()

    def _seed(self, s: Stream) -> int:
        return s.seed if s.seed is not None else int(torch.randint(0, 2**62, (), generator=self._shared_gen))

    def _warm_prefill_shapes(self) -> None:
        """Prefill every class of shape serving makes, under serving's autocast: batch and length each 1 (dynamo
        specializes 1) or over 1 (seen twice, so dynamo makes the size dynamic), from the sequence start and
        continuing a state. Every compiled region then has the graphs any prompt needs, and no request waits on a
        compile (tests/test_serve.py holds this with torch's fail_on_recompile stance)."""
        with torch.inference_mode(), self.amp:
            for b in (1, 2, 3):
                for t in (1, 2, 3):  # as _prefill_turn calls it: a continued piece's state is rows selected, packed
                    pieces = [bytes(t)] * b
                    _, state = prefill_prompts(self.model, pieces, self.counters)
                    prefill_prompts(self.model, pieces, self.counters, [state.select([i]) for i in range(b)])

    def _pause_rows(self, rows: list[Stream], logits, state, pause: list[int]):
        """`Batcher._pause_rows` for rows that live in the step: a paused stream takes its row with it. Every row's
        unread bytes (up to k steps' worth) are delivered first, so a paused stream waits in line with none held back;
        a row they finish is finished, not paused."""
        keep = set(self._deliver(rows, [[b for b, _ in r] for r in self.step.read_drawn(len(rows))]))
        for i in pause:
            if i in keep:
                rows[i].paused = self.step.take([i])
        stay = [i for i in range(len(rows)) if i in keep and i not in pause]
        self.step.compact(stay)
        return [rows[i] for i in stay], None, None

    def _resume(self, rows: list[Stream], logits, state, resumed: list[Stream]):
        for s in resumed:  # no prefill: the row it paused with, into the next free slot
            self.step.put([len(rows)], s.paused)
            rows = rows + [s]
        return rows, None, None

    def _join(self, rows: list[Stream], logits, state, new: list[Stream], lg: torch.Tensor, st: LMState):
        """Streams whose prompts are whole into the step's next free slots, their first bytes drawn."""
        try:
            first = self.step.begin(lg, st, [self._seed(s) for s in new], [s.temperature for s in new],
                                    [s.top_k for s in new], [s.stop_bytes for s in new])
        except Exception as e:  # noqa: BLE001 - as a failed prefill: those streams fail, the others go on
            self._fail(new, e)
            return rows, None, None
        self.step.put(range(len(rows), len(rows) + len(new)), first)
        return rows + new, None, None

    def _advance(self, rows: list[Stream], logits, state):
        """The bytes the last steps (or the admission) drew, delivered; the rows that go on compacted and stepped
        k times before the next host read (`_steps_this_turn`)."""
        drawn = self.step.read_drawn(len(rows))  # the turn's one host read
        keep = self._deliver(rows, [[b for b, _ in r] for r in drawn])
        self.counters["serve.host_reads"] += 1
        if not keep:
            self.live = 0
            return [], None, None
        if len(keep) < len(rows):
            self.step.compact(keep)
            rows = [rows[i] for i in keep]
        k = self._steps_this_turn(rows)
        self.step.steps(len(rows), k, self.counters)
        self.counters["serve.steps"] += k
        self.counters[f"serve.decode_k.{k}"] += 1
        return rows, None, None

    def _steps_this_turn(self, rows: list[Stream]) -> int:
        """Decode steps before the next host read: 1 for a lone stream (its bytes as they come), while a stream is
        prefilled, or while a waiting stream could have a row at the next turn (a free one, or one paused for it);
        else `decode_steps` (a waiting line that gets no row, as under overload, does not hold it back), no more than
        the rows may still take (the steps past a row's stop byte or stop string are drawn and dropped)."""
        if self.decode_steps == 1 or len(rows) == 1 or self.prefilling:
            return 1
        with self.cv:
            if self.waiting and (len(rows) < self.max_batch or self._to_pause(rows)):
                return 1
        return max(1, min(self.decode_steps, max(s.max_new_bytes - s.new_bytes for s in rows)))
