from pathlib import Path

import pytest
import yaml

from dormouse.core.config import ConfigError, load_preset
from dormouse.planner.plan import build_plan


def test_presets_validate_and_fill_defaults(workdir):
    p = load_preset("tiny", workdir)
    assert p["data"]["filter"]["heuristics"]["gopher_repetition"]["max_dup_line_frac"] == 0.3
    assert p["data"]["filter"]["quality"]["train"]["word_ngrams"] == 2


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda p: p["data"]["shard"].update(num_shardz=3), "num_shardz"),
        (lambda p: p["data"]["shard"].update(num_shards="four"), "data.shard.num_shards"),
        (lambda p: p["anchors"].update(max_order=1), "anchors.max_order"),
        (lambda p: p["data"]["reader"].update(on_bad_file="ignore"), "data.reader.on_bad_file"),
    ],
)
def test_bad_key_or_value_names_it(workdir, edit, needle):
    path = workdir / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(path.read_text())
    edit(preset)
    path.write_text(yaml.safe_dump(preset))
    with pytest.raises(ConfigError) as e:
        load_preset("tiny", workdir)
    assert "tiny.yaml" in str(e.value) and needle in str(e.value)


def test_bad_top_level_config_names_it(workdir):
    with pytest.raises(ConfigError, match="corpuss"):
        build_plan({"preset": "tiny", "presets": ["tiny"], "corpus": "x", "corpuss": "y"}, workdir)


def test_sft_and_rl_carry_the_moe_balancing_coefficient_only_for_an_moe(workdir):
    """An MoE keeps pretrain's balancing loss in sft and rl; a dense model's sft and rl params (digests) do not
    change for it."""
    from dormouse.planner.registry import stage_params

    dense = load_preset("tiny", workdir)
    moe = load_preset("b1", workdir)
    assert moe["model"]["moe"] and not dense["model"].get("moe")
    for stage in ("sft", "rl"):
        assert "moe_aux_coef" not in stage_params(stage, dense)
        assert stage_params(stage, moe)["moe_aux_coef"] == moe["train"]["moe_aux_coef"]
    assert "moe_aux_coef" not in stage_params("export", moe)


def test_the_balancing_term_is_added_for_an_moe_and_refused_without_its_coefficient():
    import torch

    from dormouse.model.config import ModelConfig
    from dormouse.train.runtime import with_moe_aux

    class Model:
        aux_loss = torch.tensor(2.0)

    loss = torch.tensor(1.0)
    assert with_moe_aux(loss, Model(), ModelConfig(), None) is loss  # dense: untouched
    assert with_moe_aux(loss, Model(), ModelConfig(moe=True), 0.01).item() == pytest.approx(1.02)
    with pytest.raises(SystemExit, match="moe_aux_coef"):
        with_moe_aux(loss, Model(), ModelConfig(moe=True), None)


def test_set_overrides_preset_keys_from_the_command_line(workdir):
    """config `set` (snakemake --config set='...'): dotted keys, YAML values, validated like a preset edit; they
    move the digests of exactly the stages whose params they touch."""
    base = {"preset": "tiny", "presets": ["tiny"], "corpus": "corpus/demo/data"}
    plain = build_plan(base, workdir).chain["tiny"]
    steps = build_plan({**base, "set": "train.steps=7, tasks.families=[add, sort]"}, workdir)
    assert steps.presets["tiny"]["train"]["steps"] == 7 and steps.presets["tiny"]["tasks"]["families"] == ["add", "sort"]
    moved = steps.chain["tiny"]
    assert [s for s in plain if plain[s] != moved[s]] == ["pretrain", "sft", "rl", "export", "bench"]
    reader = build_plan({**base, "set": "data.reader.on_bad_record=skip"}, workdir).chain["tiny"]
    assert reader["filter"] != plain["filter"]
    for bad, needle in (("train.stepz=3", "stepz"), ("train.steps=many", "train.steps"), ("train", "key=value"),
                        ("train.steps.x=1", "train.steps is a int")):
        with pytest.raises(ConfigError, match=needle):
            build_plan({**base, "set": bad}, workdir)


def test_dormouse_plan_set_gives_the_job_snakemake_would_run_with_that_set(workdir, monkeypatch, capsys):
    """`dormouse plan --set rl.seed=1` (a second rl seed from the same sft, issue #23's acceptance): the job moves
    rl only, and its digest is the one `--config set=rl.seed=1` plans."""
    import json

    from dormouse.core.config import load_yaml
    from dormouse.planner.plan_cli import main as plan_main

    monkeypatch.chdir(workdir)
    jobs = {}
    for extra in ([], ["--set", "rl.seed=1"]):
        assert plan_main(["--preset", "tiny", "--stage", "rl", *extra]) == 0
        jobs[bool(extra)] = json.loads(capsys.readouterr().out)
    assert jobs[True]["params"]["rl"]["seed"] == 1 and jobs[True]["inputs"] == jobs[False]["inputs"]  # the same sft
    config = load_yaml(workdir / "config" / "config.yaml")
    assert jobs[True]["digest"] == build_plan({**config, "set": "rl.seed=1"}, workdir).chain["tiny"]["rl"] != jobs[False]["digest"]


def test_a_users_corpus_plans_to_snakemakes_digests_from_any_folder(workdir, monkeypatch):
    """A corpus of the user's own (fingerprinted by its files' paths, sizes and mtimes, not a recipe as the demo is):
    `dormouse plan` run from a subfolder (root found and absolute) gives the digests Snakemake's plan (root ".")
    gives. Before the fix the absolute file paths entered the fingerprint: every CLI digest of such a corpus
    differed from the artifacts Snakemake built (found on the b1 scale shard, session 17)."""
    from dormouse.core.config import load_yaml
    from dormouse.planner.plan import load_plan

    (workdir / "mine").mkdir()
    (workdir / "mine" / "a.jsonl").write_text('{"text": "one document"}\n')
    (workdir / "sub").mkdir()
    config = {**load_yaml(workdir / "config" / "config.yaml"), "corpus": "mine"}
    monkeypatch.chdir(workdir)
    snakemake_view = build_plan(config, Path(".")).chain["tiny"]
    monkeypatch.chdir(workdir / "sub")
    cli_view = load_plan(None, corpus="../mine").chain["tiny"]
    assert cli_view["filter"] == snakemake_view["filter"] and cli_view == snakemake_view
