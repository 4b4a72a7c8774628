"""When ``areal-plugins train --max-restarts N`` restarts a failed run, and when it gives up."""

from __future__ import annotations

import signal

import pytest

from areal_plugins.cli.restarts import MAX_BACKOFF_S, Attempt, RestartPolicy, latest_checkpoint


def failed(error: str = "RuntimeError: worker died", checkpoint: int | None = 2) -> Attempt:
    return Attempt(code=1, user_signal=None, last_error=error, checkpoint=checkpoint)


def test_a_failure_is_restarted_with_a_doubling_back_off_until_none_are_left():
    policy = RestartPolicy(max_restarts=3, backoff_s=10)
    waits = [policy.next_restart(failed(checkpoint=step))[0] for step in (1, 2, 3)]
    assert waits == [10, 20, 40]
    wait, why = policy.next_restart(failed(checkpoint=4))
    assert wait is None and "no restarts left (--max-restarts 3)" in why


def test_the_back_off_is_capped():
    policy = RestartPolicy(max_restarts=20, backoff_s=10)
    waits = [policy.next_restart(failed(checkpoint=step))[0] for step in range(12)]
    assert max(waits) == MAX_BACKOFF_S == waits[-1]


def test_the_same_error_twice_without_a_new_checkpoint_stops_for_good():
    policy = RestartPolicy(max_restarts=5)
    assert policy.next_restart(failed(checkpoint=2))[0] is not None
    wait, why = policy.next_restart(failed(checkpoint=2))
    assert wait is None and "the same error twice in a row" in why


def test_the_same_error_after_progress_or_another_error_is_restarted():
    policy = RestartPolicy(max_restarts=5)
    policy.next_restart(failed(checkpoint=2))
    assert policy.next_restart(failed(checkpoint=3))[0] is not None  # new checkpoint: it got further
    assert policy.next_restart(failed("OOM", checkpoint=3))[0] is not None  # another cause


@pytest.mark.parametrize(
    "attempt",
    [
        Attempt(code=0, user_signal=None, last_error=None, checkpoint=4),
        Attempt(code=130, user_signal=signal.SIGINT, last_error=None, checkpoint=2),
        Attempt(code=143, user_signal=signal.SIGTERM, last_error="KeyboardInterrupt", checkpoint=2),
    ],
    ids=["finished", "ctrl-c", "sigterm"],
)
def test_a_finished_run_or_one_its_user_stopped_is_never_restarted(attempt):
    assert RestartPolicy(max_restarts=5).next_restart(attempt)[0] is None


def test_the_checkpoint_is_read_from_verls_marker(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    assert latest_checkpoint(tmp_path) == 7


def test_restarts_without_checkpoints_are_refused_at_startup(tmp_path, caplog):
    from pathlib import Path

    from areal_plugins.cli.launch import REFUSED_EXIT_CODE, train

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "grpo_cpu_async.yaml"
    code = train(recipe, ["trainer.save_freq=-1"], tmp_path / "run", tmp_path / "tiny", max_restarts=2)
    assert code == REFUSED_EXIT_CODE
    assert "set trainer.save_freq to a number of steps" in caplog.text
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_a_signal_between_two_attempts_cancels_the_restart_at_once():
    import os
    import time

    from areal_plugins.cli.restarts import SignalLatch

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        latch = SignalLatch()
        latch.install()
        assert latch.wait(0.1) is None  # nothing came: the full back-off is waited out
        os.kill(os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        assert latch.wait(60) == signal.SIGTERM
        assert time.monotonic() - started < 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_the_cause_named_is_our_error_not_what_ray_printed_while_tearing_down(tmp_path):
    """Our WeightSyncError, then an engine dying as Ray tears the job down (that order varies from run to run)."""
    from types import SimpleNamespace

    from areal_plugins.cli.bounded_log import BoundedLog
    from areal_plugins.cli.launch import follow_output

    lines = [
        "(TaskRunnerV1 pid=1) ray.exceptions.RayTaskError(WeightSyncError): ray::TaskRunnerV1.run() (pid=1)\n",
        "areal_plugins.weight_sync.errors.WeightSyncError: rollout replica 0: tensor w arrived different\n",
        "(EngineCore pid=2) vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n",
    ]
    with BoundedLog(tmp_path / "train.log") as log:
        cause = follow_output(SimpleNamespace(stdout=iter(lines)), log, "4", 0.0)
    assert cause == (
        "areal_plugins.weight_sync.errors.WeightSyncError: rollout replica 0: tensor w arrived different "
        "(the last error printed: vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.)"
    )
    with BoundedLog(tmp_path / "other.log") as log:  # none of ours: the last error line, as before
        cause = follow_output(SimpleNamespace(stdout=iter(lines[2:])), log, "4", 0.0)
    assert cause.startswith("vllm.v1.engine.exceptions.EngineDeadError")


def test_our_error_behind_rays_coloured_prefix_is_named_not_the_actor_death_after_it(tmp_path):
    """Ray colours its ``(Actor pid=N)`` prefix in some setups: the CI stall-guard run printed the guard's stop as
    below, then the ActorDiedError of the teardown, and the restart line named the latter."""
    from types import SimpleNamespace

    from areal_plugins.cli.bounded_log import BoundedLog
    from areal_plugins.cli.launch import follow_output

    stall = "areal_plugins.driver.watchdog.TrainerStalledError: areal watchdog: a trainer worker (update) is stuck"
    lines = [
        f"Training:  40%|####      | 2/5\r\x1b[36m(TaskRunnerV1 pid=1595)\x1b[0m {stall}\n",  # after a redrawn bar
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n",
    ]
    with BoundedLog(tmp_path / "train.log") as log:
        cause = follow_output(SimpleNamespace(stdout=iter(lines)), log, "2", 0.0)
    assert cause is not None and cause.startswith(stall), cause
