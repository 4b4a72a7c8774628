"""The trainer's phase boundaries: a stop request is honoured inside a step, the first weight sync is watched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_plugins.driver.supervision import Supervisor
from areal_plugins.driver.watchdog import TrainerStalledError
from areal_plugins.records.control_files import STOP_REQUEST_FILE, RunStoppedOnRequestError


def trainer_stub(tmp_path, requested: bool, calls: list) -> SimpleNamespace:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if requested:
        (run_dir / STOP_REQUEST_FILE).write_text("SIGINT\n")

    def stop(done=None):
        calls.append(("stop", done))
        raise RunStoppedOnRequestError("stopped")

    return SimpleNamespace(
        recorder=SimpleNamespace(run_dir=run_dir),
        _write_step_line=lambda metrics, timing, step, now: calls.append(("step line", step)),
        _stop_on_request=stop,
        _step_metrics={},
        timing_raw={},
        global_steps=7,
    )


@pytest.mark.parametrize("trained", [True, False])
def test_a_request_stops_at_the_boundary_checkpointing_what_is_trained(tmp_path, trained):
    """After step 7's update, step 7 is trained: its line is written and it is the step checkpointed. After its
    old log-probs only step 6 is (the default: global_steps - 1)."""
    from areal_plugins.driver.async_trainer import ArealAsyncTrainer

    calls: list = []
    stub = trainer_stub(tmp_path, True, calls)
    with pytest.raises(RunStoppedOnRequestError):
        ArealAsyncTrainer._stop_at_boundary(stub, trained=trained)
    assert calls == ([("step line", 7), ("stop", 7)] if trained else [("stop", None)])


def test_no_request_no_stop(tmp_path):
    from areal_plugins.driver.async_trainer import ArealAsyncTrainer

    calls: list = []
    ArealAsyncTrainer._stop_at_boundary(trainer_stub(tmp_path, False, calls), trained=True)
    assert calls == []


def test_the_stop_checkpoints_the_step_it_is_given(tmp_path):
    from areal_plugins.driver.async_trainer import ArealAsyncTrainer

    saved: list[int] = []
    stub = SimpleNamespace(
        config=SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path), save_freq=10)),
        global_steps=7,
        _save_checkpoint_of=saved.append,
    )
    with pytest.raises(RunStoppedOnRequestError, match="after step 7; a checkpoint of step 7 was saved"):
        ArealAsyncTrainer._stop_on_request(stub, done=7)
    with pytest.raises(RunStoppedOnRequestError, match="after step 6"):
        ArealAsyncTrainer._stop_on_request(stub)
    assert saved == [7, 6]


def supervisor() -> Supervisor:
    pool = SimpleNamespace(survivable=lambda actor: False)
    stats = SimpleNamespace(pool=pool, last_reading=None)
    trainer = SimpleNamespace(global_steps=0)
    return Supervisor(trainer, 3600.0, stats, SimpleNamespace(run_dir=None), stop_on_request=lambda: None)  # type: ignore[arg-type]


def test_a_hang_in_the_first_weight_sync_is_named_by_the_guard(monkeypatch):
    """on_init_end runs before the run's guard starts; the first sync has its own. When that guard stops the
    run, the error raised is its reason, not the interrupt (or Ray's cancelled task) it caused."""
    from areal_plugins.driver.async_trainer import ArealAsyncTrainer

    guarded = supervisor()
    monkeypatch.setattr("areal_plugins.driver.watchdog.StallGuard.start", lambda self: None)

    def hung_sync(version):
        guarded.stall_guard.fired = "areal watchdog: nothing moved for 3575 s in the first weight sync"
        raise RuntimeError("ray.exceptions.TaskCancelledError")  # what Ray raises under the guard's interrupt

    stub = SimpleNamespace(supervisor=guarded, weight_sync=SimpleNamespace(update_weights=hung_sync), global_steps=0)
    with pytest.raises(TrainerStalledError, match="first weight sync"):
        ArealAsyncTrainer.on_init_end(stub)
    assert guarded.stall_guard.phase == "first weight sync"


def test_after_the_first_sync_the_guard_is_off_until_training_starts(monkeypatch):
    guarded = supervisor()
    monkeypatch.setattr("areal_plugins.driver.watchdog.StallGuard.start", lambda self: None)
    with guarded.watching("first weight sync"):
        assert guarded.stall_guard is not None and guarded.stall_guard.phase == "first weight sync"
    assert guarded.stall_guard is None  # verl's setup between init and fit is not judged
    guarded.stalled(KeyboardInterrupt())  # no guard fired: nothing to say
