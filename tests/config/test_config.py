import dataclasses

import pytest
import yaml

from jgrpo.config import Config, ConfigError
from jgrpo.config.loading import load_config, save_config
from tests.helpers import ROOT


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_valid():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.grpo.behaviour_refresh == 1 and cfg.grpo.off_policy_ratio == "behaviour"


def test_yaml_then_overrides_with_coercion(tmp_path):
    p = write(tmp_path, "grpo:\n  beta: 0.1\n  num_generations: 4\nsampler:\n  temperature: 1.0\n")
    cfg = load_config(p, ["grpo.beta=0.0", "sampler.temperature=0.7", "sampler.stop_token_ids=[2,5]",
                          "grpo.dual_clip=3", "grpo.mask_zero_variance=false", "reward.functions=a,b",
                          "reward.weights=[1, 0.5]"])
    assert cfg.grpo.beta == 0.0 and isinstance(cfg.grpo.beta, float)
    assert cfg.grpo.num_generations == 4
    assert cfg.sampler.temperature == 0.7
    assert cfg.sampler.stop_token_ids == (2, 5)
    assert cfg.grpo.dual_clip == 3.0 and isinstance(cfg.grpo.dual_clip, float)
    assert cfg.grpo.mask_zero_variance is False
    assert cfg.reward.functions == ("a", "b") and cfg.reward.weights == (1.0, 0.5)
    # int field given an integral float from YAML is accepted, None for optional fields too
    cfg = load_config(None, ["run.iterations=10.0", "grpo.dual_clip=None"])
    assert cfg.run.iterations == 10 and cfg.grpo.dual_clip is None


def test_unknown_key_names_full_path_and_suggestions(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo\.betta'.*did you mean beta"):
        load_config(None, ["grpo.betta=0.1"])
    p = write(tmp_path, "sampler:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"'sampler\.temprature'.*temperature"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"unknown config key 'grop'.*grpo"):
        load_config(None, ["grop.beta=1"])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("grpo.off_policy_ratio=sideways",
         r"grpo\.off_policy_ratio='sideways'.*one of 'behaviour', 'recentred', 'current'"),
        ("grpo.beta=-1", r"grpo\.beta=-1\.0.*>= 0"),
        ("grpo.num_generations=abc", r"grpo\.num_generations='abc'.*integer"),
        ("grpo.num_generations=1", r"grpo\.num_generations=1.*>= 2"),
        ("sampler.top_p=0", r"sampler\.top_p=0\.0.*\(0, 1\]"),
        ("grpo.mask_zero_variance=maybe", r"grpo\.mask_zero_variance='maybe'.*boolean"),
        ("grpo.dual_clip=0.5", r"grpo\.dual_clip=0\.5.*None or > 1"),
        ("mesh.fsdp=0", r"mesh\.fsdp=0.*positive integer or -1"),
        ("reward.weights=[1,2]", r"reward\.weights=.*one weight per function"),
        ("data.arithmetic_operators=/", r"data\.arithmetic_operators='/'"),
        ("run.iterations=2.5", r"run\.iterations=2\.5.*integer"),
        ("run.eval_samples=0 run.eval_k=[4]",
         r"run\.eval_k=\[4\].*needs run\.eval_samples >= 4 \(none are drawn: run\.eval_samples=0; "
         r"jgrpo\.eval: --samples"),
        ("run.eval_samples=2 run.eval_k=[1,4]", r"run\.eval_k=\[1, 4\].*values in 1\.\.run\.eval_samples=2"),
    ],
)
def test_bad_values_name_field_value_and_allowed(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, override.split())


def test_malformed_inputs(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="the file is a list; a config file must be a mapping of sections"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"c\.yaml: line 3, column 5: invalid YAML: expected ',' or ']', but "
                                          r"got ':' \(while parsing a flow sequence that starts at line 2, column 9\)"):
        load_config(write(tmp_path, "model:\n  name: [tiny\ngrpo:\n  beta: 0.1\n"))
    with pytest.raises(ConfigError, match="the file is a single int value"):
        load_config(write(tmp_path, "3\n"))
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["grpo.beta"])
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write(tmp_path, "grpo: 3\n"))
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        load_config(None, ["mesh.data=-1", "mesh.fsdp=-1"])


def test_save_round_trip(tmp_path):
    cfg = load_config(None, ["grpo.beta=0.0", "sampler.stop_token_ids=[7]", "run.output_dir=" + str(tmp_path)])
    path = save_config(cfg, tmp_path / "run")
    assert yaml.safe_load(path.read_text())["grpo"]["beta"] == 0.0
    assert load_config(path) == cfg


def test_shipped_configs_load():

    files = sorted(ROOT.joinpath("configs").glob("*.yaml"))
    assert files, "configs/ has no YAML files"
    for f in files:
        load_config(f)


def test_configuration_page_lists_every_field_as_the_source_says():
    """docs/configuration.md's field reference is `python -m jgrpo.config.docs`'s output: regenerate it."""
    from jgrpo.config.docs import PAGE, page_with_fields

    page = PAGE.read_text()
    assert page == page_with_fields(page), "docs/configuration.md is stale: run python -m jgrpo.config.docs"
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(section.default_factory):
            if dataclasses.is_dataclass(field.default):  # a nested section (model.lora) lists its own fields
                for sub in dataclasses.fields(field.default):
                    assert f"`{section.name}.{field.name}.{sub.name}`" in page
            else:
                assert f"`{section.name}.{field.name}`" in page
