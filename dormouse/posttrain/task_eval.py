"""The verifiable tasks as sft, rl and bench use them: the held-out set, greedy exact-match
accuracy, and a seeded stream of training items. Every stage reports accuracy on the same
held-out items (bench seed split), so the numbers of sft, rl and bench line up."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Iterator

import torch

from dormouse.data import chat
from dormouse.posttrain import mc, tasks
from dormouse.posttrain.decode import DecodeStep, generate_static
from dormouse.posttrain.settings import TaskSettings
from dormouse.train.runtime import autocast, evaluate, uses_bf16


def heldout_items(task_set: TaskSettings) -> list[tasks.Item]:
    """Up to `heldout_items` bench-split items of distinct prompts from every (family, difficulty): a small cell gives
    the prompts it holds, each once (tasks.distinct_items); `cell_counts` says how many each cell gave."""
    return [it for fam in task_set.families for d in task_set.difficulties
            for it in tasks.distinct_items("bench", fam, d, task_set.heldout_items)]


def dev_items(task_set: TaskSettings, per_cell: int) -> list[tasks.Item]:
    """Up to `per_cell` dev-split items of distinct prompts from every (family, difficulty): rl's model-selection set,
    whose prompts rl never trains on and the held-out set never asks."""
    return [it for fam in task_set.families for d in task_set.difficulties
            for it in tasks.distinct_items("dev", fam, d, per_cell)]


def mc_items(items: list[tasks.Item], k: int) -> list[mc.McItem]:
    """The items as byte-level multiple choice (bench's tasks_mc): context the chat prompt, each choice an answer
    + END, distractors from tasks.choices."""
    out = []
    for it in items:
        options, answer = tasks.choices(it, k=k, seed=it.seed)
        out.append(mc.McItem(context=chat.prompt_bytes(it.prompt),
                             choices=[o.encode() + bytes([chat.END]) for o in options],
                             answer=answer, source=f"{it.family}@{it.difficulty}"))
    return out


def cell_counts(items: list[tasks.Item]) -> dict[str, int]:
    """Items per family@difficulty (a set's size where small cells give fewer than asked)."""
    return dict(sorted(Counter(f"{it.family}@{it.difficulty}" for it in items).items()))


def grade(item: tasks.Item, generated: bytes) -> str:
    """'correct', 'wrong' or 'malformed' (no END, a turn byte, bad UTF-8, or not the answer's form)."""
    reply = chat.parse_assistant(generated)
    if reply is None or not tasks.is_well_formed(item.family, reply):
        return "malformed"
    return "correct" if tasks.verify(item, reply) else "wrong"


# Decode state one chunk of rows may hold on CUDA (the step's buffers; the prefill's state and a step's output hold
# about as much again): small's 807 held-out rows (~0.57 MB each) decode in one chunk, b1's in several.
DECODE_STATE_BUDGET = 2 << 30
CPU_ROWS, CPU_SAMPLED_ITEMS = 256, 64  # on CPU, compute-bound, the chunks eager generate's batches had


def row_state_bytes(model, device, dtype: str) -> int:
    """The bytes of one row's decode state (LMState), as DecodeStep builds it: one step from no state."""
    with torch.inference_mode(), autocast(device, dtype):
        _, one = model.step(torch.zeros(1, dtype=torch.long, device=device), None)
    return one.row_bytes()


def chunk_rows(model, device, dtype: str, cpu_rows: int) -> int:
    """Rows one `generate_static` chunk decodes: on CUDA as many as DECODE_STATE_BUDGET of state holds (a step is one
    graph replay whatever the rows, so few big chunks), on CPU `cpu_rows`."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_rows
    return max(1, DECODE_STATE_BUDGET // row_state_bytes(model, device, dtype))


def decode_chunks(model, prompts: list[bytes], max_new_bytes: int, dtype: str, prompts_per_chunk: int,
                  samples: int = 1, temperature: float = 0.0, seeds: list[int] | None = None) -> list[bytes]:
    """`generate_static` over `prompts_per_chunk` prompts (x `samples` rows) at a time, every chunk through ONE
    DecodeStep of that many rows (a last, smaller chunk through a bucket of its size), freed on return; bf16 as
    `uses_bf16(dtype)`."""
    if not prompts or max_new_bytes == 0:
        return [b""] * (len(prompts) * samples)
    per = max(1, min(prompts_per_chunk, len(prompts)))
    last = len(prompts) % per or per  # the last chunk's own bucket: it would step `per` rows otherwise
    step = DecodeStep(model, per * samples, buckets=sorted({last * samples, per * samples}), bf16=uses_bf16(dtype))
    out: list[bytes] = []
    for i in range(0, len(prompts), per):
        rows = None if seeds is None else seeds[i * samples : (i + per) * samples]
        out += generate_static(model, prompts[i : i + per], max_new_bytes, temperature=temperature, seeds=rows,
                               samples_per_prompt=samples, step=step)
    return out


@torch.no_grad()
def answer(model, items: list[tasks.Item], max_new_bytes: int, device, dtype: str, batch: int | None = None,
           step=None) -> list[bytes]:
    """Greedy replies to every item's prompt (eval mode; the caller's train/eval mode is restored), through
    `generate_static` in chunks of `batch` rows (default `chunk_rows`): greedy, so eager generate's bytes whatever the
    chunks, up to a near-tie that another kernel shape may break in bf16. `step`: a `decode.DecodeStep` of at least
    len(items) rows to decode them through in one batch (rl's dev checks keep theirs); compare only replies decoded in
    one precision (bf16 kernels may break a near-tie otherwise)."""
    was_training = model.training
    model.eval()
    prompts = [chat.prompt_bytes(it.prompt) for it in items]
    if step is not None:
        out = generate_static(model, prompts, max_new_bytes, step=step)
    else:
        batch = chunk_rows(model, device, dtype, CPU_ROWS) if batch is None else batch
        out = decode_chunks(model, prompts, max_new_bytes, dtype, batch)
    model.train(was_training)
    return out


def correct(model, items: list[tasks.Item], max_new_bytes: int, device, dtype: str, step=None) -> list[bool]:
    """Per item, whether the greedy reply is verified correct (for paired comparisons of two models); `step` as
    `answer`'s."""
    replies = answer(model, items, max_new_bytes, device, dtype, step=step)
    return [grade(it, g) == "correct" for it, g in zip(items, replies, strict=True)]


def paired_sign(base: list[bool], new: list[bool], keys: list | None = None) -> dict:
    """Two models' per-item correctness on the same items: the items `new` gains and loses against `base`, and
    the sign test's z = (gained - lost) / sqrt(gained + lost) (0 when they agree on every item). rl's checkpoint
    selection and bench's comparisons both read it. `keys` (the items' prompts): only the first item of each key
    counts, so `units` are distinct prompts. A small cell repeats prompts (add@1 has 100; 32 items ask ~9 of them),
    greedy answers a repeat alike, and one prompt that flipped counted up to 7 times: the test's variance was
    ~2x what its z assumed."""
    if len(base) != len(new) or (keys is not None and len(keys) != len(base)):
        raise ValueError(f"paired comparison of {len(base)} against {len(new)} items"
                         f"{'' if keys is None else f' with {len(keys)} keys'}: not the same items")
    units = range(len(base))
    if keys is not None:
        first: dict = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        units = sorted(first.values())
    gained = sum(new[i] and not base[i] for i in units)
    lost = sum(base[i] and not new[i] for i in units)
    return {"gained": gained, "lost": lost, "z": sign_z(gained, lost), "units": len(units)}


def sign_z(gained: int, lost: int) -> float:
    """The paired sign test's z from the items gained and lost (0 when none differ)."""
    return (gained - lost) / (gained + lost) ** 0.5 if gained + lost else 0.0


def tally(graded: list[tuple[tasks.Item, str]]) -> dict:
    """(item, grade) pairs -> accuracy, correct and malformed counts, and accuracy per family@difficulty."""
    total = Counter(g for _, g in graded)
    cells: dict[str, Counter] = {}
    for it, g in graded:
        cells.setdefault(f"{it.family}@{it.difficulty}", Counter())[g] += 1
    return {
        "accuracy": round(total["correct"] / len(graded), 5),
        "correct": total["correct"],
        "malformed": total["malformed"],
        "by_cell": {k: round(v["correct"] / sum(v.values()), 5) for k, v in sorted(cells.items())},
    }


def constant_baseline(items: list[tasks.Item]) -> float:
    """The accuracy of the best constant reply per (family, difficulty): what a model that ignores the
    operands scores (one-digit products are often 0, a letter count is often 1)."""
    cells: dict[tuple, Counter] = {}
    for it in items:
        cells.setdefault((it.family, it.difficulty), Counter())[it.answer] += 1
    return round(sum(c.most_common(1)[0][1] for c in cells.values()) / len(items), 5)


def accuracy(model, items: list[tasks.Item], max_new_bytes: int, device, dtype: str, per_item: bool = False) -> dict:
    """Exact-match accuracy by greedy decode, overall and per family / difficulty, beside the constant-reply
    baseline and the number of distinct replies (a model that collapsed to one answer shows 1 or 2). per_item: also
    `items_correct`, one character per item in order ("1" correct), what paired comparisons of two models read."""
    replies = answer(model, items, max_new_bytes, device, dtype)
    grades = [grade(it, g) for it, g in zip(items, replies, strict=True)]
    return {"n": len(items), **tally(list(zip(items, grades))),
            "distinct_replies": len({chat.parse_assistant(g) for g in replies}),
            "distinct_prompts": len({it.prompt for it in items}),  # the independent count (heldout_items: all distinct)
            "constant_baseline": constant_baseline(items),
            **({"items_correct": "".join("1" if g == "correct" else "0" for g in grades)} if per_item else {})}


def sample_seed(seed: int, item: int, sample: int) -> int:
    """The rowrng seed of sample `sample` of item `item` (its index in the list) under sampled_eval's `seed`."""
    key = f"sampled_eval:{seed}:{item}:{sample}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


@torch.no_grad()
def sampled_accuracy(model, items: list[tasks.Item], max_new_bytes: int, device, dtype: str, samples: int,
                     temperature: float, seed: int, batch_items: int | None = None) -> dict:
    """Mean exact match of `samples` replies per item drawn at `temperature` (a pass@1 estimate), through
    `generate_static` in chunks of `batch_items` items (default `chunk_rows` // samples). Sample s of items[i] draws
    with the per-row RNG (dormouse.posttrain.rowrng) from `sample_seed(seed, i, s)`: its bytes depend on its prompt,
    seed, i and s only, never on the chunks, the rows beside it or how many samples are asked (a CPU and a CUDA
    run differ only where their logits do). Temperatures below rowrng.GREEDY_BELOW decode greedily."""
    was_training = model.training
    model.eval()
    if batch_items is None:
        batch_items = max(1, chunk_rows(model, device, dtype, CPU_SAMPLED_ITEMS * samples) // samples)
    seeds = [sample_seed(seed, i, s) for i in range(len(items)) for s in range(samples)]
    replies = decode_chunks(model, [chat.prompt_bytes(it.prompt) for it in items], max_new_bytes, dtype, batch_items,
                            samples, temperature, seeds)
    model.train(was_training)
    t = tally([(items[j // samples], grade(items[j // samples], r)) for j, r in enumerate(replies)])
    return {"accuracy": t["accuracy"], "samples_per_item": samples, "temperature": temperature,
            "malformed": t["malformed"], "by_cell": t["by_cell"]}


def heldout_accuracy(model, items: list[tasks.Item], task_set: TaskSettings, device, dtype: str,
                     per_item: bool = False) -> dict:
    """Greedy accuracy, with the sampled accuracy under "sampled" when tasks.sampled_eval.samples > 0:
    what sft, rl and bench report for the held-out items (bench with per_item, see `accuracy`)."""
    acc = accuracy(model, items, task_set.max_new_bytes, device, dtype, per_item)
    s = task_set.sampled_eval
    if s.samples > 0:
        acc["sampled"] = sampled_accuracy(model, items, task_set.max_new_bytes, device, dtype, s.samples,
                                          s.temperature, s.seed)
    return acc


def item_stream(split: str, families: list[str], difficulty_of, seed: int, spread: bool = False,
                skip: frozenset = frozenset()) -> Iterator[tasks.Item]:
    """An endless seeded stream of `split` items: family drawn uniformly, difficulty from
    `difficulty_of(family, rng)` (fixed list or a curriculum); a (family, difficulty) in `skip` is drawn again, so a
    family with skipped cells is drawn less often (rl_skip_cells allows only a family's top cells under a curriculum,
    which never freezes one); spread as in cell_stream."""
    def cell_of(rng):
        for _ in range(10_000):
            fam = rng.choice(families)
            cell = (fam, difficulty_of(fam, rng))
            if cell not in skip:
                return cell
        raise RuntimeError(f"item_stream: every cell drawn is in skip {sorted(skip)}: no cell open to draw")
    return cell_stream(split, cell_of, seed, spread)


def cell_stream(split: str, cell_of, seed: int, spread: bool = False) -> Iterator[tasks.Item]:
    """An endless seeded stream of `split` items, each (family, difficulty) from `cell_of(rng)` and consuming its
    own seeds in order, so no item repeats until a cell's seed range is spent. spread: each cell starts at a point
    of its seed range drawn from `seed` (and wraps), so two seeds train on different prompts, not on one sequence
    in another family order."""
    rng = random.Random(f"item_stream:{split}:{seed}")
    seeds = tasks.SPLITS[split]
    next_index: Counter = Counter()
    while True:
        fam, diff = cell_of(rng)
        if spread and (fam, diff) not in next_index:
            next_index[(fam, diff)] = random.Random(f"cell_start:{split}:{seed}:{fam}:{diff}").randrange(len(seeds))
        idx = next_index[(fam, diff)]
        next_index[(fam, diff)] += 1
        yield tasks.make_item(fam, diff, seeds[idx % len(seeds)])


def held_out(model, items: list[tasks.Item], task_set: TaskSettings, dtype: str, batch_size: int, device, ex, ey,
             counters: Counter, base: dict | None = None) -> dict:
    """Task accuracy (greedy, and sampled when tasks.sampled_eval.samples > 0, with each item's greedy correctness)
    and corpus BPB on the eval window: the numbers every post-training stage reports. `base`: this stage's start (the
    model it was given), against which `vs_start` holds the paired sign test over distinct prompts — the z bench's
    `paired` computes, in the stage's own log, so a run whose bench is lost still says it."""
    acc = heldout_accuracy(model, items, task_set, device, dtype, per_item=True)
    bpb = evaluate(model, ex, ey, batch_size, device, dtype, counters)
    out = {**acc, "corpus_bpb": round(bpb, 5)}
    if base is not None:
        sign = paired_sign([c == "1" for c in base["items_correct"]], [c == "1" for c in acc["items_correct"]],
                           [it.prompt for it in items])
        out["vs_start"] = {**sign, "z": round(sign["z"], 3)}
    return out


def held_out_line(r: dict) -> str:
    sampled = f" sampled {r['sampled']['accuracy']} (T {r['sampled']['temperature']})" if "sampled" in r else ""
    v = r.get("vs_start")
    paired = f"; against the start +{v['gained']} -{v['lost']} of {v['units']} prompts, z {v['z']}" if v else ""
    return (f"accuracy {r['accuracy']} (constant-reply baseline {r['constant_baseline']}, {r['distinct_replies']} distinct "
            f"replies){sampled} corpus_bpb {r['corpus_bpb']}{paired}")
