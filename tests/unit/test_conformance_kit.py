"""The conformance kit (``areal_plugins.testing.check_sample_buffer``): ours and a buffer written from the plugin
guide alone pass it; buffers that each break one rule of the contract fail it, naming that rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal_plugins.core.buffer import SampleBuffer
from areal_plugins.hooks.contracts import RolloutManager, missing_members, require_contract
from areal_plugins.testing import ContractViolationError, check_sample_buffer

EXAMPLE_PLUGINS = Path(__file__).resolve().parents[1] / "example_plugin"


@pytest.mark.parametrize("on_stale", ["wait", "drop", "reissue"])
def test_our_buffer_keeps_the_contract(on_stale):
    check_sample_buffer(lambda eta: SampleBuffer(eta, on_stale=on_stale))


def test_a_buffer_written_from_the_guide_keeps_the_contract(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGINS))
    from docs_only_fifo_buffer import FifoBuffer

    check_sample_buffer(FifoBuffer)
    sys.modules.pop("docs_only_fifo_buffer", None)


class TimeoutRemoves(SampleBuffer):
    """Hands out what it has at the timeout instead of nothing."""

    def take(self, count, trainer_version, timeout=None):
        taken, stale = super().take(count, trainer_version, timeout)
        if not taken and len(self):
            taken, _ = super().take(len(self), trainer_version, 0)
        return taken, stale


class Uncounted(SampleBuffer):
    """Trains groups past η without counting them."""

    def take(self, count, trainer_version, timeout=None):
        taken, stale = super().take(count, trainer_version, timeout)
        self.over_stale_kept = 0
        return taken, stale


class NoWait(SampleBuffer):
    """Never waits for a put: a trainer waiting on it would spin."""

    def take(self, count, trainer_version, timeout=None):
        return super().take(count, trainer_version, 0 if timeout is None else min(timeout, 0.01))


class Forgetful(SampleBuffer):
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
        controller = None

        def start(self): ...

    missing = missing_members(Incomplete(), RolloutManager)
    assert "drop_stale" in missing and "quiesce" in missing and "start" not in missing
    from tests.unit.test_admission import MemoryStore, make_loop

    loop, _ = make_loop(MemoryStore())
    assert missing_members(loop, RolloutManager) == [] and isinstance(loop, RolloutManager)
    with pytest.raises(
        TypeError,
        match=r"areal_make_rollout_manager returned a .*Incomplete, which lacks last_progress, .* stop, pause,",
    ):
        require_contract(Incomplete(), RolloutManager, "areal_make_rollout_manager")
