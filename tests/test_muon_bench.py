"""benchmarks/muon_bench.py on CPU (tiny preset): every row prints, and the firewall's two paths run."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_muon_bench_prints_every_row(capsys):
    spec = importlib.util.spec_from_file_location("muon_bench", REPO / "benchmarks" / "muon_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--preset", "tiny", "--steps", "1", "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = {line[:18].strip(): line for line in lines if not line.startswith("  stack ")}
    assert list(rows) == ["torch.optim.Muon", "StackedMuon, eager", "StackedMuon", "+ firewall, ok", "+ firewall, where",
                          "Newton-Schulz only"]
    assert all(" ms/step " in r for r in rows.values())
    stacks = [line for line in lines if line.startswith("  stack ")]  # one per wide shape of the tiny preset
    assert len(stacks) == 4 and all(" ms " in r and " TFLOP/s" in r for r in stacks)
    # FLOPs of the wide stacks: a tall matrix is counted once, on its wide side
    assert bench.ns_flops((384, 128), 2, 5) == bench.ns_flops((128, 384), 2, 5) == 2 * 5 * (4 * 128 * 128 * 384 + 2 * 128 ** 3)
