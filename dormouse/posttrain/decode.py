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
from contextlib import nullcontext

import torch

from dormouse.model.gpt import ByteLM, LMState, cat_states


def prefill_prompts(model: ByteLM, prompts: list[bytes], counters: Counter | None = None
                    ) -> tuple[torch.Tensor, LMState]:
    """Each prompt's next-byte logits [N, vocab] and the batch state after it (row i = prompts[i]).
    One prefill per distinct prompt length (rows of equal length share a call); prompts must be non-empty."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: there is no context to predict the first byte from")
    device = next(model.parameters()).device
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    logits, states, order = [], [], []
    for rows in by_len.values():
        idx = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device)  # [n, L]
        lg, st = model.prefill(idx, None, counters)
        logits.append(lg[:, -1])
        states.append(st)
        order += rows
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))  # position of prompt i in the grouped batch
    if counters is not None:
        counters["decode.prompt_bytes"] += sum(len(p) for p in prompts)
    return torch.cat(logits)[inverse.to(device)], cat_states(states).select(inverse)


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
