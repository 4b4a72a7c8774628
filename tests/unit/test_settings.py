from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_plugins.config.routing import verl_setting
from areal_plugins.config.settings import ArealConfig, ArealConfigError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_off():
    config = ArealConfig.from_dict(None)
    assert config.enable is False and config.loss.behav_imp_weight_cap == 5.0
    assert config.weight_update.in_flight == "interrupt"  # the paper's interruptible generation


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ArealConfigError, match=r"unknown setting areal\.loss\.behav_imp_weigth_cap; did you mean "):
        ArealConfig.from_dict({"loss": {"behav_imp_weigth_cap": 3}})
    with pytest.raises(ArealConfigError, match=r"unknown setting areal\.enabled; did you mean areal\.enable\?"):
        ArealConfig.from_dict({"enabled": True})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"enable": "yes"}, r"areal\.enable must be true or false"),
        ({"mode": "fast"}, r"areal\.mode must be one of"),
        ({"loss": {"behav_imp_weight_cap": 1.0}}, r"areal\.loss\.behav_imp_weight_cap must be > 1"),
        ({"loss": {"behav_imp_weight_mode": "clip"}}, r"areal\.loss\.behav_imp_weight_mode must be one of"),
        ({"loss": 5}, r"areal\.loss must be a mapping"),
        ({"placement": "separate", "max_rollout_replicas": 0}, r"areal\.max_rollout_replicas must be a replica count"),
        ({"max_rollout_replicas": 4}, r"grows the standalone replicas of areal\.placement: separate"),
        ({"replica_start_timeout_s": 0}, r"areal\.replica_start_timeout_s must be seconds > 0 or null"),
        ({"replica_start_timeout_s": "10m"}, r"areal\.replica_start_timeout_s must be seconds > 0 or null"),
        ({"weight_update": {"in_flight": "abort"}}, r"areal\.weight_update\.in_flight must be one of"),
    ],
)
def test_bad_values_name_the_yaml_path(values, message):
    with pytest.raises(ArealConfigError, match=message):
        ArealConfig.from_dict(values)


def test_every_routed_setting_is_verl_default_when_disabled():
    off = ArealConfig.from_dict({"enable": False, "loss": {"decoupled": False}})
    assert [verl_setting(n, off) for n in ("trainer_mode", "loss_mode", "rollout_is", "bypass_mode")] == [
        "sync",
        "vanilla",
        None,
        False,
    ]
    on = ArealConfig.from_dict({"enable": True, "mode": "sync"})
    assert verl_setting("trainer_mode", on) == "areal_sync"
    with pytest.raises(ArealConfigError, match="no setting"):
        verl_setting("nope", off)


def test_plugin_selection_must_be_a_list_of_names():
    with pytest.raises(ArealConfigError, match=r"areal\.plugins\.include must be a list of plugin names"):
        ArealConfig.from_dict({"plugins": {"include": "my_plugin"}})  # would load m, y, _, ...
    with pytest.raises(ArealConfigError, match=r"areal\.plugins\.exclude must be a list"):
        ArealConfig.from_dict({"plugins": {"exclude": [1]}})
    assert ArealConfig.from_dict({"plugins": {"include": ["a"]}}).plugins.include == ["a"]


def test_shipped_config_group_is_generated_from_the_dataclasses():
    from tests.unit.tool_scripts import load_tool

    shipped = (REPO / "areal_plugins" / "config" / "areal" / "default.yaml").read_text()
    assert shipped == load_tool("gen_default_config").render(), "run: python tools/gen_default_config.py"


def test_shipped_defaults_are_the_paper_defaults():
    # The paper's values (docs/design.md, The decoupled objective), written by hand; read from the shipped YAML.
    node = yaml.safe_load((REPO / "areal_plugins" / "config" / "areal" / "default.yaml").read_text())["areal"]
    assert node["enable"] is False and node["max_staleness"] == 4 and node["on_stale"] == "wait"
    assert node["loss"] == {
        "decoupled": True,
        "behav_imp_weight_cap": 5.0,
        "behav_imp_weight_mode": "mask",
        "prox_logp": "recompute",
    }
    assert ArealConfig.from_dict(node) == ArealConfig()


def test_choices_match_the_core_that_enforces_them():
    from areal_plugins.config import settings
    from areal_plugins.core import buffer, losses

    assert settings.ON_STALE == buffer.ON_STALE and settings.WEIGHT_MODES == losses.WEIGHT_MODES
