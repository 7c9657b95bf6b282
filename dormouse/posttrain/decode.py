"""Byte-by-byte generation from a `ByteLM`: prefill the prompts, then step the batch in lockstep.

    outs = generate(model.eval(), [b"2+2=", b"hello"], 64, temperature=0.8, top_k=50,
                    generator=torch.Generator().manual_seed(0), return_logprobs=True)
    # -> [(b"4\\x03", tensor([-0.1, -0.3])), (b" world ...", tensor([...]))]

- Prompts are prefilled in groups of equal length (the chunked KDA path, one call per distinct length), the
  groups' states concatenated and put back in prompt order; every later step is one `model.step` on the rows
  still running (a row that stopped leaves the batch: `LMState.select`), at a cost independent of how many
  bytes came before.
- `samples_per_prompt=G` prefills each prompt once and decodes G rows from it (`LMState.repeat_interleave`);
  outputs come grouped [p0 x G, p1 x G, ...].
- A row stops after emitting `stop_byte` (kept in its output; None = never) or after `max_new_bytes` bytes.
- temperature == 0: greedy (argmax). Otherwise softmax(logits / temperature), restricted to the top_k bytes
  when top_k is set, sampled with `generator` (sampling happens on the generator's device, so a CPU
  generator gives the same draws whatever device the model runs on).
- Log-probs (`return_logprobs=True`): log_softmax of the RAW logits (no temperature, no top-k) at each
  sampled byte, fp32 on the CPU. Not the sampling policy's at T != 1: rl scores its replies with
  `reply_logprobs` at the sampling temperature, for the old and the new policy alike.
- Runs under `torch.inference_mode()` (states and log-probs carry no autograd) and, on CUDA, bf16 autocast
  as training does (`bf16=False` for fp32). The model must be in eval mode (asserted): the caller's job.
Counters: `decode.prompt_bytes`, `decode.new_bytes`, `decode.rows_stopped.stop_byte`,
`decode.rows_stopped.max_new_bytes`, and the model's own (`kda_path.*` per mixer call, `conv_path.*`, ...).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from typing import NamedTuple

import torch

from dormouse.model.gpt import ByteLM, LMState, cat_states
from dormouse.posttrain.rowrng import sample_rows
from dormouse.train.cuda_graphs import WARMUP_CALLS, per_call
from dormouse.train.runtime import autocast


def prefill_prompts(model: ByteLM, prompts: list[bytes], counters: Counter | None = None,
                    states: Sequence[LMState | None] | None = None) -> tuple[torch.Tensor, LMState]:
    """Each prompt's next-byte logits [N, vocab] and the batch state after it (row i = prompts[i]).
    One prefill per distinct prompt length (rows of equal length share a call); prompts must be non-empty.
    states[i] (a one-row state, or None for the sequence start) is what prompts[i] continues: the serve batcher
    prefills a long prompt in pieces, each piece continuing the state the last one left."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: there is no context to predict the first byte from")
    states = [None] * len(prompts) if states is None else list(states)
    if len(states) != len(prompts):
        raise ValueError(f"prefill_prompts: {len(states)} states for {len(prompts)} prompts")
    device = next(model.parameters()).device
    by_len: dict[tuple[int, bool], list[int]] = {}  # a batch starts either all from None or all from states
    for i, p in enumerate(prompts):
        by_len.setdefault((len(p), states[i] is None), []).append(i)
    logits, out, order = [], [], []
    for (_, fresh), rows in by_len.items():
        idx = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device)  # [n, L]
        lg, st = model.prefill(idx, None if fresh else cat_states([states[i] for i in rows]), counters)
        logits.append(lg[:, -1])
        out.append(st)
        order += rows
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))  # position of prompt i in the grouped batch
    if counters is not None:
        counters["decode.prompt_bytes"] += sum(len(p) for p in prompts)
    return torch.cat(logits)[inverse.to(device)], cat_states(out).select(inverse)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, vocab] -> bytes [B] (long, on logits' device): argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the top_k largest logits (all when None)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    z = logits.float() / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(-1)
    if generator is not None:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)


def generate(
    model: ByteLM,
    prompts: list[bytes],
    max_new_bytes: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_byte: int | None = 0x03,
    generator: torch.Generator | None = None,
    counters: Counter | None = None,
    return_logprobs: bool = False,
    samples_per_prompt: int = 1,
    bf16: bool = True,
) -> list[bytes] | list[tuple[bytes, torch.Tensor]]:
    """The continuation of every prompt (see the module docstring); with return_logprobs, (bytes, log-probs
    fp32 [len(bytes)]) per prompt. samples_per_prompt = G > 1 prefills each prompt once and decodes G rows
    from it: outputs [p0 x G, p1 x G, ...] (GRPO's groups). Rows are independent: the batch changes only the
    order of the random draws."""
    assert not model.training, "generate: put the model in eval mode first (model.eval())"
    if max_new_bytes < 0 or samples_per_prompt < 1:
        raise ValueError(f"need max_new_bytes >= 0 and samples_per_prompt >= 1, got {max_new_bytes}, "
                         f"{samples_per_prompt}")
    n_rows = len(prompts) * samples_per_prompt
    outs: list[list[int]] = [[] for _ in range(n_rows)]
    lps: list[list[torch.Tensor]] = [[] for _ in range(n_rows)]
    if not prompts or max_new_bytes == 0:
        return [(bytes(o), torch.zeros(0)) for o in outs] if return_logprobs else [bytes(o) for o in outs]
    device = next(model.parameters()).device
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and bf16 else nullcontext()
    with torch.inference_mode(), amp:
        logits, state = prefill_prompts(model, prompts, counters)
        if samples_per_prompt > 1:
            logits, state = logits.repeat_interleave(samples_per_prompt, 0), state.repeat_interleave(samples_per_prompt)
        live = torch.arange(n_rows)  # output row of each batch row
        for n in range(max_new_bytes):
            nxt = sample_next(logits, temperature, top_k, generator)  # [b]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, nxt[:, None])[:, 0]  # raw-logit log-probs
            nxt_cpu, lp_cpu = nxt.cpu(), lp.float().cpu()
            for r, i in enumerate(live.tolist()):
                outs[i].append(int(nxt_cpu[r]))
                lps[i].append(lp_cpu[r])
            if counters is not None:
                counters["decode.new_bytes"] += len(live)
            stopped = (nxt_cpu == stop_byte) if stop_byte is not None else torch.zeros(len(live), dtype=torch.bool)
            if n == max_new_bytes - 1:
                if counters is not None:
                    counters["decode.rows_stopped.stop_byte"] += int(stopped.sum())
                    counters["decode.rows_stopped.max_new_bytes"] += int((~stopped).sum())
                break
            if stopped.any():
                if counters is not None:
                    counters["decode.rows_stopped.stop_byte"] += int(stopped.sum())
                keep = (~stopped).nonzero()[:, 0]
                if len(keep) == 0:
                    break
                live, nxt, state = live[keep], nxt[keep.to(nxt.device)], state.select(keep)
            logits, state = model.step(nxt, state, counters)
    if return_logprobs:
        return [(bytes(o), torch.stack(lp) if lp else torch.zeros(0)) for o, lp in zip(outs, lps)]
    return [bytes(o) for o in outs]


# --------------------------------------------------------------------------------------------------
# The static-shape step: what `dormouse serve --decode graphed` runs, one CUDA graph replay per byte
# --------------------------------------------------------------------------------------------------
class Rows(NamedTuple):
    """What a `DecodeStep` holds for each row (batch-first, on the model's device)."""

    state: LMState
    byte: torch.Tensor  # long [n]: drawn, not yet fed to the model (the next step feeds it)
    counter: torch.Tensor  # long [n]: bytes drawn so far, the row's RNG counter
    seed: torch.Tensor  # long [n]
    temperature: torch.Tensor  # fp32 [n]
    top_k: torch.Tensor  # long [n]; vocab_size = no cut
    stop: torch.Tensor  # bool [n, vocab]: the bytes that stop the row
    drawn: torch.Tensor  # long [n, max_steps, 2]: (byte, stopped) drawn since the host last read them (max_steps > 1)
    n_drawn: torch.Tensor  # long [n]: how many of `drawn` are unread


def int64_seed(seed: int) -> int:
    """A seed of [-2**63, 2**64) (what the server accepts) as the int64 with the same 64 bits."""
    return seed - 2**64 if seed >= 2**63 else seed


def copy_state(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """dst.copy_(src) for each pair, the dense pairs of one dtype and layout as one `torch._foreach_copy_` per dtype
    (one multi-tensor kernel on CUDA where a copy each was ~40 launches of a small graphed step); the rest one by
    one (a strided source: torch's foreach takes its slow path, a copy each, anyway)."""
    groups: dict[torch.dtype, tuple[list, list]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        if dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride():
            continue  # updated in place
        if dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape:
            d, s = groups.setdefault(dst.dtype, ([], []))
            d.append(dst)
            s.append(src)
        else:
            dst.copy_(src)
    for d, s in groups.values():
        torch._foreach_copy_(d, s)


def default_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch: n live rows run the smallest bucket >= n, so at most half of
    a bucket's rows are padding, and a few graphs cover every batch size."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeStep:
    """One decode step of up to `max_batch` rows with fixed shapes and every buffer preallocated, so that on CUDA
    it is one CUDA graph replay per bucket size (graphed, the default there) and on CPU the same function eagerly.

        step = DecodeStep(model, 64)
        step.put(slots, step.begin(logits, state, seeds, temperatures, top_ks, stop_sets))  # rows from a prefill
        step(n)            # rows [0, n): feed each row's byte, update its state in place, draw the next byte
        step.read(n)       # [(byte, stopped)] * n: the one host read of a step
        step.steps(n, k); step.read_drawn(n)  # max_steps > 1: k steps, then each row's k bytes in one host read

    A step feeds rows [0, b) for the smallest bucket b >= n (rows n..b-1 are padding: computed, never read), then
    draws each row's next byte on the device with `rowrng.sample_rows` from (its seed, its counter, its logits), so
    a row's bytes do not depend on the rows beside it, and tests it against the row's stop bytes. The caller keeps
    its live rows in slots [0, n): `take` / `put` / `compact` move rows (a stream leaving, pausing, resuming).
    With max_steps > 1 every step also writes its (byte, stopped) into the row's `drawn` history (inside the graph),
    so the host reads once per up to max_steps steps (vLLM's multi-step scheduling); a row moved or paused takes its
    unread bytes with it.
    Counters: eager, the model's own per call; graphed, the warm-up's per-call counts (per bucket) added on every
    replay, MoE routing excepted (it differs step to step and a replay cannot read it on the host)."""

    def __init__(self, model: ByteLM, max_batch: int, *, buckets: Sequence[int] | None = None,
                 graphed: bool | None = None, bf16: bool = True, max_steps: int = 1):
        assert not model.training, "DecodeStep: put the model in eval mode first (model.eval())"
        if max_steps < 1:
            raise ValueError(f"DecodeStep: max_steps must be >= 1, got {max_steps}")
        self.model, self.max_batch, self.max_steps = model, max_batch, max_steps
        self.device = next(model.parameters()).device
        self.graphed = self.device.type == "cuda" if graphed is None else graphed
        if self.graphed and self.device.type != "cuda":
            raise ValueError(f"DecodeStep: CUDA graphs need a CUDA model, this one is on {self.device}")
        self.buckets = sorted(set(buckets or default_buckets(max_batch)))
        if self.buckets[0] < 1 or self.buckets[-1] != max_batch:
            raise ValueError(f"DecodeStep: buckets {self.buckets} must be >= 1 and end at max_batch={max_batch}")
        self.dtype = "bfloat16" if bf16 else "float32"  # train.dtype's names, for runtime.autocast
        self.vocab = model.cfg.vocab_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.per_call: dict[int, Counter] = {}
        with torch.inference_mode():
            with autocast(self.device, self.dtype):  # one row's state as decoding leaves it: shapes and dtypes
                _, one = model.step(torch.zeros(1, dtype=torch.long, device=self.device), None)

            def zeros(*shape, dtype):
                return torch.zeros(*shape, dtype=dtype, device=self.device)

            self.out = zeros(max_batch, 2, dtype=torch.long)  # (byte, stopped) per row: what the host reads
            B, V = max_batch, self.vocab
            self.buf = Rows(one.map(lambda t: t.new_zeros((B, *t.shape[1:]))), self.out[:, 0], zeros(B, dtype=torch.long),
                            zeros(B, dtype=torch.long), zeros(B, dtype=torch.float32), zeros(B, dtype=torch.long),
                            zeros(B, V, dtype=torch.bool), zeros(B, max_steps, 2, dtype=torch.long),
                            zeros(B, dtype=torch.long))
            if self.graphed:
                self._capture()

    def bucket(self, n: int) -> int:
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"DecodeStep: {n} rows, the step holds 1 to {self.max_batch}")
        return next(b for b in self.buckets if b >= n)

    def _compute(self, b: int, counters: Counter | None) -> None:
        """The step of rows [0, b), every result written into the buffers (the region a CUDA graph captures)."""
        state = self.buf.state.map(lambda t: t[:b])
        with autocast(self.device, self.dtype, cache=False):  # a graph must not keep autocast's cached weight casts
            logits, new = self.model.step(self.buf.byte[:b], state, counters)
        nxt = sample_rows(logits, self.buf.seed[:b], self.buf.counter[:b], self.buf.temperature[:b], self.buf.top_k[:b],
                          counters)
        copy_state(state.tensors(), new.tensors())  # after the step: it read the old state and bytes
        self.buf.counter[:b].add_(1)
        self.out[:b, 0].copy_(nxt)
        self.out[:b, 1].copy_(self.buf.stop[:b].gather(1, nxt[:, None])[:, 0])
        if self.max_steps > 1:  # the byte into each row's history at its unread count (fixed addresses: graphed too)
            at = self.buf.n_drawn[:b].clamp(max=self.max_steps - 1)
            self.buf.drawn[:b].scatter_(1, at[:, None, None].expand(b, 1, 2), self.out[:b, None, :])
            self.buf.n_drawn[:b].add_(1)

    def _capture(self) -> None:
        """Each bucket's step as a CUDA graph, torch's documented way: warm-up calls on a side stream (lazy
        initialisation and Triton's autotuning must not happen inside a capture), then one capture per bucket into
        one shared memory pool (the graphs never replay at the same time). The buffers are zeroed after."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        counts = {b: Counter() for b in self.buckets}
        with torch.cuda.stream(side):
            for b in self.buckets:
                for _ in range(WARMUP_CALLS):
                    self._compute(b, counts[b])
        torch.cuda.current_stream().wait_stream(side)
        for b, c in counts.items():
            self.per_call[b] = per_call(Counter({k: v for k, v in c.items() if not k.startswith("moe.tokens.")}),
                                        WARMUP_CALLS)
        self.model.take_routing(None)  # the warm-up's routing tally is no decode
        pool = torch.cuda.graph_pool_handle()
        for b in self.buckets:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._compute(b, None)
            self.graphs[b] = graph
        self.clear()

    def warm(self) -> None:
        """An eager step's compiled regions (dormouse.model.regions) compiled now for every bucket, not on a live
        step (a graphed step's capture warms them itself); the buffers are zeroed after."""
        with torch.inference_mode():
            for b in self.buckets:
                for _ in range(WARMUP_CALLS):
                    self._compute(b, None)
        self.clear()

    def clear(self) -> None:
        with torch.inference_mode():
            for t in (*self.buf.state.tensors(), self.out, *self.buf[2:]):
                t.zero_()

    def __call__(self, n: int, counters: Counter | None = None) -> torch.Tensor:
        """One step of rows [0, n): (byte, stopped) long [n, 2] on the device (a view of the output buffer)."""
        b = self.bucket(n)
        if self.graphed:
            self.graphs[b].replay()
            if counters is not None:
                counters.update(self.per_call[b])
        else:
            with torch.inference_mode():
                self._compute(b, counters)
        return self.out[:n]

    def read(self, n: int) -> list[tuple[int, int]]:
        """The (byte, stopped) of rows [0, n) on the host: one small device-to-host copy."""
        return [tuple(r) for r in self.out[:n].tolist()]

    def steps(self, n: int, k: int, counters: Counter | None = None) -> None:
        """k steps of rows [0, n) with no host read between them (k <= max_steps: the history holds that many)."""
        if not 1 <= k <= self.max_steps:
            raise ValueError(f"DecodeStep.steps: k={k}, this step holds 1 to {self.max_steps} unread bytes a row")
        for _ in range(k):
            self(n, counters)

    def read_drawn(self, n: int) -> list[list[tuple[int, int]]]:
        """Each of rows [0, n)'s unread (byte, stopped), oldest first, in one device-to-host copy; then none is unread.
        With max_steps 1 it is `read` (each row's one byte)."""
        if self.max_steps == 1:
            return [[r] for r in self.read(n)]
        with torch.inference_mode():
            flat = torch.cat([self.buf.n_drawn[:n, None], self.buf.drawn[:n].flatten(1)], 1).tolist()
            self.buf.n_drawn[:n].zero_()
        if any(row[0] > self.max_steps for row in flat):  # its history kept only the first max_steps: bytes lost
            raise RuntimeError(f"DecodeStep.read_drawn: a row drew {max(r[0] for r in flat)} bytes since its last read, "
                               f"over max_steps={self.max_steps}")
        return [[(row[1 + 2 * j], row[2 + 2 * j]) for j in range(row[0])] for row in flat]

    def begin(self, logits: torch.Tensor, state: LMState, seeds: Sequence[int], temperatures: Sequence[float],
              top_ks: Sequence[int | None], stops: Sequence[Iterable[int]]) -> Rows:
        """Rows starting after a prefill (logits [n, vocab] of each row's next byte, the state after the prompt):
        the first byte drawn with counter 0 by the sampler the step uses. Per-row seeds (int64 range or up to 2**64),
        temperatures (>= 0), top-k (None: no cut) and stop bytes."""
        n, V = logits.shape
        if not len(seeds) == len(temperatures) == len(top_ks) == len(stops) == n == state.batch_size:
            raise ValueError(f"DecodeStep.begin: {n} rows of logits, state {state.batch_size}, seeds {len(seeds)}, "
                             f"temperatures {len(temperatures)}, top_ks {len(top_ks)}, stops {len(stops)}")
        if any(t < 0 for t in temperatures) or any(k is not None and k < 1 for k in top_ks):
            raise ValueError(f"temperatures must be >= 0 and top_k >= 1 or None, got {temperatures}, {top_ks}")
        dev = self.device
        with torch.inference_mode():
            stop = torch.zeros(n, V, dtype=torch.bool)
            for i, row in enumerate(stops):
                stop[i, list(row)] = True
            seed = torch.tensor([int64_seed(s) for s in seeds], dtype=torch.long, device=dev)
            temperature = torch.tensor(list(temperatures), dtype=torch.float32, device=dev)
            top_k = torch.tensor([V if k is None else min(k, V) for k in top_ks], dtype=torch.long, device=dev)
            counter = torch.zeros(n, dtype=torch.long, device=dev)
            byte = sample_rows(logits, seed, counter, temperature, top_k)
            stop = stop.to(dev)
            drawn = torch.zeros(n, self.max_steps, 2, dtype=torch.long, device=dev)  # the first byte: unread
            drawn[:, 0, 0], drawn[:, 0, 1] = byte, stop.gather(1, byte[:, None])[:, 0]
            return Rows(state, byte, counter + 1, seed, temperature, top_k, stop, drawn,
                        torch.ones(n, dtype=torch.long, device=dev))

    def put(self, slots: Sequence[int] | torch.Tensor, rows: Rows) -> None:
        """Write `rows` into slots (row i into slots[i]), their (byte, stopped) into the output buffer."""
        with torch.inference_mode():
            idx = torch.as_tensor(slots, dtype=torch.long).to(self.device)
            for dst, src in zip(self.buf.state.tensors(), rows.state.tensors()):
                dst[idx] = src.to(dst.dtype)
            for dst, src in zip(self.buf[1:], rows[1:]):
                dst[idx] = src.to(device=self.device, dtype=dst.dtype)
            self.out[idx, 1] = rows.stop.gather(1, rows.byte[:, None])[:, 0].long()

    def take(self, slots: Sequence[int] | torch.Tensor) -> Rows:
        """A copy of the rows in `slots` (a stream pausing, or rows moving)."""
        with torch.inference_mode():
            idx = torch.as_tensor(slots, dtype=torch.long).to(self.device)
            return Rows(self.buf.state.select(idx), *(t[idx] for t in self.buf[1:]))

    def compact(self, keep: Sequence[int]) -> None:
        """Rows `keep` (slot numbers, any order) to slots [0, len(keep)), in that order (`take` copies them first)."""
        if list(keep) != list(range(len(keep))):
            self.put(range(len(keep)), self.take(keep))


def generate_static(
    model: ByteLM,
    prompts: list[bytes],
    max_new_bytes: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_byte: int | None = 0x03,
    seeds: Sequence[int] | None = None,
    samples_per_prompt: int = 1,
    graphed: bool | None = None,
    bf16: bool = True,
    counters: Counter | None = None,
    step: DecodeStep | None = None,
) -> list[bytes]:
    """`generate` through a `DecodeStep` of one bucket (CUDA graphs on CUDA unless graphed=False; eager on CPU):
    every row stepped until all have stopped or max_new_bytes, one host read a step. Row i samples with the per-row
    RNG from seeds[i] (default i), so its bytes depend on its prompt and seed only, never on the other rows; they are
    not generate's draws (another generator). At temperature 0 the bytes are generate's. No log-probs.
    `step`: a DecodeStep of this model to reuse (rl samples every step through one: its graphs read the weights in
    place, so an optimizer's in-place update is what the next replay sees); then `graphed` and `bf16` are the step's.
    Counters as generate's."""
    assert not model.training, "generate_static: put the model in eval mode first (model.eval())"
    if max_new_bytes < 0 or samples_per_prompt < 1:
        raise ValueError(f"need max_new_bytes >= 0 and samples_per_prompt >= 1, got {max_new_bytes}, "
                         f"{samples_per_prompt}")
    n_rows = len(prompts) * samples_per_prompt
    seeds = list(range(n_rows)) if seeds is None else list(seeds)
    if len(seeds) != n_rows:
        raise ValueError(f"generate_static: {len(seeds)} seeds for {n_rows} rows")
    if not prompts or max_new_bytes == 0:
        return [b""] * n_rows
    if step is None:
        step = DecodeStep(model, n_rows, buckets=[n_rows], graphed=graphed, bf16=bf16)
    elif step.model is not model or n_rows > step.max_batch:
        raise ValueError(f"generate_static: {n_rows} rows through a DecodeStep of {step.max_batch} rows "
                         f"({'its' if step.model is model else 'another'} model)")
    outs: list[list[int]] = [[] for _ in range(n_rows)]
    done = [False] * n_rows
    with torch.inference_mode(), autocast(step.device, step.dtype):
        logits, state = prefill_prompts(model, prompts, counters)
        if samples_per_prompt > 1:
            logits, state = logits.repeat_interleave(samples_per_prompt, 0), state.repeat_interleave(samples_per_prompt)
        stops = [() if stop_byte is None else (stop_byte,)] * n_rows
        step.put(range(n_rows), step.begin(logits, state, seeds, [temperature] * n_rows, [top_k] * n_rows, stops))
        for n in range(max_new_bytes):
            for i, (byte, stopped) in enumerate(step.read(n_rows)):
                if not done[i]:
                    outs[i].append(byte)
                    done[i] = bool(stopped)
            if all(done) or n == max_new_bytes - 1:
                break
            step(n_rows, counters)
    if counters is not None:
        counters["decode.new_bytes"] += sum(len(o) for o in outs)
        counters["decode.rows_stopped.stop_byte"] += sum(done)
        counters["decode.rows_stopped.max_new_bytes"] += n_rows - sum(done)
    return [bytes(o) for o in outs]
