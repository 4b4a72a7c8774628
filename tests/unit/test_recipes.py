"""Every shipped recipe composes with verl's config, passes verl's validation, and routes as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_plugins.config.routing import EPISODE_MANAGER_CLASS

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(p for p in RECIPE_DIR.glob("*.yaml") if not p.name.startswith("_"))


def compose(name: str, overrides: list[str] | None = None):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    import areal_plugins.verl_plugin  # noqa: F401  (registers the resolvers the recipes use)

    with initialize_config_dir(config_dir=str(RECIPE_DIR), version_base=None):
        config = hydra_compose(config_name=name, overrides=overrides or [])
    OmegaConf.resolve(config)
    return config


@pytest.fixture(autouse=True)
def tiny_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_TINY_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_TINY_CALCULATOR_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_TINY_VISION_DIR", str(tmp_path))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_composes_and_validates(recipe):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    header = recipe.read_text().splitlines()[:14]
    for label in ("Trains:", "verl:", "Launch:", "Override example:"):
        assert any(label in line for line in header), f"{recipe.name}: the comment header lacks {label!r}"
    config = compose(recipe.stem)
    assert config.actor_rollout_ref.rollout.name == ("vllm" if "vllm" in recipe.stem else "areal_cpu")
    assert Path(config.reward.custom_reward_function.path).exists()
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def test_disabled_routes_verl_defaults():
    config = compose("grpo_cpu_sync")
    assert config.areal.enable is False
    assert config.trainer.v1.trainer_mode == "sync"
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    assert config.algorithm.rollout_correction.rollout_is is None
    assert config.algorithm.rollout_correction.rollout_is_threshold == 2.0
    assert config.algorithm.rollout_correction.bypass_mode is False


def test_one_flag_turns_the_decoupled_objective_on():
    config = compose("grpo_cpu_async")
    assert config.areal.enable is True
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "areal_decoupled"
    assert config.algorithm.rollout_correction.rollout_is == "token"
    assert config.algorithm.rollout_correction.rollout_is_threshold == "1e-12_5.0"  # cap 5, mask (paper)
    assert config.trainer.v1.trainer_mode == "areal_async"


def test_ablation_uses_the_behaviour_policy_as_old_policy():
    config = compose("grpo_cpu_async", ["areal.loss.decoupled=false"])
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    assert config.algorithm.rollout_correction.bypass_mode is True


def test_the_multi_turn_recipe_runs_verls_tool_loop_through_our_episode_workers():
    config = compose("grpo_cpu_async_calculator")
    assert config.actor_rollout_ref.rollout.agent.agent_loop_manager_class == EPISODE_MANAGER_CLASS
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"
    assert Path(config.actor_rollout_ref.rollout.multi_turn.function_tool_path).exists()
    assert config.actor_rollout_ref.rollout.multi_turn.format == "areal_calc"


def test_a_recipe_replacing_the_episode_workers_is_refused_at_startup():
    from areal_plugins.builtin.validation import areal_validate_config
    from areal_plugins.config.settings import ArealConfigError

    areal_validate_config(config=compose("grpo_cpu_async"))  # as shipped: accepted
    verls_own = "actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl.trainer.ppo.v1.AgentLoopManagerTQ"
    with pytest.raises(ArealConfigError, match="does not extend it"):
        areal_validate_config(config=compose("grpo_cpu_async", [verls_own]))
    with pytest.raises(ArealConfigError, match="cannot be imported"):
        areal_validate_config(config=compose("grpo_cpu_async", [verls_own.replace("AgentLoopManagerTQ", "Nope")]))


def test_bad_setting_names_the_yaml_path():
    from omegaconf.errors import InterpolationResolutionError

    with pytest.raises(InterpolationResolutionError, match=r"areal\.mode must be one of"):
        compose("grpo_cpu_async", ["areal.mode=asynch"])


def test_disabled_is_byte_for_byte_verl(tmp_path):
    """``areal.enable: false``: the composed config equals the same recipe without our config group."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls
    from verl.workers.config.rollout import AgentLoopConfig

    (tmp_path / "plain.yaml").write_text(
        "hydra:\n  searchpath:\n    - pkg://verl.trainer.config\n"
        f"    - file://{RECIPE_DIR}\n"
        "defaults:\n  - ppo_trainer\n  - _cpu_grpo_tiny\n  - _self_\n"
        "trainer:\n  experiment_name: grpo_cpu_sync\n"
        "actor_rollout_ref:\n  actor:\n    strategy: fsdp2\n  ref:\n    strategy: fsdp2\n"  # as grpo_cpu_sync sets
        # the shared body hands these to the reward worker (reward_kwargs)
        "areal:\n  enable: false\n  reward: {}\n  plugins:\n    include: null\n    exclude: []\n"
    )
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        plain = hydra_compose(config_name="plain")
    OmegaConf.resolve(plain)
    ours = OmegaConf.to_container(compose("grpo_cpu_sync"))
    assert ours.pop("areal")["enable"] is False
    # One key verl's YAML leaves to its dataclass default; we route it, disabled = that very default.
    routed = ours["actor_rollout_ref"]["actor"]["policy_loss"].pop("rollout_correction")
    assert routed == {"rollout_is_threshold": RolloutCorrectionConfig().rollout_is_threshold}
    manager = ours["actor_rollout_ref"]["rollout"]["agent"].pop("agent_loop_manager_class")
    assert manager is None is AgentLoopConfig().agent_loop_manager_class  # likewise: verl's own manager
    plain_dict = OmegaConf.to_container(plain)
    plain_dict.pop("areal")
    ours["reward"]["custom_reward_function"]["reward_kwargs"].pop("areal_reward")
    plain_dict["reward"]["custom_reward_function"]["reward_kwargs"].pop("areal_reward")
    assert ours == plain_dict
    # ... so verl instantiates its own trainer class, which calls none of our hooks.
    assert get_trainer_cls(plain.trainer.v1.trainer_mode) is PPOTrainerSync


def test_loglinear_skips_the_proximal_forward_pass():
    config = compose("grpo_cpu_async", ["areal.loss.prox_logp=loglinear"])
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "areal_decoupled_loglinear"
    assert config.algorithm.rollout_correction.bypass_mode is True  # verl skips the old_log_prob pass
    assert config.algorithm.rollout_correction.rollout_is is None
    assert config.actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold == "1e-12_5.0"


def test_loglinear_with_several_optimizer_steps_is_refused():
    from areal_plugins.builtin.validation import areal_validate_config
    from areal_plugins.config.settings import ArealConfigError

    config = compose(
        "grpo_cpu_async", ["areal.loss.prox_logp=loglinear", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    )
    with pytest.raises(ArealConfigError, match="ppo_mini_batch_size"):
        areal_validate_config(config)
    areal_validate_config(compose("grpo_cpu_async", ["areal.loss.prox_logp=loglinear"]))  # one step: fine


def test_a_concurrency_limit_below_one_batch_is_refused():
    from areal_plugins.builtin.validation import areal_validate_config
    from areal_plugins.config.settings import ArealConfigError

    with pytest.raises(ArealConfigError, match="max_concurrent_rollouts=8 can never fill"):
        areal_validate_config(compose("grpo_cpu_async", ["areal.max_concurrent_rollouts=8"]))
    areal_validate_config(compose("grpo_cpu_async", ["areal.max_concurrent_rollouts=16"]))


def test_token_budget_micro_batches_route_to_verls_dynamic_batching():
    from areal_plugins.builtin.validation import areal_validate_config
    from areal_plugins.config.settings import ArealConfigError

    config = compose("grpo_cpu_async", ["areal.micro_batch.max_tokens=96"])
    actor = config.actor_rollout_ref.actor
    assert actor.use_dynamic_bsz is True and actor.ppo_max_token_len_per_gpu == 96
    # verl's proximal recompute (rollout) and reference pass follow the actor's values.
    assert config.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is True
    assert config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 96
    areal_validate_config(config)
    with pytest.raises(ArealConfigError, match="cannot hold one sequence of up to 48 tokens"):
        areal_validate_config(compose("grpo_cpu_async", ["areal.micro_batch.max_tokens=40"]))
    overridden = ["areal.micro_batch.max_tokens=96", "actor_rollout_ref.actor.use_dynamic_bsz=false"]
    with pytest.raises(ArealConfigError, match="remove those two keys"):
        areal_validate_config(compose("grpo_cpu_async", overridden))
    off = compose("grpo_cpu_sync", ["areal.micro_batch.max_tokens=96"])  # areal.enable false: verl as shipped
    assert off.actor_rollout_ref.actor.use_dynamic_bsz is False
