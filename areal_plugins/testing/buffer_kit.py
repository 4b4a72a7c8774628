"""The conformance kit's checks of a sample buffer (the ``SampleBuffer`` contract)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from areal_plugins.testing.violations import ContractViolationError, rule

__all__ = ["ContractViolationError", "check_sample_buffer"]


def check_sample_buffer(make_buffer: Callable[[int], Any], timeout_s: float = 5.0) -> None:
    """Check a sample buffer against the :class:`~areal_plugins.hooks.contracts.SampleBuffer` contract.

    ``make_buffer(max_staleness)`` returns a new, empty buffer bounded by that η. Raises
    :class:`ContractViolationError` naming the broken rule; returns None when every rule holds. Call it from your
    plugin's own tests::

        from areal_plugins.testing import check_sample_buffer

        def test_my_buffer_keeps_the_contract():
            check_sample_buffer(lambda eta: MyBuffer(max_staleness=eta))
    """
    from areal_plugins.hooks.contracts import SampleBuffer, missing_members

    buffer = make_buffer(1)
    _rule(not missing_members(buffer, SampleBuffer), f"lacks {missing_members(buffer, SampleBuffer)}")
    _rule(len(buffer) == 0, "a new buffer is not empty")

    started = time.monotonic()
    taken, stale = buffer.take(1, 0, timeout=0.05)
    _rule(taken == [] and stale == [], "take() from an empty buffer returned groups")
    _rule(time.monotonic() - started < timeout_s, "take() from an empty buffer did not return at its timeout")

    groups = [_group(f"g{i}", head) for i, head in enumerate((1, 1, 1))]
    for group in groups:
        buffer.put(group)
    _rule(len(buffer) == 3, f"3 groups put, len() says {len(buffer)}")
    taken, stale = buffer.take(4, 1, timeout=0.05)
    _rule(taken == [] and stale == [], "take(4) with 3 fresh groups held returned groups instead of none")
    _rule(len(buffer) == 3, "a take() that timed out removed groups")
    taken, stale = buffer.take(2, 1, timeout=0.05)
    _rule(len(taken) == 2 and stale == [], f"take(2) with 3 fresh groups held returned {len(taken)} and {stale}")
    _rule(len(buffer) == 1, "after taking 2 of 3 groups, len() is not 1")
    rest, _ = buffer.take(1, 1, timeout=0.05)
    handed_out = [g.group_id for g in (*taken, *rest)]
    _rule(sorted(handed_out) == ["g0", "g1", "g2"], f"the groups put were handed out as {handed_out}")

    _check_blocking_take(make_buffer(1), timeout_s)
    _check_stale_groups(make_buffer(1))


def _check_blocking_take(buffer: Any, timeout_s: float) -> None:
    """A take() waiting in one thread returns when another thread puts what it waits for."""
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(buffer.take(1, 0, timeout=timeout_s)), daemon=True)
    started = time.monotonic()
    waiter.start()
    time.sleep(0.1)
    buffer.put(_group("late", 0))
    waiter.join(timeout_s + 1)
    _rule(bool(result) and [g.group_id for g in result[0][0]] == ["late"], "a waiting take() missed a put()")
    _rule(time.monotonic() - started < timeout_s, "a waiting take() returned only at its timeout after a put()")


def _check_stale_groups(buffer: Any) -> None:
    """A group past η is either handed back as stale or trained and counted in ``over_stale_kept``."""
    before = buffer.over_stale_kept
    buffer.put(_group("old", 0))
    buffer.put(_group("fresh", 3))
    handed: dict[str, str] = {}
    for _ in range(4):
        taken, stale = buffer.take(1, 3, timeout=0.05)  # at version 3, η = 1: "old" is 3 versions old
        handed |= {g.group_id: "taken" for g in taken} | {g.group_id: "stale" for g in stale}
        if len(handed) == 2:
            break
    _rule(sorted(handed) == ["fresh", "old"], f"two groups put, handed out: {handed}")
    _rule(handed["fresh"] == "taken", "a group within η was handed back as stale")
    counted = buffer.over_stale_kept - before
    if handed["old"] == "taken":
        _rule(counted == 1, f"a group past η was taken but over_stale_kept grew by {counted}, not 1")
    else:
        _rule(counted == 0, "a group past η handed back as stale was also counted as trained")


def _group(group_id: str, head_version: int) -> Any:
    from areal_plugins.core.buffer import BufferedGroup

    return BufferedGroup(group_id, [head_version, head_version + 1], keys=[f"{group_id}_0", f"{group_id}_1"])


def _rule(holds: bool, broken: str) -> None:
    rule("SampleBuffer", holds, broken)
