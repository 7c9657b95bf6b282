"""benchmarks/rl_acceptance.py: issues #23's and #40's criteria read from bench.json (synthetic files, each check
failing once)."""

import copy
import json
from pathlib import Path

import pytest

import benchmarks.rl_acceptance as acc

REPO = Path(__file__).resolve().parents[1]


def bench(gained: int, lost: int, sampled_rl: float = 0.25, bpb_rl: float = 1.62, rl: str = "r0",
          curve=((0, 0.2), (20, 0.22), (40, 0.25))) -> dict:
    def stage(greedy, sampled, bpb):
        return {"bpb": bpb, "tasks_gen": {"accuracy": greedy, "sampled": {"accuracy": sampled}}}

    z = (gained - lost) / (gained + lost) ** 0.5
    return {"stages": {"sft": stage(0.208, 0.185, 1.60), "rl": stage(0.208 + (gained - lost) / 384, sampled_rl, bpb_rl)},
            "paired": {"rl_vs_sft": {"gained": gained, "lost": lost, "z": round(z, 3)}},
            "upstream": {"rl": {"digest": rl, "final": {"selection": {"selected_step": 40,
                                                                     "curve": [list(p) for p in curve]}}},
                         "sft": {"digest": "s", "final": {}}}}


NULL_CURVE = ((0, 0.2), (20, 0.19), (40, 0.18))  # a null arm that trained and learnt nothing


def test_three_seeds_that_each_pass_with_a_null_arm_are_accepted_and_pool(tmp_path):
    files = []
    for i, b in enumerate([bench(30, 10), bench(25, 8, rl="r1"), bench(28, 9, rl="r2"),
                              bench(12, 11, rl="n0", curve=NULL_CURVE)]):
        files.append(tmp_path / f"b{i}.json")
        files[-1].write_text(json.dumps(b))
    out = tmp_path / "acc.json"
    png = tmp_path / "dev.png"
    assert acc.main(["--bench", *map(str, files[:3]), "--null", str(files[3]), "--out", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = acc.dev_curves({f: json.loads(f.read_text()) for f in files[:3]}, (files[3], json.loads(files[3].read_text())))
    assert [c["null"] for c in curves] == [False, False, False, True] and curves[0]["curve"][-1] == (40, 0.25)
    r = json.loads(out.read_text())
    assert r["accepted"] and r["one_sft"] and r["pooled"]["gained"] == 83 and r["pooled"]["lost"] == 27
    assert [s["selected_step"] for s in r["seeds"]] == [40, 40, 40] and r["null"]["passes"]
    # a null arm whose gain reaches z 1: the gain could be the selection's, not RL's
    files[3].write_text(json.dumps(bench(20, 11, rl="n0", curve=NULL_CURVE)))
    assert acc.main(["--bench", *map(str, files[:3]), "--null", str(files[3])]) == 1


def test_a_null_arm_must_have_trained_and_not_risen_on_dev():
    seeds = {Path("a"): bench(30, 10), Path("b"): bench(25, 8, rl="r1"), Path("c"): bench(28, 9, rl="r2")}
    assert acc.accept(seeds, null=(Path("n"), bench(12, 11, rl="n0", curve=NULL_CURVE)))["accepted"]
    for curve, failed in ((((0, 0.2),), "trained"),  # step 0 alone: it never ran an update
                          (((0, 0.2), (20, 0.19), (40, 0.21)), "dev_not_up")):  # its last check above step 0's
        r = acc.accept(seeds, null=(Path("n"), bench(12, 11, rl="n0", curve=curve)))
        assert not r["accepted"] and r["null"]["checks"][failed] is False, failed


def test_each_criterion_fails_the_acceptance_alone():
    good = {Path("a"): bench(30, 10), Path("b"): bench(25, 8, rl="r1")}
    assert acc.accept(good, min_seeds=2)["accepted"]
    assert not acc.accept(good)["accepted"]  # two seeds: fewer than #40's three
    assert acc.accept({**good, Path("c"): bench(25, 8, sampled_rl=0.185, rl="r2")})["accepted"]  # sampled = sft's
    assert not acc.accept({Path("a"): good[Path("a")], Path("a2"): bench(30, 10)}, min_seeds=2)["accepted"]  # one run twice
    other_sft = bench(25, 8, rl="r1")
    other_sft["upstream"]["sft"]["digest"] = "s2"
    assert not acc.accept({Path("a"): good[Path("a")], Path("b"): other_sft}, min_seeds=2)["accepted"]  # two sft models
    just_under = bench(25, 9, rl="r1")
    just_under["paired"]["rl_vs_sft"].update(gained=5102, lost=4902, z=2.0)  # z = 200 / sqrt(10004) = 1.9996: rounds to 2.0
    assert acc.accept({Path("a"): good[Path("a")], Path("b"): just_under})["seeds"][1]["checks"]["z"] is False
    for bad, check in ((bench(20, 12), "z"), (bench(30, 10, sampled_rl=0.18), "sampled_up"),
                       (bench(30, 10, bpb_rl=1.66), "bpb_within")):
        r = acc.accept({Path("a"): good[Path("a")], Path("b"): bad}, min_seeds=2)
        assert not r["accepted"] and r["seeds"][1]["checks"][check] is False, check


def test_a_bench_without_paired_is_named(tmp_path, capsys):
    old = copy.deepcopy(bench(30, 10))
    del old["paired"]
    f = tmp_path / "old.json"
    f.write_text(json.dumps(old))
    assert acc.main(["--bench", str(f)]) == 2
    assert f"{f}: no 'paired'" in capsys.readouterr().err


def test_dev_curves_from_rl_logs_alone_when_no_bench_ran(tmp_path, capsys):
    """A device call whose time ran out after rl: its logs still draw the dev curves (step 0 only from a dev@0 line:
    the `[rl] start:` line is the held-out set, never taken for dev)."""
    rows = [{"step": 20, "reward": 0.3, "dev_accuracy": 0.21}, {"step": 21, "reward": 0.3},
            {"step": 40, "reward": 0.4, "dev_accuracy": 0.23}]
    body = "\n".join(f"[rl] {json.dumps(r)}" for r in rows)
    new = tmp_path / "rl_s0_rl.log"
    new.write_text("[rl] start: accuracy 0.19703 (constant-reply baseline 0.1)\n[rl] dev@0: accuracy 0.2 over 842 "
                   f"distinct prompts; per cell add.1 0.1\n{body}\n[rl] selected step 40 of 40 (bonferroni: ...)\n")
    old = tmp_path / "null_s0_rl.log"
    old.write_text(f"[rl] start: accuracy 0.19703 (constant-reply baseline 0.1)\n{body}\n")
    png = tmp_path / "dev.png"
    assert acc.main(["--logs", str(new), str(old), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    c_new, c_old = acc.curve_of_log(new), acc.curve_of_log(old)
    assert c_new == {"label": "rl_s0", "curve": [(0, 0.2), (20, 0.21), (40, 0.23)], "selected": 40, "null": False}
    assert c_old["curve"] == [(20, 0.21), (40, 0.23)] and c_old["null"] and c_old["selected"] is None
    assert "rl_s0: 0:0.2000 20:0.2100 40:0.2300; shipped step 40" in capsys.readouterr().out
    (tmp_path / "x.log").write_text("no rl here\n")
    assert acc.main(["--logs", str(tmp_path / "x.log"), "--plot", str(png)]) == 2


def test_the_rl_watchdog_stops_the_last_arm_when_the_slowest_eta_ends_past_the_deadline(tmp_path):
    """gpu_rl_acceptance.sh: rl does not resume, so an arm the call's end would cut is stopped early and the others
    finish. Fake rl arms (a stand-in for `python -m dormouse.cli rl`) print the stage's progress line with an eta of
    a step a second of 300 in a call of 40 s: the last arm is stopped and reported for the next call, the first runs to
    its end."""
    import os
    import re
    import subprocess
    import sys
    import time

    jobs = tmp_path / "jobs"
    for arm in ("a_s0", "a_s1"):
        (jobs / arm).mkdir(parents=True)
        for stage in ("rl", "export", "bench"):
            (jobs / arm / f"tiny_{stage}.json").write_text(json.dumps({"out": str(tmp_path / "store" / arm / stage)}))
    fake = tmp_path / "py"
    fake.write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m dormouse.cli" ]; then  # an rl arm: a progress line a second, then a clean end after 25 s
  for i in $(seq 10 34); do echo "[rl] step $i/300  reward 0.2  1.0 step/s  elapsed 0:00:$i  eta 0:10:00"; sleep 1; done
  exit 0
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    env = dict(os.environ, PY=str(fake), PRESET="tiny", ARMS="a_s0 a_s1", JOBS=str(jobs), OUT=str(tmp_path / "out"),
               LOGS=str(tmp_path / "logs"), MIN_RL_S="1", DIAG="0", CALL_S="40", WATCH_AFTER_S="3", ETA_MARGIN_S="0")
    t0 = time.time()
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_rl_acceptance.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"a_s1: rl stopped \(the slowest arm needs ~2[0-9]{2}s more, past this call's deadline\)", out), out
    assert "a_s1: rl ran out of this call's time; call again" in out and "a_s0: rl ran out" not in out
    assert "step 34/300" in (tmp_path / "logs" / "a_s0_rl.log").read_text()  # the first arm ran to its end
    assert time.time() - t0 < 39  # stopped, not cut by the call's timeout


def test_flips_per_cell_split_the_cells_rl_trains_from_those_it_skips(tmp_path):
    """--preset: each seed's held-out flips per cell in bench's item order (the preset's held-out items), and the
    paired z over trained and skipped cells; a bench of another preset's items is refused."""
    from collections import Counter

    cells, _ = acc.heldout_cells("tiny")
    assert len(cells) == 96 and cells[0] == "add@1"
    sft = ["0"] * len(cells)
    rl = list(sft)
    first = {c: [i for i, x in enumerate(cells) if x == c] for c in ("reverse@1", "count@2")}
    for i in first["reverse@1"][:5]:
        rl[i] = "1"  # a trained cell gains five
    for i in first["count@2"][:3]:
        sft[i] = "1"  # a skipped cell loses three
    b = bench(5, 3)
    b["stages"]["sft"]["tasks_gen"]["items_correct"], b["stages"]["rl"]["tasks_gen"]["items_correct"] = "".join(sft), "".join(rl)
    b["heldout_cells"] = dict(sorted(Counter(cells).items()))
    f = acc.cell_flips(b, cells, {"count@2"})
    assert f["cells"]["reverse@1"] == (5, 0) and f["cells"]["count@2"] == (0, 3) and f["cells"]["add@1"] == (0, 0)
    assert f["trained"] == {"gained": 5, "lost": 0, "z": round(5 / 5 ** 0.5, 3)}
    assert f["skipped"] == {"gained": 0, "lost": 3, "z": round(-3 / 3 ** 0.5, 3)}
    b["heldout_cells"] = {"add@1": 96}
    with pytest.raises(ValueError, match="not this bench's preset"):
        acc.cell_flips(b, cells, set())
