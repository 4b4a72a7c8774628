from __future__ import annotations

import pytest

from areal_plugins.settings import ArealConfig, ArealConfigError, verl_setting


def test_defaults_are_off():
    config = ArealConfig.from_dict(None)
    assert config.enable is False and config.loss.behav_imp_weight_cap == 5.0


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
