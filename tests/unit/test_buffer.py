"""The sample buffer: oldest head version first, on_stale wait | drop, blocking take."""

from __future__ import annotations

import threading
import time

import pytest

from areal_plugins.core.buffer import BufferedGroup, OldestFirstBuffer


def group(name: str, *heads: int) -> BufferedGroup:
    return BufferedGroup(group_id=name, head_versions=list(heads))


def test_oldest_head_version_first_ties_by_arrival():
    buffer = OldestFirstBuffer(max_staleness=4)
    for g in (group("a", 3), group("b", 1, 5), group("c", 1), group("d", 2)):
        buffer.put(g)
    taken, dropped = buffer.take(3, trainer_version=5)
    # b's head is its oldest token (1), same as c's; b arrived first.
    assert [g.group_id for g in taken] == ["b", "c", "d"]
    assert dropped == []
    assert len(buffer) == 1


def test_take_times_out_without_removing_anything():
    buffer = OldestFirstBuffer(max_staleness=1)
    buffer.put(group("a", 0))
    taken, dropped = buffer.take(2, trainer_version=0, timeout=0.05)
    assert taken == [] and dropped == [] and len(buffer) == 1


def test_take_wakes_up_when_enough_groups_arrive():
    buffer = OldestFirstBuffer(max_staleness=1)
    threading.Timer(0.05, lambda: [buffer.put(group(n, 0)) for n in "xy"]).start()
    started = time.monotonic()
    taken, _ = buffer.take(2, trainer_version=0, timeout=5)
    assert [g.group_id for g in taken] == ["x", "y"]
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("mode", ["drop", "reissue"])
def test_drop_and_reissue_return_groups_beyond_eta_and_keep_the_rest(mode):
    buffer = OldestFirstBuffer(max_staleness=1, on_stale=mode)
    for g in (group("old", 0), group("ok", 2), group("ok2", 3)):
        buffer.put(g)
    # trainer at version 3: staleness old = 3 > 1, ok = 1, ok2 = 0
    taken, dropped = buffer.take(2, trainer_version=3)
    assert [g.group_id for g in dropped] == ["old"]
    assert [g.group_id for g in taken] == ["ok", "ok2"]
    # Not enough usable groups: the stale ones come back at once, so their slots can be freed.
    buffer.put(group("old2", 1))
    taken, dropped = buffer.take(1, trainer_version=3, timeout=5)
    assert taken == [] and [g.group_id for g in dropped] == ["old2"]


def test_wait_trains_on_over_stale_groups_and_counts_them():
    buffer = OldestFirstBuffer(max_staleness=1, on_stale="wait")
    buffer.put(group("old", 0))
    taken, dropped = buffer.take(1, trainer_version=3)
    assert [g.group_id for g in taken] == ["old"] and dropped == []
    assert buffer.over_stale_kept == 1


@pytest.mark.parametrize(("eta", "mode"), [(-1, "wait"), (1, "later")])
def test_bad_settings_are_refused(eta, mode):
    with pytest.raises(ValueError):
        OldestFirstBuffer(max_staleness=eta, on_stale=mode)


def test_the_default_buffers_old_name_still_imports_with_a_warning_naming_the_new_one():
    import pytest

    with pytest.warns(DeprecationWarning, match="the default buffer is OldestFirstBuffer"):
        from areal_plugins.core.buffer import SampleBuffer
    assert SampleBuffer is OldestFirstBuffer
