import pytest
import yaml

from dormouse.config import ConfigError, load_preset
from dormouse.plan import build_plan


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
