"""The conformance kit (``areal_plugins.testing``): ours and a buffer and a rollout manager written from the plugin
guide alone pass it; implementations that each break one rule of a contract fail it, naming that rule."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

from areal_plugins.core.buffer import OldestFirstBuffer
from areal_plugins.core.staleness import StalenessController
from areal_plugins.driver.admission import AdmissionLoop
from areal_plugins.hooks.contracts import RolloutManager, missing_members, require_contract
from areal_plugins.testing import ContractViolationError, check_rollout_manager, check_sample_buffer

EXAMPLE_PLUGINS = Path(__file__).resolve().parents[1] / "example_plugin"


@pytest.mark.parametrize("on_stale", ["wait", "drop", "reissue"])
def test_our_buffer_keeps_the_contract(on_stale):
    check_sample_buffer(lambda eta: OldestFirstBuffer(eta, on_stale=on_stale))


def test_a_buffer_written_from_the_guide_keeps_the_contract(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGINS))
    from docs_only_fifo_buffer import FifoBuffer

    check_sample_buffer(FifoBuffer)
    sys.modules.pop("docs_only_fifo_buffer", None)


class TimeoutRemoves(OldestFirstBuffer):
    """Hands out what it has at the timeout instead of nothing."""

    def take(self, count, trainer_version, timeout=None):
        taken, stale = super().take(count, trainer_version, timeout)
        if not taken and len(self):
            taken, _ = super().take(len(self), trainer_version, 0)
        return taken, stale


class Uncounted(OldestFirstBuffer):
    """Trains groups past η without counting them."""

    def take(self, count, trainer_version, timeout=None):
        taken, stale = super().take(count, trainer_version, timeout)
        self.over_stale_kept = 0
        return taken, stale


class NoWait(OldestFirstBuffer):
    """Never waits for a put: a trainer waiting on it would spin."""

    def take(self, count, trainer_version, timeout=None):
        return super().take(count, trainer_version, 0 if timeout is None else min(timeout, 0.01))


class Forgetful(OldestFirstBuffer):
    """Loses every third group put."""

    def put(self, group):
        self.puts = getattr(self, "puts", 0) + 1
        if self.puts % 3:
            super().put(group)


@pytest.mark.parametrize(
    ("broken", "rule"),
    [
        (TimeoutRemoves, "returned groups instead of none"),
        (Uncounted, "over_stale_kept grew by 0"),
        (NoWait, "a waiting take() missed a put()"),
        (Forgetful, "3 groups put, len() says 2"),
    ],
)
def test_a_buffer_that_breaks_one_rule_fails_naming_it(broken, rule):
    with pytest.raises(ContractViolationError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        check_sample_buffer(lambda eta: broken(eta))


def test_a_manager_without_a_member_is_refused_at_startup_naming_it():
    class Incomplete:
        staleness_controller = None

        def start(self): ...

    missing = missing_members(Incomplete(), RolloutManager)
    assert "drop_stale" in missing and "quiesce" in missing and "start" not in missing
    from areal_plugins.testing import InMemoryTransferQueue
    from tests.unit.test_admission import make_loop

    loop, _ = make_loop(InMemoryTransferQueue())
    assert missing_members(loop, RolloutManager) == [] and isinstance(loop, RolloutManager)
    with pytest.raises(
        TypeError,
        match=r"areal_make_rollout_manager returned a .*Incomplete, which lacks last_progress, .* stop, pause,",
    ):
        require_contract(Incomplete(), RolloutManager, "areal_make_rollout_manager")


# ---------------------------------------------------------------- the rollout manager


def default_manager(kit, loop_class=AdmissionLoop, controller_class=StalenessController):
    """Built as ``builtin/async_rollout.py`` builds it, on the kit's arguments."""
    bound = (kit.max_staleness + 1) * kit.batch_size
    controller = controller_class(kit.max_staleness, kit.batch_size, bound)
    return loop_class(
        controller,
        kit.buffer,
        kit.submit_prompts,
        kit.accept_trajectory,
        kit.poll_interval_s,
        store=kit.store,
        failure_limit=2 * kit.batch_size,
        reissue=kit.reissue_prompts,
    )


def test_our_rollout_manager_keeps_the_contract():
    check_rollout_manager(default_manager)


def test_a_rollout_manager_written_from_the_guide_keeps_the_contract(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGINS))
    from docs_only_steady_manager import PER_POLL, build_manager

    sizes = []

    def counting(count):
        sizes.append(count)
        return kit_submit(count)

    def make(kit):
        nonlocal kit_submit
        kit_submit = kit.submit_prompts
        return build_manager(
            kit.max_staleness,
            kit.batch_size,
            kit.buffer,
            counting,
            kit.accept_trajectory,
            kit.reissue_prompts,
            kit.store,
            kit.poll_interval_s,
            max_concurrent=100,
        )

    kit_submit = None
    check_rollout_manager(make)
    assert sizes and max(sizes) <= PER_POLL  # its one change of behaviour holds
    sys.modules.pop("docs_only_steady_manager", None)


class AdmitsTooMuch(StalenessController):
    def capacity(self, version):
        return super().capacity(version) + 1


class PauseIgnored(AdmissionLoop):
    def pause(self):
        pass


class QuiesceIgnored(AdmissionLoop):
    def quiesce(self):
        return nullcontext()


class DropLeavesThePrompt(AdmissionLoop):
    def drop_stale(self, groups):
        self.staleness_controller.on_drop_accepted(len(groups))
        self.dropped_stale_groups += len(groups)


class SilentErrors(AdmissionLoop):
    def check_alive(self):
        pass


class RecoverForgetsAccepted(StalenessController):
    def recover(self, version):
        super().recover(0)


@pytest.mark.parametrize(
    ("loop_class", "controller_class", "rule"),
    [
        (AdmissionLoop, AdmitsTooMuch, "over the bound"),
        (PauseIgnored, StalenessController, "submitted while paused"),
        (QuiesceIgnored, StalenessController, "settled a group inside quiesce()"),
        (DropLeavesThePrompt, StalenessController, "drop_stale left the group's prompt"),
        (SilentErrors, StalenessController, "check_alive() did not raise"),
        (AdmissionLoop, RecoverForgetsAccepted, "after staleness_controller.recover(3)"),
    ],
)
def test_a_rollout_manager_that_breaks_one_rule_fails_naming_it(loop_class, controller_class, rule):
    with pytest.raises(ContractViolationError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        check_rollout_manager(lambda kit: default_manager(kit, loop_class, controller_class), timeout_s=2)
