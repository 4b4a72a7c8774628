"""Placements on verl's machinery: the colocated engines follow verl's lifecycle (abort, sleep, update, resume)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import OBSERVED_STEPS, read_jsonl

pytestmark = pytest.mark.integration


def test_colocated_engines_sleep_with_weights_released_and_wake_with_the_new_ones(observed_run):
    _, _, run_dir = observed_run  # the main recipe: colocated, rollout.free_cache_engine: true
    events = [e for e in read_jsonl(run_dir / "replica_events.jsonl") if e["replica"] == 0]
    updates = [i for i, e in enumerate(events) if e["event"] == "update" and e["version"] >= 1]
    assert [events[i]["version"] for i in updates] == list(range(1, OBSERVED_STEPS + 1))
    for i in updates:
        before = [e for e in events[:i] if e["event"] != "wake_up"][-2:]
        after = next(e for e in events[i + 1 :] if e["event"] != "wake_up")
        # verl's order: interrupt, sleep (the weights' storage freed), load the new weights, resume.
        assert [e["event"] for e in before] == ["abort", "sleep"], before
        assert before[1]["released"] is True and before[1]["weight_bytes"] == 0
        assert events[i]["weight_bytes"] > 0  # the update brought the weights back
        assert after["event"] == "resume" and after["version"] == events[i]["version"]
        # The adapter woke the engine for the weights before loading them (verl's hybrid update).
        woken = [e for e in events[:i] if e["event"] == "wake_up"]
        assert woken and woken[-1]["time"] > before[1]["time"]
