from __future__ import annotations

import pytest

from areal_plugins.rewards.math_verify_reward import compute_score


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("8", "8", 1.0),
        ("The answer is 8", "8", 1.0),
        ("8.0", "8", 1.0),
        ("\\boxed{12}", "12", 1.0),
        ("9", "8", 0.0),
        ("", "8", 0.0),
        ("eight", "8", 0.0),
    ],
)
def test_exact_answers(response, truth, expected):
    assert compute_score("areal/addition", response, truth) == expected


def test_recipes_reward_asks_the_hook_only_when_enabled():
    from areal_plugins.hooks.hookimpl import hookimpl
    from areal_plugins.rewards import hooked
    from areal_plugins.testing import plugin_registered

    class LengthReward:
        @staticmethod
        @hookimpl
        def areal_make_reward_fn(config):
            assert config["areal"]["enable"] is True
            return lambda data_source, solution, truth, extra: float(len(solution))

    hooked._chosen.clear()
    try:
        with plugin_registered(LengthReward()):
            assert hooked.compute_score("a", "12345", "7", areal_enable=True, areal_plugins={"exclude": []}) == 5.0
            # disabled: math-verify directly, no hook called
            assert hooked.compute_score("a", "12345", "7", areal_enable=False) == 0.0
            assert hooked.compute_score("a", "the answer is 7", "7", areal_enable=False) == 1.0
    finally:
        hooked._chosen.clear()


def test_enabled_recipes_score_in_a_time_limited_worker_process():
    from areal_plugins.rewards import hooked

    hooked._chosen.clear()
    hooked._services.clear()
    try:
        settings = {"service": True, "num_workers": 1, "timeout_s": 30.0, "retries": 0}
        result = hooked.compute_score("a", "the answer is 7", "7", areal_enable=True, areal_reward=settings)
        assert result["score"] == result["acc"] == 1.0 and result["areal_reward_failed"] == 0.0
        assert result["areal_reward_latency_s"] > 0
        (service,) = hooked._services.values()
        assert service.stats()["areal/reward_calls"] == 1.0
    finally:
        for service in hooked._services.values():
            service.close()
        hooked._services.clear()
        hooked._chosen.clear()
