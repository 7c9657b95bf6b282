"""dormouse.tools.plots on a synthetic bench.json and store laid out as the bench and training stages write them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from dormouse.tools import plots
from dormouse.core.store import MANIFEST, sha256_file

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DIGESTS = {"pretrain": "6035b0c5fa62c26f8349", "sft": "a1b2c3d4e5f60718293a", "rl": "0f1e2d3c4b5a69788796"}


def pretrain_rows(steps: int = 200, log_every: int = 10, eval_every: int = 50) -> list[dict]:
    rows = []
    for done in range(log_every, steps + 1, log_every):
        bpb = 2.1 + 5.9 * math.exp(-done / 40)
        row = {"step": done, "loss": round(bpb * math.log(2), 5), "bpb": round(bpb, 5), "lr": 3e-3,
               "tokens_per_s": 41234.5, "epochs": round(done / 900, 4)}
        if done % eval_every == 0:
            row.update(eval_bpb=round(bpb + 0.15, 5), eval_bytes=65536)
        rows.append(row)
    return rows


def sft_rows(steps: int = 60) -> list[dict]:
    return [{"step": s, "loss": round((1.9 + 2 * math.exp(-s / 15)) * math.log(2), 5),
             "bpb": round(1.9 + 2 * math.exp(-s / 15), 5), "lr": 1e-3, "elapsed_s": round(0.4 * s, 2)}
            for s in range(5, steps + 1, 5)]


def rl_rows(steps: int = 40) -> list[dict]:
    return [{"step": s, "reward": round(min(0.9, 0.1 + 0.02 * s), 4), "loss": round(0.05 - 0.001 * s, 5),
             "malformed": max(0, 8 - s // 5), "levels": {"add": 1 + s // 20, "copy": 2}, "elapsed_s": round(2.5 * s, 2)}
            for s in range(1, steps + 1)]


def write_artifact(store: Path, stage: str, rows: list[dict]) -> Path:
    d = store / stage / DIGESTS[stage]
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = {"metrics.jsonl": {"sha256": sha256_file(d / "metrics.jsonl"), "size": (d / "metrics.jsonl").stat().st_size}}
    (d / MANIFEST).write_text(json.dumps({"stage": stage, "digest": DIGESTS[stage], "files": files}))
    return d


def scores(bpb: float, gen: float, mc_acc: float | None, cloze: float | None) -> dict:
    mc = {"acc": mc_acc, "acc_bytes": None if mc_acc is None else round(mc_acc + 0.03, 4),
          "n_scored": 0 if mc_acc is None else 120, "n_dropped_too_long": 0 if mc_acc is not None else 120}
    return {"bpb": bpb, "eval_bytes": 65536, "tasks_mc": mc,
            "tasks_gen": {"accuracy": gen, "n": 120, "correct": round(gen * 120), "malformed": 3,
                          "by_cell": {"add@1": gen, "copy@2": gen}},
            "cloze": {"acc": cloze, "acc_bytes": cloze, "n_scored": 64, "n_dropped_too_long": 0}}


def ladder() -> list[dict]:
    out = [{"name": "uniform", "order": 0, "bits": 8.0 * 2055784, "bytes": 2055784, "bpb": 8.0},
           {"name": "unigram", "order": 1, "bits": 4.8128 * 2055784, "bytes": 2055784, "bpb": 4.8128}]
    for order, (bo, kn) in enumerate([(3.8916, 3.8909), (3.0498, 3.0320), (2.5026, 2.4274), (2.2871, 2.1203)], 2):
        out += [{"name": "backoff", "order": order, "bits": bo * 2055784, "bytes": 2055784, "bpb": bo},
                {"name": "kneser_ney", "order": order, "bits": kn * 2055784, "bytes": 2055784, "bpb": kn}]
    return out


def make_bench(tmp_path: Path, with_bf16: bool = True, null_accs: bool = False) -> Path:
    sizes = {"bf16": 9_437_184, "int8": 4_849_664, "fp8": 4_849_664, "mxfp4": 2_621_440, "nvfp4": 2_752_512,
             "ternary": 1_441_792}
    bpbs = {"bf16": 2.2531, "int8": 2.2539, "fp8": 2.2612, "mxfp4": 2.3405, "nvfp4": 2.3317, "ternary": 3.1022}
    rungs = {}
    for r, size in sizes.items():
        if r == "bf16" and not with_bf16:
            continue
        delta = round(bpbs[r] - bpbs["bf16"], 5) if with_bf16 else None
        rungs[r] = {"bytes": size, "delta_bpb_vs_bf16": delta,
                    **scores(bpbs[r], 0.41, None if null_accs else 0.52, None if null_accs else 0.38)}
    acc = (lambda v: None if null_accs else v)
    bench = {
        "preset": "tiny", "format": 4, "eval_window": {"bytes": 65536, "seq_len": 512},
        "anchors": {"preset": "tiny", "ladder": ladder()},
        "stages": {"pretrain": scores(2.25, 0.02, acc(0.31), acc(0.36)),
                   "sft": scores(2.31, 0.35, acc(0.47), acc(0.35)),
                   "rl": scores(2.33, 0.42, acc(0.53), 0.37)},
        "rungs": rungs, "rungs_of": "rl", "reference_bpb_fp32": 2.2528,
        "suites": {"tasks_mc": {"items": 120}, "cloze": {"items": 64}}, "heldout_items": 120,
        "upstream": {s: {"digest": DIGESTS.get(s, "ffffffffffffffffffff"), "counters": {}, "wall_time_s": 12.0}
                     for s in ("pretrain", "sft", "rl", "export", "anchors", "shard")},
        "digest_chain": [], "retractions_applied": [], "environment": {"versions": {}},
        "code": {"git_commit": "575c4d5"}, "bench_counters": {}, "bench_wall_time_s": 30.0,
    }
    store = tmp_path / "store"
    write_artifact(store, "pretrain", pretrain_rows())
    write_artifact(store, "sft", sft_rows())
    write_artifact(store, "rl", rl_rows())
    path = tmp_path / "results" / "tiny" / "bench.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(bench, indent=1) + "\n")
    return path


def run_main(tmp_path: Path, bench: Path) -> Path:
    out = tmp_path / "results" / "tiny" / "plots"
    assert plots.main(["--bench", str(bench), "--store", str(tmp_path / "store"), "--out-dir", str(out)]) == 0
    return out


def assert_three_pngs(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "rungs.png", "tasks.png"]
    for p in out.iterdir():
        assert p.read_bytes()[:8] == PNG_MAGIC, p
        assert p.stat().st_size > 10_000, (p, p.stat().st_size)


def test_main_writes_three_pngs(tmp_path):
    assert_three_pngs(run_main(tmp_path, make_bench(tmp_path)))


def test_null_accs_and_no_bf16_do_not_crash(tmp_path):
    assert_three_pngs(run_main(tmp_path, make_bench(tmp_path, with_bf16=False, null_accs=True)))


def test_missing_artifact_dir_is_named(tmp_path):
    bench = make_bench(tmp_path)
    missing = tmp_path / "store" / "sft" / DIGESTS["sft"]
    for f in missing.iterdir():
        f.unlink()
    missing.rmdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        plots.load_inputs(bench, tmp_path / "store")
    with pytest.raises(SystemExit, match=re.escape(str(missing))):
        plots.main(["--bench", str(bench), "--store", str(tmp_path / "store"), "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_malformed_metrics_line_is_named(tmp_path):
    make_bench(tmp_path)
    path = tmp_path / "store" / "rl" / DIGESTS["rl"] / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.1}\n\n{"step": 2, "rew\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:3")):
        plots.read_metrics(path)


def test_best_anchors_keeps_unigram_and_highest_orders():
    picked = [(a["name"], a["order"]) for a in plots.best_anchors(ladder())]
    assert picked == [("unigram", 1), ("backoff", 5), ("kneser_ney", 5)]


def test_the_anchors_just_above_and_below_the_model_are_found():
    from dormouse.tools.plots import best_anchors, neighbour_anchors

    ladder = [{"name": "uniform", "order": 0, "bpb": 8.0}, {"name": "unigram", "order": 1, "bpb": 4.9},
              {"name": "kneser_ney", "order": 2, "bpb": 4.04}, {"name": "kneser_ney", "order": 3, "bpb": 3.17},
              {"name": "backoff", "order": 3, "bpb": 3.19}, {"name": "kneser_ney", "order": 5, "bpb": 2.14}]
    picked = neighbour_anchors(ladder, 3.24, best_anchors(ladder))
    # backoff-3 is already drawn (the best backoff): the neighbours come from the rest of the ladder
    assert [(a["name"], a["order"]) for a in picked] == [("kneser_ney", 2), ("kneser_ney", 3)]
    assert neighbour_anchors(ladder, 1.0, best_anchors(ladder)) == [ladder[3]]  # below every rung: none under it
    assert neighbour_anchors(ladder, None, []) == []


def test_a_qat_chain_plots_its_rungs_beside_its_ptq_twin(tmp_path):
    """bench.json of a QAT chain (rungs with their method, rungs_ptq, the qat lineage) and a pretrain whose last evals
    ran through the rung: both rung series as BPB, the trained rung marked, and the three figures drawn."""
    path = make_bench(tmp_path)
    bench = json.loads(path.read_text())
    twin = json.loads(json.dumps(bench["rungs"]))
    for r, v in bench["rungs"].items():
        v["method"] = "qat" if r == "ternary" else "ptq"
    bench["rungs"]["ternary"]["bpb"] = 2.41
    bench["rungs_ptq"], bench["qat"] = twin, [{"stage": "pretrain", "rung": "ternary", "steps": 40, "tensors": 12}]
    path.write_text(json.dumps(bench))
    key, chains = plots.rung_series(bench)
    assert key == "bpb" and [label for label, _ in chains] == ["QAT chain (pretrain ternary)", "PTQ twin (the preset with qat off)"]
    assert [(r, y, trained) for r, _, y, trained in chains[0][1]][-1] == ("ternary", 2.41, True)
    assert [(r, y, trained) for r, _, y, trained in chains[1][1]][-1] == ("ternary", 3.1022, False)
    assert plots.rung_series(make_bench_dict(tmp_path))[0] == "delta_bpb_vs_bf16"  # no twin: as before
    rows = pretrain_rows()
    for row in rows[-5:]:
        if "eval_bpb" in row:
            row["eval_rung"] = "ternary"
    pre = tmp_path / "store" / "pretrain" / DIGESTS["pretrain"]
    for f in pre.iterdir():
        f.unlink()
    pre.rmdir()
    write_artifact(tmp_path / "store", "pretrain", rows)
    assert_three_pngs(run_main(tmp_path, path))


def make_bench_dict(tmp_path: Path) -> dict:
    sub = tmp_path / "plain"
    sub.mkdir()
    return json.loads(make_bench(sub).read_text())
