"""Which verl settings the ``areal:`` node drives, and to what (the glue between our config and verl's).

The shipped config group routes each key of :data:`ROUTED_VERL_KEYS` through the resolver
``${areal_verl:NAME,${areal}}`` (registered by :mod:`areal_plugins.verl_plugin`), which calls
:func:`verl_setting`. With ``areal.enable: false`` every routed value is verl's own default, so verl
runs as shipped.
"""

from __future__ import annotations

from typing import Any

from areal_plugins.config.settings import ArealConfig, ArealConfigError, LossConfig

RECOMPUTE_LOSS_NAME = "areal_decoupled"
LOGLINEAR_LOSS_NAME = "areal_decoupled_loglinear"
#: Our trainer modes in verl's trainer registry (``trainer.v1.trainer_mode``; registered by areal_plugins/driver/).
ASYNC_MODE = "areal_async"
SYNC_MODE = "areal_sync"
#: verl's agent-loop manager under the async trainer (areal_plugins/agent_loop/episode_workers.py).
EPISODE_MANAGER_CLASS = "areal_plugins.agent_loop.episode_workers.ArealAgentLoopManager"
#: ``cap_threshold`` without a cap: a bound that never binds.
NO_CAP = 1e9

#: verl config path -> the routed setting's name (what ``${areal_verl:NAME,${areal}}`` computes).
ROUTED_VERL_KEYS: dict[str, str] = {
    "trainer.v1.trainer_mode": "trainer_mode",
    "actor_rollout_ref.actor.use_dynamic_bsz": "use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "ppo_max_token_len_per_gpu",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "loss_mode",
    "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold": "actor_rollout_is_threshold",
    "actor_rollout_ref.rollout.calculate_log_probs": "calculate_log_probs",
    "actor_rollout_ref.rollout.agent.agent_loop_manager_class": "agent_loop_manager_class",
    "actor_rollout_ref.rollout.scheduling_policy": "scheduling_policy",
    "algorithm.rollout_correction.rollout_is": "rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "rollout_is_threshold",
    "algorithm.rollout_correction.bypass_mode": "bypass_mode",
}


def routed_settings(config: ArealConfig) -> dict[str, tuple[bool, Any, Any]]:
    """Every routed setting: ``name -> (applies under config, value when it applies, verl's default)``."""
    on = config.enable
    decoupled = on and config.loss.decoupled
    loglinear = decoupled and config.loss.prox_logp == "loglinear"
    recompute = decoupled and not loglinear
    ffd = on and config.micro_batch.max_tokens is not None
    return {
        # async: our staleness-bounded trainer (areal_plugins.driver); sync: verl's, with our hooks.
        "trainer_mode": (on, ASYNC_MODE if config.mode == "async" else SYNC_MODE, "sync"),
        "loss_mode": (decoupled, LOGLINEAR_LOSS_NAME if loglinear else RECOMPUTE_LOSS_NAME, "vanilla"),
        "calculate_log_probs": (on, True, False),  # the engine's per-token behaviour log-probs
        # verl's TransferQueue agent-loop workers, recording each episode's versions across turns.
        "agent_loop_manager_class": (on and config.mode == "async", EPISODE_MANAGER_CLASS, None),
        # vLLM's scheduler orders its waiting queue by each request's priority, so validation requests (which our
        # server gives the lowest value) go ahead of the training backlog; training requests all have priority 0,
        # so among them it is first come, first served, as verl's fcfs (docs/backends.md, Validation goes first).
        "scheduling_policy": (on and config.mode == "async", "priority", "fcfs"),
        "rollout_is": (recompute, "token", None),
        # verl truncates the behaviour weight before the loss sees it: that is our cap (docs/design.md).
        "rollout_is_threshold": (recompute, cap_threshold(config.loss), 2.0),
        # loglinear: the loss computes w itself and reads the cap from the actor's own copy.
        "actor_rollout_is_threshold": (loglinear, cap_threshold(config.loss), 2.0),
        # bypass: verl skips the proximal forward pass and hands the loss the behaviour log-probs. That
        # is the ablation (standard PPO against the behaviour policy, as a naive async system does)
        # and what the loglinear loss needs.
        "bypass_mode": (on and (not config.loss.decoupled or loglinear), True, False),
        # FFD packs within verl's token-budget micro-batching (patches/micro_batch_partitioner.py); the
        # proximal recompute and the reference follow the actor's values (verl's own interpolation).
        "use_dynamic_bsz": (ffd, True, False),
        "ppo_max_token_len_per_gpu": (ffd, config.micro_batch.max_tokens, 16384),
    }


def verl_setting(name: str, config: ArealConfig) -> Any:
    """The value of the verl setting ``name`` under ``config`` (verl's default when it does not apply)."""
    table = routed_settings(config)
    if name not in table:
        raise ArealConfigError(f"areal_verl has no setting {name!r}; known: {', '.join(sorted(table))}")
    applies, value, default = table[name]
    return value if applies else default


#: A path absent from a config.
_ABSENT = object()


def route_composed_config(config: Any) -> dict[str, Any]:
    """Route a composed verl config whose ``areal:`` node did not come with our config group.

    A verl user's own recipe with ``areal.enable: true`` (or ``+areal.enable=true`` on the command
    line) gets what our recipes get from ``${areal_verl:...}``: the ``areal`` node completed with
    its defaults, and every routed verl key that applies set to its routed value. A key the recipe
    set to something else (neither verl's default nor the routed value) is refused, naming both.
    Returns the keys it changed (path -> value); nothing without an enabled ``areal`` node.
    """
    from omegaconf import OmegaConf, open_dict

    node = config.get("areal") if hasattr(config, "get") else None
    if node is None:
        return {}
    areal = ArealConfig.from_node(node)
    if not areal.enable:
        return {}
    table = routed_settings(areal)
    changes: dict[str, Any] = {}
    for path, name in ROUTED_VERL_KEYS.items():
        applies, value, verl_default = table[name]
        if not applies:
            continue
        have = OmegaConf.select(config, path, default=_ABSENT)
        if have == value:
            continue
        if have is not _ABSENT and have != verl_default:
            raise ArealConfigError(
                f"the recipe sets {path}={have!r}, but areal.enable=true routes it to {value!r}: remove {path} "
                "from the recipe (areal_plugins sets it) or set areal.enable=false to keep yours"
            )
        changes[path] = value
    import dataclasses

    with open_dict(config):
        config.areal = OmegaConf.create(dataclasses.asdict(areal))
        for path, value in changes.items():
            OmegaConf.update(config, path, value, force_add=True)
    return changes


def parse_cap_threshold(threshold: float | str) -> tuple[float | None, str]:
    """Invert :func:`cap_threshold`: ``(cap or None, mode)``."""
    if isinstance(threshold, str) and "_" in threshold:
        return float(threshold.split("_")[1]), "mask"
    value = float(threshold)
    return (None, "clamp") if value >= NO_CAP else (value, "clamp")


def cap_threshold(loss: LossConfig) -> float | str:
    """verl's ``rollout_is_threshold`` that applies our cap to w = π_prox/π_behav.

    ``clamp``: a plain upper bound (verl's truncated IS clamps w to it). ``mask``: verl's
    ``"lower_upper"`` form zeroes w outside the band; the lower bound sits below anything verl can
    produce (it clamps log w at -20, i.e. w >= 2e-9), so only w > cap is dropped. No cap: a bound
    that never binds.
    """
    cap = loss.behav_imp_weight_cap
    if cap is None:
        return NO_CAP
    return float(cap) if loss.behav_imp_weight_mode == "clamp" else f"1e-12_{float(cap)}"


def pin_plugin_selection(config: Any, names: list[str]) -> list[str]:
    """Write the plugin set chosen here into the config verl hands to its workers; return it.

    The recipe routes ``areal.plugins`` to the reward workers (``reward_kwargs.areal_plugins``); verl may
    have resolved that copy already, so both are set. A node missing one of ``names`` then fails with
    an error naming it instead of running without the plugin.
    """
    from omegaconf import open_dict

    nodes = [config.areal.plugins]
    reward_kwargs: Any = config.get("reward", {}).get("custom_reward_function", {}).get("reward_kwargs") or {}
    if reward_kwargs.get("areal_plugins") is not None:
        nodes.append(reward_kwargs.areal_plugins)
    for node in nodes:
        with open_dict(node):
            node.include, node.exclude = list(names), []
    return list(names)
