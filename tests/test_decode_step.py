"""The static-shape decode step (dormouse.posttrain.decode.DecodeStep, generate_static): greedy bytes equal
generate's, a seeded row's bytes do not depend on the rows beside it, its slot or the bucket's padding, rows move
between slots (a stream pausing and resuming) without changing a byte; on CUDA, graphed equals eager.

Models as tests/test_decode.py (weights perturbed off init, so the blocks are live), fp32 on CPU."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_decode import CONFIGS, live_model, rand_prompt

from dormouse.posttrain.decode import DecodeStep, copy_state, default_buckets, generate, generate_static, prefill_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_copy_state_writes_every_pair_whatever_its_dtype_or_layout(monkeypatch):
    """The step's state write-back: dense pairs go through one foreach copy per dtype, strided sources and
    in-place pairs are handled one by one; every destination ends equal to its source."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 6, 8, generator=g)
    srcs = [torch.randn(3, 4, generator=g), torch.randn(3, 2, 2, generator=g).bfloat16(),
            torch.randint(0, 255, (3, 5), generator=g), wide[:, 2:5], torch.randn(3, 4, generator=g)]
    dsts = [torch.zeros(3, 4), torch.zeros(3, 2, 2, dtype=torch.bfloat16), torch.zeros(3, 5, dtype=torch.long),
            torch.zeros(3, 3, 8), torch.zeros(3, 4)]
    in_place = torch.randn(3, 7, generator=g)
    seen = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (seen.append(len(d)), real(d, s)))
    copy_state(dsts + [in_place], srcs + [in_place])
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert sorted(seen) == [1, 1, 2]  # fp32 (two), bf16, long; the strided source and the in-place pair apart


@pytest.mark.parametrize("name", ["all_on_conv4", "plain"])
def test_greedy_static_step_gives_generates_bytes(name):
    m = live_model(CONFIGS[name])
    prompts = [rand_prompt(5, 10), rand_prompt(1, 11), rand_prompt(12, 12), rand_prompt(5, 13)]
    want = generate(m, prompts, 15, stop_byte=None)
    counters = Counter()
    assert generate_static(m, prompts, 15, stop_byte=None, counters=counters) == want
    assert counters["decode.new_bytes"] == 60 and counters["decode.rows_stopped.max_new_bytes"] == 4
    assert counters["kda_path.torch_recurrent"] == (1 + 14) * m.cfg.depth  # the prefill of length 1, then 14 steps
    # with a stop byte: rows end at it (kept), the others go on; the stopped rows keep running in the bucket unread
    stop = want[0][4]
    cut = [w[: w.index(stop) + 1] if stop in w else w for w in want]
    assert generate_static(m, prompts, 15, stop_byte=stop) == generate(m, prompts, 15, stop_byte=stop) == cut
    assert generate_static(m, prompts, 0) == [b""] * 4
    with pytest.raises(ValueError, match="seeds"):
        generate_static(m, prompts, 3, seeds=[1, 2])


def test_a_seeded_rows_bytes_do_not_depend_on_the_other_rows():
    m = live_model(CONFIGS["all_on_conv0"])
    prompts = [rand_prompt(4, 30), rand_prompt(9, 31), rand_prompt(4, 32)]
    kw = dict(temperature=1.3, top_k=40, stop_byte=None)
    together = generate_static(m, prompts, 20, seeds=[11, 22, 33], **kw)
    assert len(set(together)) == 3
    for i in range(3):  # alone, and among other rows in another order
        assert generate_static(m, [prompts[i]], 20, seeds=[[11, 22, 33][i]], **kw) == [together[i]]
    shuffled = generate_static(m, [prompts[2], rand_prompt(7, 33), prompts[0], prompts[1]], 20,
                               seeds=[33, 5, 11, 22], **kw)
    assert [shuffled[2], shuffled[3], shuffled[0]] == together
    assert generate_static(m, prompts, 20, seeds=[11, 22, 34], **kw)[2] != together[2]  # the seed matters
    # samples_per_prompt: rows of one prompt differ by seed, and equal the prompt repeated
    grouped = generate_static(m, prompts[:2], 12, samples_per_prompt=3, temperature=1.0, stop_byte=None)
    assert grouped == generate_static(m, [p for p in prompts[:2] for _ in range(3)], 12, temperature=1.0,
                                      stop_byte=None) and len(set(grouped[:3])) > 1


def drive(step: DecodeStep, n_live: int, steps: int) -> list[list[int]]:
    out = [[b] for b, _ in step.read(n_live)]
    for _ in range(steps):
        step(n_live)
        for o, (b, _) in zip(out, step.read(n_live)):
            o.append(b)
    return out


def test_slots_buckets_and_moving_rows_change_no_byte():
    """A serve-like life: rows in a padded bucket, one paused (taken out) while the others go on, then put back in
    another slot, rows compacted after one leaves: every row's bytes are what it decodes alone in a bucket of one."""
    m = live_model(CONFIGS["all_on_conv4"])
    prompts = [rand_prompt(6, 40), rand_prompt(3, 41), rand_prompt(9, 42)]
    seeds, temps, top_ks = [7, 8, 9], [1.0, 1.3, 0.0], [None, 20, None]  # row 1 (paused below) samples

    def alone(i, n):
        step = DecodeStep(m, 1, bf16=False)
        logits, state = prefill_prompts(m, [prompts[i]])
        step.put([0], step.begin(logits, state, [seeds[i]], [temps[i]], [top_ks[i]], [()]))
        return drive(step, 1, n)[0]

    ref = [alone(i, 12) for i in range(3)]
    step = DecodeStep(m, 8, bf16=False)
    assert step.buckets == default_buckets(8) == [1, 2, 4, 8] and not step.graphed
    logits, state = prefill_prompts(m, prompts)
    step.put([0, 1, 2], step.begin(logits, state, seeds, temps, top_ks, [()] * 3))  # bucket 4: one padding row
    got = drive(step, 3, 4)  # bytes 0..4 of each row
    paused = step.take([1])
    step.compact([0, 2])
    more = drive(step, 2, 3)  # rows 0 and 2 go on alone (bucket 2)
    got[0] += more[0][1:]
    got[2] += more[1][1:]
    step.put([2], paused)  # row 1 back, in slot 2
    step.compact([0, 2, 1])  # slots 0, 2, 1 -> 0, 1, 2: rows 0, 1, 2 in order again
    back = drive(step, 3, 2)
    got[0] += back[0][1:]
    got[1] += back[1][1:]
    got[2] += back[2][1:]
    assert got[0] == ref[0][:len(got[0])] and got[2] == ref[2][:len(got[2])]
    assert got[1] == ref[1][:len(got[1])]
    with pytest.raises(ValueError):
        step(9)


def test_byte_k_of_a_row_is_drawn_with_its_seed_and_counter_k_and_the_stop_test_runs_on_the_device():
    """The contract a replay keeps: byte k of a row is sample_rows(its logits there, its seed, counter k), and the
    stop flag says whether that byte is one of the row's stop bytes."""
    from dormouse.posttrain.rowrng import sample_rows

    m = live_model(CONFIGS["all_on_conv4"])
    prompt, seed = rand_prompt(5, 50), 2**63 + 5  # a seed above int64's range, as the server accepts
    want, logits = [], None
    with torch.no_grad():
        logits, state = m.prefill(torch.tensor([list(prompt)]))
        logits = logits[:, -1]
        for k in range(10):
            b = sample_rows(logits, torch.tensor([seed - 2**64]), torch.tensor([k]), 1.2, 30)
            want.append(int(b))
            logits, state = m.step(b, state)
    stops = {want[3], want[7]}
    step = DecodeStep(m, 2, bf16=False)
    lg, st = prefill_prompts(m, [prompt])
    step.put([1], step.begin(lg, st, [seed], [1.2], [30], [stops]))  # slot 1 of a bucket of 2
    got = [step.read(2)[1]] + [tuple(step(2)[1].tolist()) for _ in range(9)]
    assert [b for b, _ in got] == want
    assert [f for _, f in got] == [int(b in stops) for b in want]


def test_k_steps_between_host_reads_give_each_row_its_bytes_in_order_and_a_paused_row_keeps_its_unread_ones():
    """max_steps > 1: steps(n, k) then read_drawn(n) gives each row the k bytes it drew, oldest first, the same bytes
    as one read a step (any mix of k); a row taken out between steps takes its unread bytes along and hands them over
    when put back in another slot; a row that just joined has its first byte unread."""
    m = live_model(CONFIGS["all_on_conv4"])
    prompts = [rand_prompt(6, 60), rand_prompt(3, 61), rand_prompt(9, 62)]
    seeds, temps, top_ks = [3, 4, 5], [1.0, 1.3, 0.0], [None, 20, None]
    stops = [(), (), ()]

    def started(step):
        logits, state = prefill_prompts(m, prompts)
        step.put([0, 1, 2], step.begin(logits, state, seeds, temps, top_ks, stops))

    one = DecodeStep(m, 4, bf16=False)
    started(one)
    ref = drive(one, 3, 12)  # 13 bytes a row: the first and 12 steps'
    for ks in ([4, 4, 4], [1, 3, 4, 4], [2, 1, 1, 4, 4]):
        step = DecodeStep(m, 4, bf16=False, max_steps=4)
        started(step)
        got = [[b for b, _ in r] for r in step.read_drawn(3)]
        for k in ks:
            step.steps(3, k)
            for g, r in zip(got, step.read_drawn(3)):
                assert len(r) == k
                g += [b for b, _ in r]
        assert got == ref, ks
    step = DecodeStep(m, 4, bf16=False, max_steps=4)
    started(step)
    got = [[b for b, _ in r] for r in step.read_drawn(3)]
    step.steps(3, 3)
    paused = step.take([1])  # its 3 bytes unread
    step.compact([0, 2])
    for _ in range(2):
        for g, r in zip([got[0], got[2]], step.read_drawn(2)):
            g += [b for b, _ in r]  # rows 0 and 2: 3, then 2
        step.steps(2, 2)
    step.put([2], paused)
    step.compact([0, 2, 1])
    step.steps(3, 1)
    back = step.read_drawn(3)
    assert [len(r) for r in back] == [3, 4, 3]  # row 1: its 3 from before the pause and this step's
    for g, r in zip(got, back):
        g += [b for b, _ in r]
    assert got[1] == ref[1][:5] and got[0] == ref[0][:9] and got[2] == ref[2][:9]
    with pytest.raises(ValueError, match="k=5"):
        step.steps(3, 5)
    step.steps(3, 4)
    step.steps(3, 1)
    with pytest.raises(RuntimeError, match="drew 5 bytes since its last read"):
        step.read_drawn(3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's recurrent kernel)")
@pytest.mark.parametrize("name", ["all_on_conv4", "plain"])
def test_graphed_and_eager_decode_give_the_same_bytes_on_cuda(name):
    """The CUDA graphs replay exactly the eager step: same bytes, greedy and seeded, bf16 autocast as serve runs,
    for a batch in a padded bucket; and the per-call counters say FLA's recurrent kernel ran in every replay."""
    m = live_model(CONFIGS[name]).cuda()
    prompts = [rand_prompt(6, 60), rand_prompt(2, 61), rand_prompt(17, 62)]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=50, seeds=[3, 4, 5])):
        eager = generate_static(m, prompts, 24, stop_byte=None, graphed=False, **kw)
        counters = Counter()
        graphed = generate_static(m, prompts, 24, stop_byte=None, graphed=True, counters=counters, **kw)
        assert graphed == eager and all(len(o) == 24 for o in graphed)
        assert counters["kda_path.fla_recurrent"] == 23 * m.cfg.depth  # 23 replays (no prompt of one byte)
    step = DecodeStep(m, 4)  # buckets 1, 2, 4; three live rows run bucket 4
    assert step.graphed and sorted(step.graphs) == [1, 2, 4]
    logits, state = prefill_prompts(m, prompts)
    rows = step.begin(logits, state, [1, 2, 3], [1.0] * 3, [None] * 3, [()] * 3)
    step.put([0, 1, 2], rows)
    graphed = drive(step, 3, 16)
    eager = DecodeStep(m, 4, graphed=False)
    eager.put([0, 1, 2], rows)
    assert drive(eager, 3, 16) == graphed
    multi = DecodeStep(m, 4, max_steps=4)  # the per-row history written inside the captured graph
    multi.put([0, 1, 2], multi.begin(logits, state, [1, 2, 3], [1.0] * 3, [None] * 3, [()] * 3))
    got = [[b for b, _ in r] for r in multi.read_drawn(3)]
    for k in (4, 4, 3, 4, 1):
        multi.steps(3, k)
        for g, r in zip(got, multi.read_drawn(3)):
            g += [b for b, _ in r]
    assert got == graphed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's recurrent kernel)")
def test_the_graphed_batcher_serves_on_cuda():
    """serve --decode graphed on the GPU: graphs captured on the caller's thread, replayed on the decode thread,
    streams of different lengths (rows leave from the middle of a padded bucket); fp32, so that the greedy bytes
    equal generate's and a seeded stream's bytes are generate_static's alone whatever the rows beside it."""
    import threading

    from dormouse.serve.batcher import GraphedBatcher, Stream

    m = live_model(CONFIGS["all_on_conv4"]).cuda()
    b = GraphedBatcher(m, torch.device("cuda"), bf16=False, max_batch=8)
    b.start()
    outs, done = {}, threading.Semaphore(0)

    def submit(key, prompt, n, **kw):
        outs[key] = bytearray()
        b.submit(Stream(prompt, n, emit=lambda t: outs[key].extend(t.encode("utf-8", "surrogateescape")),
                        finish=lambda *a: done.release(), stop_bytes=frozenset(), **kw))

    prompts = [rand_prompt(3 + i, 70 + i) for i in range(5)]
    try:
        for i, p in enumerate(prompts):
            submit(i, p, 30 - 4 * i, temperature=0.0)
        submit("seeded", prompts[0], 20, temperature=1.0, top_k=40, seed=99)
        for _ in range(6):
            assert done.acquire(timeout=120)
    finally:
        b.stop()
    assert b.counters["kda_path.fla_recurrent"] > 0 and b.counters["serve.steps"] >= 30
    for i, p in enumerate(prompts):
        want = generate(m, [p], 30 - 4 * i, stop_byte=None, bf16=False)[0]
        assert bytes(outs[i]) == want.decode("utf-8", "replace").encode("utf-8", "surrogateescape"), i
    alone = generate_static(m, [prompts[0]], 20, temperature=1.0, top_k=40, seeds=[99], stop_byte=None, bf16=False)[0]
    assert bytes(outs["seeded"]) == alone.decode("utf-8", "replace").encode("utf-8", "surrogateescape")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's recurrent kernel)")
def test_the_compiled_graphed_batcher_compiles_at_start_and_serves_without_a_recompile_on_cuda():
    """serve --compile cuda: inductor's regions under the captured step. Every shape is compiled at start, so under
    torch's fail_on_recompile stance streams of any prompt length (whole and in pieces) decode to their full length;
    and the compiled regions compute the model's function (a prefill's logits against an uncompiled copy's)."""
    import copy
    import threading

    from torch._dynamo.utils import counters as dynamo_counters

    from dormouse.serve.batcher import GraphedBatcher, Stream

    m = live_model(CONFIGS["all_on_conv4"]).cuda()
    plain = copy.deepcopy(m)
    b = GraphedBatcher(m, torch.device("cuda"), bf16=True, max_batch=8, prefill_chunk=64, compile=True)  # as served
    b.start()
    assert b.counters["serve.compiled_regions"] > 0
    graphs = dynamo_counters["stats"]["unique_graphs"]
    outs, done = {}, threading.Semaphore(0)
    prompts = [rand_prompt(n, 90 + n) for n in (1, 2, 7, 150, 200, 33, 65, 129, 129)]  # pieces continuing 1 and 2 rows
    torch.compiler.set_stance("fail_on_recompile")
    try:
        for i, p in enumerate(prompts):
            outs[i] = bytearray()
            b.submit(Stream(p, 24, emit=lambda t, i=i: outs[i].extend(t.encode("utf-8", "surrogateescape")),
                            finish=lambda *a: done.release(), stop_bytes=frozenset(), temperature=1.0, seed=i))
        for _ in prompts:
            assert done.acquire(timeout=120)
    finally:
        torch.compiler.set_stance("default")
        b.stop()
    assert b.last_error is None and b.counters["serve.prefill_chunks"] >= 4
    assert dynamo_counters["stats"]["unique_graphs"] == graphs
    assert b.counters["serve.finished.length"] == len(prompts)  # every stream its 24 bytes, none failed
    with torch.inference_mode():
        idx = torch.tensor([list(rand_prompt(40, 7))], device="cuda")
        torch.testing.assert_close(m.prefill(idx)[0], plain.prefill(idx)[0], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's recurrent kernel)")
def test_weights_cast_once_for_serving_give_the_same_bits_on_cuda():
    """`dormouse serve` casts the weights autocast would cast every step once (dormouse/serve/weights.py): with FLA's
    and our Triton kernels reading what they read, a prefill, a continued prefill and a step under bf16 autocast
    give the same bits as before, and a graphed step's replay too."""
    import copy

    from dormouse.serve.weights import cast_for_autocast

    m = live_model(CONFIGS["all_on_conv4"]).cuda().eval()
    before = copy.deepcopy(m)
    done = cast_for_autocast(m, torch.device("cuda"))
    assert done["serve.weights_cast_once"] > 0
    idx = torch.tensor([list(rand_prompt(40, s)) for s in range(3)], device="cuda")

    def run(model):
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            a, st = model.prefill(idx)
            b, st = model.prefill(idx[:, :7], st)
            c, _ = model.step(idx[:, 0], st)
            step = DecodeStep(model, 4, buckets=[4])
            step.put([0, 1, 2], step.begin(c, st, [1, 2, 3], [1.0] * 3, [None] * 3, [()] * 3))
            reads = []
            for _ in range(8):
                step(3)
                reads.append(step.read(3))
            return a, b, c, reads

    got, want = run(m), run(before)
    for x, y in zip(got[:3], want[:3]):
        assert torch.equal(x, y)
    assert got[3] == want[3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, FLA's recurrent kernel)")
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_reused_graphed_step_decodes_the_weights_an_optimizer_updated(optimizer):
    """rl samples every step through one DecodeStep captured once: after an optimizer step (fused AdamW, StackedMuon)
    its replays must decode the updated weights, byte for byte what a fresh eager step decodes."""
    from dormouse.train.optim import build_optimizers
    from dormouse.train.settings import OptimSettings

    m = live_model(CONFIGS["all_on_conv4"]).cuda().eval()
    step = DecodeStep(m, 8, buckets=[8])
    assert step.graphed
    prompts = [rand_prompt(5, 80 + i) for i in range(3)]
    kw = dict(temperature=1.0, top_k=40, seeds=[7, 8, 9, 10, 11, 12], samples_per_prompt=2, stop_byte=None)
    before = generate_static(m, prompts, 16, step=step, **kw)
    assert before == generate_static(m, prompts, 16, graphed=False, **kw)
    opts = build_optimizers(m, OptimSettings(optimizer=optimizer, lr=1e-2, muon_lr=0.05, weight_decay=0.0))
    m.train()
    idx = torch.tensor([list(p) for p in prompts], device="cuda")
    logits = m(idx)[0]
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten()).backward()
    for opt in opts:
        opt.step()
    m.eval()
    after = generate_static(m, prompts, 16, step=step, **kw)
    assert after == generate_static(m, prompts, 16, graphed=False, **kw)
    assert after != before  # the update moved the samples: the replay did not decode stale weights
    with pytest.raises(ValueError, match="rows through a DecodeStep of 8"):
        generate_static(m, prompts, 4, samples_per_prompt=3, step=step)


def test_dev_checks_through_a_step_grade_what_the_batched_greedy_decode_grades(monkeypatch):
    """rl's dev checks decode every dev prompt in one DecodeStep batch: greedy, so the same replies (fp32, CPU) and
    grades as task_eval.answer's own chunks (greedy: generate's bytes)."""
    from dormouse.posttrain import task_eval, tasks

    m = live_model(CONFIGS["all_on_conv4"])
    items = tasks.distinct_items("dev", "add", 2, 10) + tasks.distinct_items("dev", "reverse", 1, 10)
    monkeypatch.setattr(task_eval, "grade", lambda item, g: "correct" if g and g[0] % 2 == 0 else "wrong")
    step = DecodeStep(m, 24, buckets=[24], bf16=False)
    cpu = torch.device("cpu")
    got = task_eval.correct(m, items, 8, cpu, "float32", step=step)
    assert got == task_eval.correct(m, items, 8, cpu, "float32") and 0 < sum(got) < len(items)
