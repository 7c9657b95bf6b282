"""dormouse headline: what a run found, printed when Snakemake succeeds (Snakefile onsuccess)."""

import json
import os
import time

from dormouse.tools import headline


def bench(pretrain_bpb=3.2, rl_gain=(5, 1)):
    def stage(bpb, acc):
        return {"bpb": bpb, "tasks_gen": {"accuracy": acc}}
    return {"preset": "tiny", "eval_window": {"bytes": 32768},
            "anchors": {"ladder": [{"name": "unigram", "order": 1, "bpb": 4.9}, {"name": "kneser_ney", "order": 5,
                                                                                "bpb": 2.1426}]},
            "stages": {"pretrain": stage(pretrain_bpb, 0.0), "sft": stage(3.24, 0.083), "rl": stage(3.24, 0.125)},
            "paired": {"rl_vs_sft": {"gained": rl_gain[0], "lost": rl_gain[1], "z": 1.633}},
            "heldout_items": 96, "upstream": {"rl": {"final": {"selection": {"selected_step": 10}}}},
            "rungs": {"bf16": {"bpb": 3.2426}, "ternary": {"bpb": 4.0577}}}


def test_the_headline_says_bpb_against_the_best_anchor_accuracy_per_stage_and_where_to_look():
    lines = headline.headline(bench(), "results/tiny/bench.json")
    assert lines[0] == "[dormouse] results/tiny/bench.json (preset tiny):"
    assert "pretrain eval BPB 3.2000: 1.0574 above the best n-gram anchor (kneser_ney, order 5: 2.1426)" in lines[1]
    assert "pretrain 0.000, sft 0.083, rl 0.125; rl vs sft +5 -1 (z 1.633), rl shipped step 10" in lines[2]
    assert lines[3] == "  export rungs, BPB: bf16 3.2426, ternary 4.0577" and "dormouse serve --preset tiny" in lines[4]
    assert "1.1426 below the best" in headline.headline(bench(pretrain_bpb=1.0), "b")[1]


def test_since_names_only_the_runs_written_after_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for preset in ("tiny", "small"):
        (tmp_path / "results" / preset).mkdir(parents=True)
        (tmp_path / "results" / preset / "bench.json").write_text(json.dumps({**bench(), "preset": preset}))
    old = time.time() - 3600
    os.utime(tmp_path / "results" / "small" / "bench.json", (old, old))
    assert headline.main(["--since", str(time.time() - 60)]) == 0
    out = capsys.readouterr().out
    assert "(preset tiny)" in out and "(preset small)" not in out
    (tmp_path / "results" / "tiny" / "bench.json").write_text("{}")
    assert headline.main([]) == 2
    err = capsys.readouterr().err
    assert "results/tiny/bench.json: cannot read a bench.json" in err and "small" not in err  # the bad file only


def test_the_headline_says_the_eval_tails_share_and_every_upstream_warning():
    b = bench()
    b["upstream"]["shard"] = {"counters": {"bytes_in": 1_470_000, "eval_bytes": 146_000, "eval_docs": 19,
                                           "train_bytes": 1_324_000},
                              "warnings": ["the eval tail was capped at eval_tail_max_share=0.1 of the corpus: ..."]}
    lines = headline.headline(b, "results/tiny/bench.json")
    assert "  eval tail 146000 bytes (9.9% of the sharded text, 19 documents); 1324000 bytes train" in lines
    assert "  WARNING (shard): the eval tail was capped at eval_tail_max_share=0.1 of the corpus: ..." in lines
    assert not any("WARNING" in line for line in headline.headline(bench(), "b"))


def test_a_run_with_overrides_says_so_and_points_at_its_own_folder():
    b = {**bench(), "view": "tiny@35e08989", "overrides": {"set": "train.steps=50", "corpus": "/data/my corpus"}}
    lines = headline.headline(b, "results/tiny@35e08989/bench.json")
    assert lines[0] == ("[dormouse] results/tiny@35e08989/bench.json (preset tiny; overrides set=train.steps=50, "
                        "corpus=/data/my corpus):")
    assert lines[-1].startswith("  next: results/tiny@35e08989/plots/ (curves, rungs, tasks); dormouse serve --preset "
                                "tiny --set train.steps=50 --corpus '/data/my corpus';")
