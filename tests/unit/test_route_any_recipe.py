"""``areal.enable: true`` on verl's own recipe: routed as our recipes are, or refused naming both values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from areal_plugins.patches import route_areal_node
from hydra import compose, initialize_config_module

from areal_plugins.config.routing import route_composed_config
from areal_plugins.config.settings import ArealConfigError
from tests.user_recipe import user_recipe


def verl_config(*overrides: str):
    """verl's own ``ppo_trainer`` config, composed as ``main_ppo`` composes it (no areal config group)."""
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def test_plus_areal_enable_on_verls_recipe_routes_like_our_recipes():
    config = verl_config("+areal.enable=true")
    assert config.trainer.v1.trainer_mode == "sync"  # what verl would run without us
    changes = route_composed_config(config)
    # Hand-listed: what areal.enable with the default settings (async, decoupled, recompute, cap 5 mask) means.
    assert config.trainer.v1.trainer_mode == "areal_async"
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "areal_decoupled"
    assert config.actor_rollout_ref.rollout.calculate_log_probs is True
    assert config.algorithm.rollout_correction.rollout_is == "token"
    assert config.algorithm.rollout_correction.rollout_is_threshold == "1e-12_5.0"
    assert "trainer.v1.trainer_mode" in changes
    assert config.areal.max_staleness == 4 and config.areal.loss.decoupled is True  # the node completed


def test_a_recipe_key_that_contradicts_the_routing_is_refused_with_both_values():
    config = verl_config("+areal.enable=true", "trainer.v1.trainer_mode=colocate_async")
    with pytest.raises(ArealConfigError, match=r"trainer\.v1\.trainer_mode='colocate_async'.*'areal_async'"):
        route_composed_config(config)
    config = verl_config("+areal.enable=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    with pytest.raises(ArealConfigError, match=r"loss_mode='gspo'.*'areal_decoupled'"):
        route_composed_config(config)


def test_nothing_changes_without_an_enabled_areal_node():
    for overrides in ((), ("+areal.enable=false",)):
        config = verl_config(*overrides)
        assert route_composed_config(config) == {}
        assert config.trainer.v1.trainer_mode == "sync"


def test_settings_that_turn_a_routed_key_off_leave_the_recipes_value():
    # loss.decoupled=false: the loss is not routed, so the recipe's own choice stands (standard PPO ablation).
    config = verl_config(
        "+areal.enable=true", "+areal.loss.decoupled=false", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"
    )
    route_composed_config(config)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    assert config.algorithm.rollout_correction.bypass_mode is True


# ------------------------------------------------------------------ the patch: four tests


@pytest.fixture
def unpatched():
    was_applied = route_areal_node.is_applied()
    route_areal_node.revert()
    yield
    route_areal_node.revert()
    if was_applied:
        route_areal_node.apply()


def test_applied_verls_validate_config_routes_a_users_recipe(unpatched, tmp_path, monkeypatch):
    import shutil

    from hydra import initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    import areal_plugins.verl_plugin  # noqa: F401  (the resolvers the CPU body uses)

    monkeypatch.setenv("AREAL_TINY_DIR", str(tmp_path))
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    shutil.copy(Path(__file__).resolve().parents[2] / "recipes" / "_cpu_grpo_tiny.yaml", recipes)
    (recipes / "mine.yaml").write_text(user_recipe())
    with initialize_config_dir(config_dir=str(recipes), version_base=None):
        config = compose(config_name="mine")
    OmegaConf.resolve(config)
    assert config.trainer.v1.trainer_mode == "sync"  # as composed: verl would run its own trainer
    route_areal_node.apply()
    import verl.utils.config as verl_config_module

    verl_config_module.validate_config(config, need_reference_policy(config), need_critic(config))
    assert config.trainer.v1.trainer_mode == "areal_async"
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "areal_decoupled"


def test_apply_is_idempotent_and_revert_restores_the_same_object(unpatched):
    import verl.utils.config as verl_config_module

    original = verl_config_module.validate_config
    route_areal_node.apply()
    first = verl_config_module.validate_config
    route_areal_node.apply()
    assert verl_config_module.validate_config is first is not original
    route_areal_node.revert()
    assert verl_config_module.validate_config is original and not route_areal_node.is_applied()


def test_refused_on_unsupported_verl(unpatched):
    from areal_plugins._compat import UnsupportedVerlVersionError

    with pytest.raises(UnsupportedVerlVersionError, match=r"verl 0\.10\.0 is installed"):
        route_areal_node.apply(verl_version="0.10.0")
    assert not route_areal_node.is_applied()


def test_enabled_only_in_verls_main_ppo_driver(monkeypatch):
    from areal_plugins import patches

    monkeypatch.setenv("VERL_PLATFORM", "cuda")
    monkeypatch.setattr(sys, "orig_argv", ["python", "x.py"])
    monkeypatch.setattr(sys, "argv", ["/x/verl/trainer/main_ppo.py", "+areal.enable=true"])
    assert patches.enabled_patches(None) == [route_areal_node]
    # python -m verl.trainer.main_ppo: verl loads its plugins while argv[0] is still "-m".
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "verl.trainer.main_ppo", "+areal.enable=true"])
    monkeypatch.setattr(sys, "argv", ["-m", "+areal.enable=true"])
    assert patches.enabled_patches(None) == [route_areal_node]
    monkeypatch.setattr(sys, "orig_argv", ["python", "/x/default_worker.py"])
    monkeypatch.setattr(sys, "argv", ["/x/default_worker.py"])
    assert patches.enabled_patches(None) == []
