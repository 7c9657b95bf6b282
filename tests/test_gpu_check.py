"""benchmarks/gpu_check.py's checks on the CPU (the torch paths): the decode part passes on a sound model and fails
when the step-by-step decode loses its state; the lm-eval part reads the harness's results file."""

import json

import pytest
from model_util import live_model

import benchmarks.gpu_check as gpu_check
from dormouse.model.config import ModelConfig
from dormouse.data import chat

CFG = {"d_model": 32, "n_heads": 2, "head_dim": 16, "ffn_hidden": 64, "n_core": 2, "kda_chunk_size": 8}
PROMPTS = [chat.prompt_bytes(q) for q in ("12+30=", "sort: 3 1 2", "reverse: abc", "count a in banana")]


def model(**extra):
    return live_model(ModelConfig.from_dict({**CFG, **extra}), scale=0.3)


@pytest.mark.parametrize("extra", [{}, {"engram": True, "engram_rows": 64, "engram_dim": 8}])
def test_step_by_step_decode_agrees_with_the_parallel_forward(extra):
    r = gpu_check.decode_agreement(model(**extra), PROMPTS, 12)
    assert r["mismatched"] == 0 and r["bytes_checked"] + r["near_ties"] == 4 * 12
    assert r["bytes_checked"] >= 40  # near-ties are rare: the check is not vacuous


def test_a_decode_that_drops_its_state_fails_the_check(monkeypatch):
    """The gate fails when the code is wrong: a step that forgets the KDA state (what a bad cache hand-off does)."""
    m = model()
    step = m.step

    def forgetful(byte, state, counters=None):  # each byte decoded as if it began the sequence
        return step(byte, None, counters)

    monkeypatch.setattr(m, "step", forgetful)
    r = gpu_check.decode_agreement(m, PROMPTS, 12)
    assert r["mismatched"] > 0 and r["first_mismatch"] is not None


def test_lm_eval_result_reads_the_device_and_the_score(tmp_path, capsys):
    run = tmp_path / "out" / "model"
    run.mkdir(parents=True)
    (run / "results_2026.json").write_text(json.dumps({
        "results": {"dormouse_tiny": {"acc,none": 0.5, "acc_bytes,none": 0.25, "sample_len": 8}},
        "config": {"device": "cuda", "model_args": "pretrained=x,rung=int8"}}))
    assert gpu_check.lm_eval_result(tmp_path / "out", "cuda") == 0
    assert capsys.readouterr().out.startswith("lm-eval: PASS dormouse_tiny acc 0.5")
    assert gpu_check.lm_eval_result(tmp_path / "out", "cpu") == 1
    assert "ran on 'cuda'" in capsys.readouterr().out


def test_view_names_the_folder_the_chain_part_builds(workdir, monkeypatch, capsys):
    """gpu_check.sh's chain runs `snakemake <view>/bench.json --config set=...`: a set= run's own view folder."""
    from dormouse.planner.plan import override_tag

    monkeypatch.chdir(workdir)
    assert gpu_check.main(["view", "--set", "train.device=cuda"]) == 0
    assert capsys.readouterr().out == f"results/tiny@{override_tag({'set': 'train.device=cuda'})}\n"
