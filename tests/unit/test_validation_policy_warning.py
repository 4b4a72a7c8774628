"""verl's vLLM under areal_async: a run whose vLLM will not read priorities is told that validation queues."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf


def rollout(policy: str | None = None, engine_policy: str | None = None):
    config: dict = {"name": "vllm", "engine_kwargs": {"vllm": {}}}
    if policy is not None:
        config["scheduling_policy"] = policy
    if engine_policy is not None:
        config["engine_kwargs"]["vllm"]["scheduling_policy"] = engine_policy
    return OmegaConf.create(config)


@pytest.mark.parametrize(
    ("policy", "engine_policy", "expected"),
    [
        ("priority", None, "priority"),
        ("fcfs", None, "fcfs"),
        (None, None, "fcfs"),  # verl's default
        ("priority", "fcfs", "fcfs"),  # verl spreads engine_kwargs after its own arguments: they win
        ("fcfs", "priority", "priority"),
    ],
)
def test_the_policy_vllm_is_built_with(policy, engine_policy, expected):
    from areal_plugins.builtin.validation import vllm_scheduling_policy

    assert vllm_scheduling_policy(rollout(policy, engine_policy)) == expected


def test_a_policy_that_ignores_priorities_is_warned_about_naming_the_key(caplog):
    from areal_plugins.builtin.validation import _warn_unless_validation_goes_first

    with caplog.at_level(logging.WARNING):
        _warn_unless_validation_goes_first(rollout("priority"))
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        _warn_unless_validation_goes_first(rollout("priority", engine_policy="fcfs"))
    (record,) = caplog.records
    assert "'fcfs'" in record.getMessage() and "scheduling_policy=priority" in record.getMessage()
