"""The conformance kit's checks of a rollout manager (the ``RolloutManager`` and ``StalenessControllerLike``
contracts).

:func:`check_rollout_manager` plays verl's part around a manager: it hands the factory the hook's arguments
(a buffer, ``submit_prompts``, ``accept_trajectory``, ``reissue_prompts``) wired to an
:class:`InMemoryTransferQueue`, finishes and fails prompt groups in it as verl's agent loop would, and calls
the manager as the async trainer does. The staleness bound is checked from an independent count: the prompt
groups submitted whose prompt is still registered (a manager unregisters a group it frees).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_plugins.hooks.contracts import (
    RolloutManager,
    StalenessControllerLike,
    missing_members,
    staleness_controller_of,
)
from areal_plugins.testing.memory_transfer_queue import InMemoryTransferQueue
from areal_plugins.testing.violations import rule

#: Trajectories of a group whose uid starts with this are rejected by the kit's ``accept_trajectory``.
REJECTED_PREFIX = "reject-"


@dataclass
class ManagerKit:
    """What a manager factory receives: the staleness bound, and the hook's arguments wired to the kit.

    Build the manager exactly as your ``areal_make_rollout_manager`` does, with ``store`` where it uses
    TransferQueue's module and ``poll_interval_s`` as its polling period.
    """

    max_staleness: int
    batch_size: int
    poll_interval_s: float
    buffer: Any
    store: InMemoryTransferQueue = field(default_factory=InMemoryTransferQueue)
    submitted: list[str] = field(default_factory=list)
    reissued: list[str] = field(default_factory=list)
    #: The version the kit last told the manager (``resume``); the bound is checked at it.
    version: int = 0
    #: Submissions that broke the bound, as messages (checked in the test's thread).
    violations: list[str] = field(default_factory=list)
    submit_error: BaseException | None = None
    _next_rejected: int = 0

    @property
    def bound(self) -> int:
        """(η + v + 1) · B: the most groups submitted and not freed at version ``v``."""
        return (self.max_staleness + self.version + 1) * self.batch_size

    @property
    def live(self) -> list[str]:
        """Groups submitted whose prompt is still registered: running, or accepted and not yet trained."""
        return [uid for uid in self.submitted if uid in self.store.tags]

    def submit_prompts(self, count: int) -> int:
        if self.submit_error is not None:
            raise self.submit_error
        if len(self.live) + count > self.bound:
            self.violations.append(
                f"{count} groups submitted at version {self.version} with {len(self.live)} live: over the bound "
                f"(η + v + 1) · B = {self.bound}"
            )
        for _ in range(count):
            uid = f"g{len(self.submitted)}"
            if self._next_rejected:
                self._next_rejected -= 1
                uid = REJECTED_PREFIX + uid
            self.submitted.append(uid)
            self.store.add_prompt(uid)
        return count

    def accept_trajectory(self, trajectory: Any) -> bool:
        return not str(trajectory.group_id).startswith(REJECTED_PREFIX)

    def reissue_prompts(self, uids: list[str]) -> None:
        self.reissued.extend(uids)
        for uid in uids:
            self.store.tags[uid]["status"] = "running"

    def finish(self, uid: str, version: int = 0) -> None:
        """Two trajectories (rewards 1 and 0) generated under ``version``."""
        self.store.finish(uid, [1.0, 0.0], [[version, version], [version]])

    def running(self) -> list[str]:
        return [uid for uid in self.live if self.store.tags[uid]["status"] == "running"]


def check_rollout_manager(
    make_manager: Callable[[ManagerKit], Any], make_buffer: Callable[[int], Any] | None = None, timeout_s: float = 10.0
) -> None:
    """Check a rollout manager against the ``RolloutManager`` contract by driving it as the async trainer does.

    ``make_manager(kit)`` returns a new manager built on ``kit``'s arguments (:class:`ManagerKit`);
    ``make_buffer(max_staleness)`` the buffer to give it (default: ours). Raises
    :class:`~areal_plugins.testing.ContractViolationError` naming the broken rule::

        from areal_plugins.testing import check_rollout_manager

        def test_my_manager_keeps_the_contract():
            check_rollout_manager(lambda kit: MyManager.build(kit.max_staleness, kit.batch_size, kit.buffer,
                                  kit.submit_prompts, kit.accept_trajectory, kit.reissue_prompts, kit.store,
                                  kit.poll_interval_s))
    """
    if make_buffer is None:
        from areal_plugins.core.buffer import OldestFirstBuffer

        make_buffer = OldestFirstBuffer
    check = _Checker(make_manager, make_buffer, timeout_s)
    check.members_and_counters()
    check.admission_settling_and_both_stale_paths()
    check.quiesce_suspend_and_stop()
    check.an_error_reaches_the_trainer()


class _Checker:
    ETA, BATCH, POLL_S = 1, 2, 0.01

    def __init__(self, make_manager: Callable[[ManagerKit], Any], make_buffer: Callable[[int], Any], timeout_s: float):
        self.make_manager, self.make_buffer, self.timeout_s = make_manager, make_buffer, timeout_s

    def new(self) -> tuple[ManagerKit, Any]:
        kit = ManagerKit(self.ETA, self.BATCH, self.POLL_S, self.make_buffer(self.ETA))
        return kit, self.make_manager(kit)

    # ------------------------------------------------------------------ the rules

    def members_and_counters(self) -> None:
        kit, manager = self.new()
        _rule(not missing_members(manager, RolloutManager), f"lacks {missing_members(manager, RolloutManager)}")
        controller = staleness_controller_of(manager)
        lacking = missing_members(controller, StalenessControllerLike)
        _rule(not lacking, f"its staleness_controller lacks {lacking}")
        state = controller.state_dict()
        _rule(
            {"running", "accepted", "rejected"} <= set(state),
            f"staleness_controller.state_dict() lacks a count: {sorted(state)}",
        )
        controller.recover(3)
        counts = (controller.running, controller.accepted)
        _rule(
            counts == (0, 3 * self.BATCH),
            f"after staleness_controller.recover(3) at B = {self.BATCH}: running, accepted = {counts}, "
            f"not (0, {3 * self.BATCH})",
        )
        _rule(not kit.submitted, "submitted prompts before start()")

    def admission_settling_and_both_stale_paths(self) -> None:
        kit, manager = self.new()
        manager.start()
        try:
            self.fills_the_bound(kit, "at version 0")
            started = time.monotonic()
            for uid in kit.running():
                kit.finish(uid)
            self.wait(lambda: len(kit.buffer) == kit.bound, "finished groups did not reach the buffer")
            _rule(manager.last_progress >= started, "last_progress did not advance when groups finished")
            self.counts(manager, running=0, accepted=kit.bound, rejected=0)
            self.stays(lambda: len(kit.submitted) == kit.bound, "submitted with the bound full and no new version")

            kit.version = 1
            manager.resume(1)
            self.fills_the_bound(kit, "after resume(1)")

            manager.pause()
            (dropped,), _ = kit.buffer.take(1, 1, timeout=1)
            manager.drop_stale([dropped])
            _rule(
                dropped.group_id not in kit.store.tags and not kit.store.trajectory_keys(dropped.group_id),
                "drop_stale left the group's prompt or trajectories in TransferQueue",
            )
            _rule(manager.dropped_stale_groups == 1, f"dropped_stale_groups is {manager.dropped_stale_groups}, not 1")
            self.counts(manager, running=self.BATCH, accepted=kit.bound - self.BATCH - 1, rejected=1)
            self.stays(lambda: len(kit.submitted) == kit.bound, "submitted while paused")
            manager.resume(1)
            self.wait(lambda: len(kit.submitted) == kit.bound + 1, "did not refill the slot drop_stale freed")

            (again,), _ = kit.buffer.take(1, 1, timeout=1)
            held = len(kit.buffer)
            manager.reissue_stale([again])
            _rule(kit.reissued == [again.group_id], f"reissue_stale sent {kit.reissued}, not [{again.group_id!r}]")
            _rule(
                again.group_id in kit.store.tags and not kit.store.trajectory_keys(again.group_id),
                "reissue_stale must keep the prompt registered and clear its old trajectories",
            )
            _rule(manager.reissued_stale_groups == 1, "reissued_stale_groups did not count the group")
            kit.finish(again.group_id, version=1)
            self.wait(
                lambda: len(kit.buffer) == held + 1,
                "a group sent again by reissue_stale did not come back to the buffer when it finished",
            )

            failing = kit.running()[0]
            kit.store.finish(failing, [], [], status="failure")
            self.wait(lambda: failing in kit.reissued, "a failed group was not sent again (reissue_prompts)")
            _rule(manager.failed_groups == 1, f"failed_groups is {manager.failed_groups}, not 1")

            kit._next_rejected = 1
            manager.drop_stale(kit.buffer.take(1, 1, timeout=1)[0])  # frees one slot: the next uid is rejected
            self.wait(lambda: kit.submitted[-1].startswith(REJECTED_PREFIX), "did not refill a freed slot")
            rejected = kit.submitted[-1]
            before = staleness_controller_of(manager).rejected
            kit.finish(rejected, version=1)
            self.wait(
                lambda: staleness_controller_of(manager).rejected == before + 1,
                "a group whose trajectories were all refused by accept_trajectory was not counted as rejected",
            )
            _rule(rejected not in kit.store.tags, "a rejected group's prompt stayed in TransferQueue")
            _rule(
                manager.rejected_trajectories == 2, f"rejected_trajectories is {manager.rejected_trajectories}, not 2"
            )
            self.no_violation(kit)
        finally:
            manager.stop()

    def quiesce_suspend_and_stop(self) -> None:
        kit, manager = self.new()
        manager.start()
        try:
            self.fills_the_bound(kit, "at version 0")
            first, second, third, *_ = kit.running()
            with manager.quiesce():
                kit.finish(first)
                self.stays(lambda: len(kit.buffer) == 0, "settled a group inside quiesce()")
            self.wait(lambda: len(kit.buffer) == 1, "a group finished during quiesce() was not settled after it")
            manager.suspend_polling()
            kit.finish(second)
            self.stays(lambda: len(kit.buffer) == 1, "settled a group while polling was suspended")
            manager.resume(0)
            self.wait(lambda: len(kit.buffer) == 2, "a group finished while suspended was not settled after resume")
            manager.stop()
            kit.finish(third)
            self.stays(lambda: len(kit.buffer) == 2, "settled a group after stop() returned")
        finally:
            manager.stop()

    def an_error_reaches_the_trainer(self) -> None:
        kit, manager = self.new()
        kit.submit_error = RuntimeError("conformance kit: submit_prompts failed")
        manager.start()
        try:
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                try:
                    manager.check_alive()
                except Exception:
                    return
                time.sleep(self.POLL_S)
            _rule(False, "check_alive() did not raise after submit_prompts raised in the manager's thread")
        finally:
            manager.stop()

    # ------------------------------------------------------------------ helpers

    def wait(self, condition: Callable[[], bool], broken: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not condition():
            _rule(time.monotonic() < deadline, f"{broken} (waited {self.timeout_s:g} s)")
            time.sleep(self.POLL_S)

    def fills_the_bound(self, kit: ManagerKit, when: str) -> None:
        self.wait(lambda: len(kit.live) >= kit.bound, f"did not fill the bound ({kit.bound}) {when}")
        self.no_violation(kit)

    def stays(self, condition: Callable[[], bool], broken: str) -> None:
        """``condition`` holds for 20 polling periods (a manager polls every ``POLL_S``)."""
        end = time.monotonic() + max(0.2, 20 * self.POLL_S)
        while time.monotonic() < end:
            _rule(condition(), broken)
            time.sleep(self.POLL_S)

    def counts(self, manager: Any, running: int, accepted: int, rejected: int) -> None:
        c = staleness_controller_of(manager)
        got = (c.running, c.accepted, c.rejected)
        _rule(
            got == (running, accepted, rejected),
            f"staleness_controller running, accepted, rejected = {got}, not {(running, accepted, rejected)}",
        )

    @staticmethod
    def no_violation(kit: ManagerKit) -> None:
        _rule(not kit.violations, "; ".join(kit.violations))


def _rule(holds: bool, broken: str) -> None:
    rule("RolloutManager", holds, broken)
