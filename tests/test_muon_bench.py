"""benchmarks/muon_bench.py on CPU (tiny preset): every row prints, and the firewall's two paths run."""

import benchmarks.muon_bench as bench


def test_muon_bench_prints_every_row(capsys):
    assert bench.main(["--preset", "tiny", "--steps", "1", "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = {line[:22].strip(): line for line in lines if not line.startswith("  stack ")}
    assert list(rows) == ["torch.optim.Muon", "StackedMuon, eager", "StackedMuon", "+ firewall, ok", "+ firewall, where",
                          "+ NS a folded", "Newton-Schulz only", "with a folded"]
    assert all(" ms/step " in r for r in rows.values())
    stacks = [line for line in lines if line.startswith("  stack ")]  # one per wide shape of the tiny preset
    assert len(stacks) == 4 and all(" ms " in r and " TFLOP/s" in r for r in stacks)
    # FLOPs of the wide stacks: a tall matrix is counted once, on its wide side
    assert bench.ns_flops((384, 128), 2, 5) == bench.ns_flops((128, 384), 2, 5) == 2 * 5 * (4 * 128 * 128 * 384 + 2 * 128 ** 3)


def test_muon_bench_with_an_moe_times_the_old_bank_layout_as_its_baseline(capsys):
    """torch's Muon refuses expert banks: with an MoE the first row is StackedMuon with tall banks transposed into the
    wide stack (the layout before session 17), and the Newton-Schulz stacks count a bank's matrices."""
    assert bench.main(["--preset", "tiny", "--steps", "1", "--warmup", "1", "--model", '{"moe": true, "n_experts": 4}']) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = [line[:22].strip() for line in lines if not line.startswith("  stack ")]
    assert rows[0] == "tall banks transposed" and "x tall banks transposed" in lines[0]
    stacks = [line for line in lines if line.startswith("  stack ")]
    tall = [line for line in stacks if " tall " in line]  # the down banks: 4 experts a layer, in their own layout
    assert len(tall) == 1 and int(tall[0].split()[1]) % 4 == 0, stacks
