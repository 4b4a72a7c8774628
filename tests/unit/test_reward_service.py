"""The reward service with a hanging, a raising and a process-killing reward function."""

from __future__ import annotations

import pytest

from areal_plugins.rewards.service import RewardService
from tests.unit import reward_fns


@pytest.fixture
def service():
    service = RewardService(reward_fns.misbehaving, num_workers=2, timeout_s=1.0, retries=1)
    yield service
    service.close()


def test_hang_raise_and_crash_give_zero_counted_and_the_service_goes_on(service):
    assert service.score("d", "7", "7", None) == 1.0
    assert service.score("d", "hang", "7", None) == 0.0  # killed after 1 s, retried once, given up
    assert service.score("d", "raise", "7", None) == 0.0
    assert service.score("d", "crash", "7", None) == 0.0
    # Every worker still answers afterwards: nothing is stuck.
    assert [service.score("d", "7", "7", None) for _ in range(4)] == [1.0] * 4
    stats = service.stats()
    assert stats["areal/reward_timeouts"] == 2  # first attempt + one retry
    assert stats["areal/reward_failures"] == 1
    assert stats["areal/reward_crashes"] == 2
    assert stats["areal/reward_calls"] == 8
    assert stats["areal/reward_latency_s_max"] >= 2.0


def test_a_crash_is_retried_on_a_fresh_worker(tmp_path):
    service = RewardService(reward_fns.crash_once, num_workers=1, timeout_s=5.0, retries=1)
    try:
        assert service.score("d", "x", "y", {"marker": str(tmp_path / "m")}) == 1.0
        assert service.stats()["areal/reward_crashes"] == 1
    finally:
        service.close()


def test_concurrent_callers_share_the_workers():
    from concurrent.futures import ThreadPoolExecutor

    service = RewardService(reward_fns.well_behaved, num_workers=2, timeout_s=5.0)
    try:
        with ThreadPoolExecutor(8) as pool:
            scores = list(pool.map(lambda i: service.score("d", str(i % 3), "1", None), range(30)))
        assert scores == [1.0 if i % 3 == 1 else 0.0 for i in range(30)]
    finally:
        service.close()


def test_each_score_reports_what_it_took(service):
    ok = service.score_with_report("d", "7", "7", None)
    assert (ok.score, ok.failed, ok.timeouts, ok.crashes) == (1.0, False, 0, 0)
    hung = service.score_with_report("d", "hang", "7", None)
    assert (hung.score, hung.failed, hung.timeouts) == (0.0, True, 2) and hung.latency_s >= 2.0
    raised = service.score_with_report("d", "raise", "7", None)
    assert (raised.failed, raised.timeouts, raised.crashes) == (True, 0, 0)
    crashed = service.score_with_report("d", "crash", "7", None)
    assert (crashed.failed, crashed.crashes) == (True, 2)
    assert hung.as_extra_info() == {
        "areal_reward_latency_s": hung.latency_s,
        "areal_reward_failed": 1.0,
        "areal_reward_timeouts": 2.0,
        "areal_reward_crashes": 0.0,
    }


def test_step_metrics_aggregate_the_reports():
    from areal_plugins.driver.step_metrics import reward_service_metrics

    reports = [
        {"areal_reward_latency_s": 0.5, "areal_reward_failed": 0.0, "areal_reward_timeouts": 0.0},
        {"areal_reward_latency_s": 2.5, "areal_reward_failed": 1.0, "areal_reward_timeouts": 2.0},
        {},  # scored without the service: not counted
    ]
    assert reward_service_metrics(reports) == {
        "areal/reward_latency_s_mean": 1.5,
        "areal/reward_latency_s_max": 2.5,
        "areal/reward_failed": 1.0,
        "areal/reward_timeouts": 2.0,
        "areal/reward_crashes": 0.0,
    }
    assert reward_service_metrics([{}, {}]) == {}


def test_rollout_rates_between_two_engine_snapshots():
    from areal_plugins.driver.step_metrics import rollout_rates

    before = {"replicas": 2, "busy_s": 10.0, "generated_tokens": 100, "in_flight": 3, "restarts": 1}
    after = {"replicas": 2, "busy_s": 16.0, "generated_tokens": 400, "in_flight": 0, "restarts": 2}
    # 2 replicas x 5 s of wall = 10 replica-seconds, 6 of them busy; 300 tokens in 5 s; restarts cumulative.
    rates = rollout_rates(before, after, 5.0)
    assert rates == pytest.approx(
        {"areal/rollout_idle_ratio": 0.4, "areal/gen_tokens_per_s": 60.0, "areal/engine_restarts": 2.0}
    )
    assert rollout_rates(None, after, 5.0) == {}


def test_a_worker_that_starts_slowly_is_not_a_reward_that_timed_out():
    """The time limit bounds the reward function, not the worker's start (fork server, imports: 2 s here)."""
    from tests.unit import slow_import_reward

    service = RewardService(slow_import_reward.score, num_workers=1, timeout_s=1.0, retries=0)
    try:
        assert service.score("d", "7", "7", None) == 1.0
        assert service.stats()["areal/reward_timeouts"] == 0
    finally:
        service.close()
