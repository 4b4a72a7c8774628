"""Every shipped recipe composes with verl's config and passes verl's own validation."""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_composes_and_validates(recipe, monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    import areal_plugins.verl_plugin  # noqa: F401  (registers the resolvers the recipes use)

    monkeypatch.setenv("AREAL_TINY_DIR", str(tmp_path))
    header = recipe.read_text().splitlines()[:12]
    assert any("Launch:" in line for line in header), "recipes open with a comment header giving the launch command"
    with initialize_config_dir(config_dir=str(recipe.parent), version_base=None):
        config = compose(config_name=recipe.stem)
    OmegaConf.resolve(config)
    assert config.actor_rollout_ref.rollout.name == "areal_cpu"
    assert Path(config.reward.custom_reward_function.path).exists()
    assert "areal" in config and isinstance(config.areal.enable, bool)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
