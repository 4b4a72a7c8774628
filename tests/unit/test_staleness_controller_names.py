"""The staleness controller has one name (``StalenessController``, its contract ``StalenessControllerLike``, a manager's
``staleness_controller``), and a plugin written against the old ones (``AdmissionCounters``, ``.controller``,
``AdmissionLoop(controller=...)``) still runs, each old name with a ``DeprecationWarning`` naming the new one."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

import areal_plugins
from areal_plugins.core.buffer import OldestFirstBuffer
from areal_plugins.core.staleness import StalenessController
from areal_plugins.driver.admission import AdmissionLoop
from areal_plugins.driver.placements import wait_for_in_flight
from areal_plugins.driver.step_metrics import admission_metrics
from areal_plugins.hooks.contracts import (
    RolloutManager,
    StalenessControllerLike,
    missing_members,
    require_contract,
    staleness_controller_of,
)
from areal_plugins.testing import InMemoryTransferQueue


def controller() -> StalenessController:
    return StalenessController(max_staleness=1, batch_size=2, max_concurrent=100)


def loop_args() -> tuple:
    """``AdmissionLoop``'s positional arguments after the controller."""
    return OldestFirstBuffer(1), lambda n: n, None, 0.01


def loop_keywords() -> dict:
    """The same by keyword, with the store."""
    return dict(
        zip(("buffer", "submit", "accept", "poll_interval"), loop_args(), strict=True), store=InMemoryTransferQueue()
    )


@pytest.mark.parametrize("module", ["areal_plugins", "areal_plugins.hooks.contracts"])
def test_the_contract_s_old_name_imports_with_a_warning_naming_the_new_one(module):
    namespace: dict = {}
    with pytest.warns(
        DeprecationWarning, match=rf"{module}\.AdmissionCounters is deprecated: .*StalenessControllerLike"
    ):
        exec(compile(f"from {module} import AdmissionCounters", __file__, "exec"), namespace)
    assert namespace["AdmissionCounters"] is StalenessControllerLike is areal_plugins.StalenessControllerLike
    assert "AdmissionCounters" not in areal_plugins.__all__ and "StalenessControllerLike" in areal_plugins.__all__
    assert isinstance(controller(), namespace["AdmissionCounters"])  # still a runtime-checkable Protocol


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'AdmissionCountres'"):
        areal_plugins.AdmissionCountres  # noqa: B018


def test_the_new_names_warn_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        given = controller()
        loop = AdmissionLoop(given, *loop_args(), store=InMemoryTransferQueue())
        assert staleness_controller_of(loop) is loop.staleness_controller is given
        loop = AdmissionLoop(staleness_controller=given, **loop_keywords())
        assert loop.staleness_controller is given


def test_the_loop_takes_the_old_keyword_with_a_warning():
    given = controller()
    with pytest.warns(
        DeprecationWarning, match=r"AdmissionLoop\(controller=\.\.\.\) is deprecated: pass staleness_controller="
    ) as caught:
        loop = AdmissionLoop(controller=given, **loop_keywords())
    assert loop.staleness_controller is given
    assert {Path(w.filename).name for w in caught} == {Path(__file__).name}, "the warning points at the call"
    with pytest.raises(TypeError, match="both staleness_controller= and its deprecated name controller="):
        AdmissionLoop(staleness_controller=given, controller=given, **loop_keywords())


def test_the_loop_s_old_attribute_reads_and_sets_the_new_one_with_a_warning():
    loop = AdmissionLoop(controller(), *loop_args(), store=InMemoryTransferQueue())
    with pytest.warns(DeprecationWarning, match=r"AdmissionLoop\.controller is deprecated: .*staleness_controller"):
        assert loop.controller is loop.staleness_controller
    other = controller()
    with pytest.warns(DeprecationWarning, match=r"AdmissionLoop\.controller is deprecated"):
        loop.controller = other
    assert loop.staleness_controller is other


class ManagerBeforeTheRename:
    """A third-party manager written against the old contract: its counts are ``controller``."""

    last_progress = 0.0
    failed_groups = reissued_groups = reissued_stale_groups = dropped_stale_groups = rejected_trajectories = 0

    def __init__(self, running: int) -> None:
        self.controller = controller()
        self.controller.on_submit(running)

    def check_alive(self) -> None:  # a group finishes at each look
        self.controller.on_accept()

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self, version: int) -> None: ...
    def suspend_polling(self) -> None: ...
    def quiesce(self) -> None: ...
    def drop_stale(self, groups: list) -> None: ...
    def reissue_stale(self, groups: list) -> None: ...


class EmptyBuffer:
    over_stale_kept = 0

    def __len__(self) -> int:
        return 0


def test_a_manager_with_the_old_attribute_meets_the_contract_and_the_driver_reads_it_with_a_warning():
    manager = ManagerBeforeTheRename(running=3)
    assert missing_members(manager, RolloutManager) == []
    require_contract(manager, RolloutManager, "areal_make_rollout_manager")
    with pytest.warns(DeprecationWarning, match=r"ManagerBeforeTheRename\.controller is deprecated: .*staleness_contr"):
        assert staleness_controller_of(manager) is manager.controller
    with pytest.warns(DeprecationWarning, match="ManagerBeforeTheRename.controller is deprecated"):
        metrics = admission_metrics(manager, EmptyBuffer())
    assert metrics["areal/running"] == 3.0
    with pytest.warns(DeprecationWarning, match="ManagerBeforeTheRename.controller is deprecated"):
        wait_for_in_flight(manager, check=lambda: None, poll_s=0.0, sleep=lambda s: None)
    assert manager.controller.running == 0 and manager.controller.accepted == 3


def test_a_manager_with_neither_name_is_refused_naming_the_new_one():
    bare = SimpleNamespace()
    assert "staleness_controller" in missing_members(bare, RolloutManager)
    with pytest.raises(AttributeError, match="staleness_controller"):
        staleness_controller_of(bare)
