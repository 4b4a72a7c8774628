"""The policy loss, the reward function and a backend's server class are checked like the other contracts."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from areal_plugins.hooks.contracts import (
    BackendCapabilities,
    PolicyLoss,
    RewardFunction,
    missing_members,
    require_contract,
)


def _reward_without_extra_info(data_source: str, solution_str: str, ground_truth: Any) -> float:
    return 0.0


def _loss_without_mask(logprobs: Any, proximal: Any, behav: Any, advantages: Any, **options: Any) -> Any:
    return 0.0, {}


class _Server:
    capabilities: ClassVar[frozenset[str]] = frozenset()
    releases_memory_on_sleep = False

    @staticmethod
    def verify_weights(reply: dict, state_dict: dict, version: int, where: str) -> None:
        return None


def test_a_reward_function_short_of_a_parameter_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"areal_make_reward_fn returned .* lacks parameter 'extra_info' of the "):
        require_contract(_reward_without_extra_info, RewardFunction, "areal_make_reward_fn")


def test_a_policy_loss_short_of_a_parameter_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"lacks parameter 'loss_mask' of the PolicyLoss contract"):
        require_contract(_loss_without_mask, PolicyLoss, "areal_make_policy_loss")


def test_a_backend_missing_a_declaration_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"_Server, which lacks uses_reserved_gpus of the BackendCapabilities"):
        require_contract(_Server, BackendCapabilities, "rollout backend x (its server class)")


def test_the_defaults_and_our_backends_pass(paced_backend) -> None:
    from areal_plugins.core.losses import decoupled_ppo_loss
    from areal_plugins.objectives.m2po import m2po_loss
    from areal_plugins.rewards.math_verify_reward import compute_score
    from areal_plugins.rollout.verl_registration import backends, server_class

    assert missing_members(decoupled_ppo_loss, PolicyLoss) == []
    assert missing_members(m2po_loss, PolicyLoss) == []
    assert missing_members(compute_score, RewardFunction) == []
    assert missing_members(lambda *args: 0.0, RewardFunction) == []  # takes any number of arguments
    assert len(backends()) == 2  # the benchmarks' stand-in (paced_backend) meets the contract too
    for backend in backends():
        assert missing_members(server_class(backend), BackendCapabilities) == [], backend


def test_something_not_callable_is_refused() -> None:
    assert missing_members(3, RewardFunction) == ["__call__"]
