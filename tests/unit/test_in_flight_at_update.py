"""``areal.weight_update.in_flight`` (driver/placements.py): ``interrupt`` aborts the requests under way at a weight
update (colocated: when sampling ends), ``wait`` stops admission and lets them finish under the old weights first.

The rollout manager is a stand-in whose admission thread is played by its ``check_alive``: each look settles one group
in flight, as the real manager's thread settles groups while admission is paused. Every event goes to one log, so
the tests read the order the trainer asked for things."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from areal_plugins.config.settings import ArealConfig
from areal_plugins.driver import placements


class Manager:
    """A rollout manager with ``running`` groups in flight; one of them finishes at each look."""

    def __init__(self, log: list, running: int) -> None:
        self.log = log
        self.staleness_controller = SimpleNamespace(running=running)

    def pause(self) -> None:
        self.log.append("admission stopped")

    def check_alive(self) -> None:  # the admission thread settling the next group that finishes
        self.staleness_controller.running -= 1
        self.log.append(f"group finished, {self.staleness_controller.running} in flight")

    def suspend_polling(self) -> None:
        self.log.append("polling suspended")


def placement(name: str, in_flight: str) -> placements.Placement:
    """The placement as the async trainer builds it from its settings."""
    areal = ArealConfig.from_dict(
        {"placement": name, "weight_update": {"in_flight": in_flight}, "poll_interval_s": 0.001}
    )
    return placements.placement_for(areal.placement, areal.weight_update.in_flight, areal.poll_interval_s)


def trainer_stub(log: list, running: int) -> SimpleNamespace:
    """What the placements' sampling end and the separate sync's ``before_pause`` use of the async trainer."""
    return SimpleNamespace(
        rollout_manager=Manager(log, running),
        supervisor=SimpleNamespace(waiting=lambda: lambda: log.append("checked")),
        recorder=SimpleNamespace(span=lambda *args, **kwargs: nullcontext()),
        checkpoint_manager=SimpleNamespace(
            abort_replicas=lambda: log.append("engines aborted"), sleep_replicas=lambda: log.append("engines asleep")
        ),
        timing_raw={},
    )


def test_waiting_stops_admission_first_and_returns_when_the_last_group_has_finished():
    log: list = []
    manager = Manager(log, running=3)
    sleeps: list[float] = []
    ticks = iter([10.0, 12.5])  # the clock at the start and at the end
    waited = placements.wait_for_in_flight(
        manager, lambda: log.append("checked"), 0.2, sleep=sleeps.append, clock=lambda: next(ticks)
    )
    assert log == [
        "admission stopped",
        *[entry for left in (2, 1, 0) for entry in (f"group finished, {left} in flight", "checked")],
    ]
    assert sleeps == [0.2, 0.2, 0.2] and waited == 2.5  # one poll per look; 12.5 - 10.0 seconds


def test_waiting_with_nothing_in_flight_returns_at_once():
    log: list = []
    waited = placements.wait_for_in_flight(Manager(log, 0), lambda: log.append("checked"), 0.2, sleep=log.append)
    assert log == ["admission stopped"] and waited >= 0


def test_a_run_that_must_stop_stops_waiting():
    """The supervisor's check (stall guard, stop request, dead actor) raises: the wait ends with its error."""

    def stop() -> None:
        raise RuntimeError("stop requested")

    manager = Manager([], running=5)
    with pytest.raises(RuntimeError, match="stop requested"):
        placements.wait_for_in_flight(manager, stop, 0.0)
    assert manager.staleness_controller.running == 4  # it looked once, then stopped


@pytest.mark.parametrize("in_flight", ["interrupt", "wait"])
def test_colocated_engines_are_aborted_at_once_or_after_the_requests_under_way_finished(in_flight):
    log: list = []
    trainer = trainer_stub(log, running=2)
    placement("colocated", in_flight).after_sampling(trainer)
    aborted = log.index("engines aborted")
    if in_flight == "interrupt":  # the paper's interruptible generation: both groups are cut
        assert log[:aborted] == ["admission stopped"] and trainer.rollout_manager.staleness_controller.running == 2
        assert "wait_in_flight" not in trainer.timing_raw
    else:  # both finish under the weights they started with, then the engines sleep (and the abort finds none)
        assert log.index("group finished, 0 in flight") < aborted
        assert trainer.rollout_manager.staleness_controller.running == 0 and trainer.timing_raw["wait_in_flight"] >= 0
    assert log[aborted:] == ["engines aborted", "engines asleep", "polling suspended"]


@pytest.mark.parametrize(("in_flight", "finished"), [("interrupt", 0), ("wait", 3)])
def test_the_separate_syncs_stop_lets_the_requests_under_way_finish_only_when_told_to_wait(in_flight, finished):
    log: list = []
    trainer = trainer_stub(log, running=3)
    placement("separate", in_flight).stop_admission(trainer)
    assert log[0] == "admission stopped"
    assert sum(entry.startswith("group finished") for entry in log) == finished
    assert trainer.rollout_manager.staleness_controller.running == 3 - finished


def test_the_first_sync_has_no_admission_to_stop():
    trainer = trainer_stub([], running=0)
    trainer.rollout_manager = None  # built by on_train_begin, after the first sync
    placement("separate", "wait").stop_admission(trainer)
    assert trainer.timing_raw == {}
