"""StalenessController against hand-derived cases of docs/design.md (Admission) and invariants under random use."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_plugins.core.staleness import StalenessController


def test_hand_derived_sequence():
    # η = 1, B = 4, room for 100 in flight.
    c = StalenessController(max_staleness=1, batch_size=4, max_concurrent=100)
    assert c.capacity(0) == 8  # (1 + 0 + 1) * 4 - 0
    c.on_submit(8)
    assert c.capacity(0) == 0
    c.on_accept(4)  # running 4, accepted 4
    assert c.capacity(0) == 0  # 8 - (4 + 4)
    assert c.capacity(1) == 4  # 12 - 8
    c.on_reject(1)  # a rejected rollout frees its slot: running 3
    assert c.capacity(1) == 5  # 12 - (4 + 3)
    assert (c.running, c.accepted, c.rejected) == (3, 4, 1)  # 8 submitted = 4 + 1 + 3


def test_concurrency_limit_binds_first():
    c = StalenessController(max_staleness=4, batch_size=8, max_concurrent=3)
    assert c.capacity(0) == 3  # min(3 - 0, 40 - 0)
    c.on_submit(2)
    assert c.capacity(0) == 1


def test_capacity_may_be_negative_after_a_config_change():
    c = StalenessController(max_staleness=0, batch_size=2, max_concurrent=10)
    c.on_submit(2)
    c.on_accept(2)
    c.on_submit(1)  # over-admitted, e.g. after the recipe lowered η
    assert c.capacity(0) == -1  # 2 - (2 + 1)


def test_eta_zero_admits_exactly_one_batch_per_version():
    c = StalenessController(max_staleness=0, batch_size=4, max_concurrent=64)
    for version in range(3):
        assert c.capacity(version) == 4
        c.on_submit(4)
        c.on_accept(4)
        assert c.capacity(version) == 0


def test_recover_restores_accepted_as_version_times_batch():
    c = StalenessController(max_staleness=2, batch_size=4, max_concurrent=100)
    c.recover(5)
    assert (c.running, c.accepted, c.rejected) == (0, 20, 0)
    assert c.capacity(5) == 12  # (2 + 5 + 1) * 4 - 20: exactly η batches ahead, not 8 (version 0 counters)


@pytest.mark.parametrize(("eta", "batch", "concurrent"), [(-1, 4, 4), (0, 0, 4), (0, 4, 0)])
def test_rejects_bad_settings(eta, batch, concurrent):
    with pytest.raises(ValueError):
        StalenessController(eta, batch, concurrent)


def test_cannot_finish_more_than_running():
    c = StalenessController(1, 1, 1)
    with pytest.raises(RuntimeError, match="only 0 in flight"):
        c.on_accept()


def test_thread_safe_counts():
    c = StalenessController(max_staleness=1000, batch_size=1, max_concurrent=10**6)

    def work():
        for _ in range(2000):
            c.on_submit()
            c.on_accept()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (c.accepted, c.running) == (8000, 0)


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 4),
    batch=st.integers(1, 4),
    concurrent=st.integers(1, 8),
    ops=st.lists(st.sampled_from(["submit", "accept", "reject", "consume"]), max_size=80),
)
def test_admission_never_exceeds_the_staleness_bound(eta, batch, concurrent, ops):
    """Submitting only within capacity: every rollout is accounted for, and started no more than η
    versions before the version that consumes it."""
    c = StalenessController(eta, batch, concurrent)
    version = 0
    submitted = 0  # counted here, independently of the controller
    start_versions: list[int] = []  # of running rollouts, oldest first
    ready: list[int] = []  # start versions of accepted, not yet consumed
    for op in ops:
        if op == "submit" and c.capacity(version) > 0:
            c.on_submit()
            submitted += 1
            start_versions.append(version)
        elif op in ("accept", "reject") and start_versions:
            started = start_versions.pop(0)
            if op == "accept":
                c.on_accept()
                ready.append(started)
            else:
                c.on_reject()
        elif op == "consume" and len(ready) >= batch:
            batch_starts, ready = ready[:batch], ready[batch:]
            assert all(version - s <= eta for s in batch_starts)
            version += 1
        assert submitted == c.accepted + c.rejected + c.running
        assert c.running <= concurrent
