"""The trainer's phase clock: each phase measured from the end of the one before, written only when it grows."""

from __future__ import annotations

from types import SimpleNamespace

from areal_plugins.driver.phase_clock import PhaseClock
from areal_plugins.records.control_files import PHASE_TIMES_FILE


def clock_and_records(times: list[float]) -> tuple[PhaseClock, list[dict]]:
    written: list[dict] = []
    recorder = SimpleNamespace(write=lambda name, record: written.append({"file": name, **record}))
    ticks = iter(times)
    return PhaseClock(100.0, recorder, clock=lambda: next(ticks)), written


def test_a_phase_runs_from_the_last_end_and_a_shorter_one_writes_nothing():
    # start at 0; update ends at 5 (5 s); update again ends at 7 (2 s, shorter); restart at 10; sync ends at 13 (3 s)
    clock, written = clock_and_records([0.0, 5.0, 7.0, 10.0, 13.0])
    clock.end("update")
    clock.end("update")
    clock.restart()
    clock.end("weight sync")
    assert [record["phases_s"] for record in written] == [{}, {"update": 5.0}, {"update": 5.0, "weight sync": 3.0}]
    assert {record["file"] for record in written} == {PHASE_TIMES_FILE}
    assert written[-1]["longest_phase"] == "update"


def test_a_timed_block_is_measured_apart_from_the_steps_phases():
    clock, written = clock_and_records([0.0, 20.0, 24.0, 30.0])  # start; checkpoint 20-24; update ends at 30
    with clock.timed("checkpoint"):
        pass
    clock.end("update")  # from the start (0), not from the checkpoint's end
    assert written[-1]["checkpoint_s"] == 4.0 and written[-1]["phases_s"]["update"] == 30.0
