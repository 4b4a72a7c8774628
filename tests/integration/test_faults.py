"""Faults inside a real run: a trainer worker that raises stops the run with its own error, checkpoints kept."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import run_cli, train_args, train_tiny, with_example_plugin

pytestmark = pytest.mark.integration


def test_a_trainer_worker_error_stops_the_run_with_its_own_error_and_every_finished_step_saved(tiny_dir, tmp_path):
    run_dir, observer_log = tmp_path / "run", tmp_path / "observer.jsonl"
    plugin_env = with_example_plugin(
        AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_AFTER="2",  # the trainer workers' loss fails at its 3rd call
        AREAL_EXAMPLE_OBSERVER_REWARD="quarter",  # and a third party's reward scores every rollout 0.25
        AREAL_EXAMPLE_OBSERVER_LOG=str(observer_log),
    )
    # The loss is called once per micro-batch: the recipe's fixed micro-batches (two per step) make its 3rd call
    # fall in step 2, after step 1 was checkpointed; token-budget ones would vary in number with the lengths.
    fixed_micro_batches = "areal.micro_batch.max_tokens=null"
    result = run_cli(
        *train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, 4, "trainer.save_freq=1", fixed_micro_batches),
        env=plugin_env,
        check=False,
    )
    assert result.returncode != 0
    log = (run_dir / "train.log").read_text()
    assert "hit a NaN (deliberate)" in log and "FloatingPointError" in log  # the worker's own error
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    completed = [m["step"] for m in metrics]
    # Every trained sample was scored by the plugin's function (through areal_make_reward_fn, in the
    # reward service's worker processes), not by the built-in math-verify reward.
    assert all(m["data"]["critic/score/min"] == m["data"]["critic/score/max"] == 0.25 for m in metrics)
    assert any(json.loads(line)["event"] == "reward" for line in observer_log.read_text().splitlines())
    latest = int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert latest >= 1 and latest == max(completed)  # every completed step was saved, the failed one not
    # That a checkpoint saved before a failure resumes is test_cluster.py's (a lost node) and, in the full
    # tier, test_resume.py's (SIGKILL): a third resume here would cost CI another verl start.
    assert (run_dir / "checkpoints" / f"global_step_{latest}" / "areal_state.json").exists()


def test_a_failed_rollout_group_is_reissued_and_trained_not_lost(tiny_dir, tmp_path):
    """A group whose agent loop raises is sent again from the prompt verl keeps, not dropped as rejected; the
    run's sample buffer is a third party's (the plugin guide's conformance-kit example)."""
    import os

    from tests.integration.conftest import read_jsonl

    run_dir, markers, takes = tmp_path / "run", tmp_path / "failed_prompts", tmp_path / "fifo_takes.jsonl"
    submissions = tmp_path / "steady_submissions.jsonl"
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text(
        "- name: fail_first_attempt\n"
        "  _target_: flaky_agent_loop.FailFirstAttemptAgentLoop\n"
        f"  marker_dir: {markers}\n"
        "  failures: 3\n"
    )
    # η = 0: the first step needs all 16 groups of its batch, the re-issued ones included (they keep their
    # slots and nothing else is admitted), so "trained" does not depend on timing; at η > 0 a re-issued group
    # generated under newer weights may still be buffered when the run ends.
    train_tiny(
        "grpo_cpu_async.yaml",
        run_dir,
        tiny_dir,
        2,
        "areal.max_staleness=0",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=fail_first_attempt",
        # The sample buffer and the rollout manager of a third party, written from the plugin guide alone
        # (docs_only_fifo_buffer.py, docs_only_steady_manager.py).
        "areal.plugins.include=[fifo_buffer,steady_manager]",
        env=with_example_plugin(AREAL_FIFO_BUFFER_LOG=str(takes), AREAL_STEADY_MANAGER_LOG=str(submissions)),
    )
    # Every trained group went through the guide's buffer: the driver used it for both steps.
    assert [(t["version"], len(t["groups"])) for t in read_jsonl(takes)] == [(0, 16), (1, 16)]
    failed = sorted(os.listdir(markers))  # the agent loop's own record of the prompts it failed once
    assert len(failed) == 3
    assert "deliberate failure of the first attempt" in (run_dir / "train.log").read_text()
    reissued = sorted(uid for line in read_jsonl(run_dir / "areal_reissued.jsonl") for uid in line["uids"])
    assert reissued == failed
    drawn = [uid for line in read_jsonl(run_dir / "areal_submissions.jsonl") for uid in line["uids"]]
    assert all(drawn.count(uid) == 1 for uid in failed)  # sent again, not drawn again from the dataloader
    # Every prompt was submitted by the guide's manager, never more than 4 at once (its one change).
    counts = [line["count"] for line in read_jsonl(submissions)]
    assert sum(counts) == len(drawn) and max(counts) <= 4, counts
    first_step = {sample["group"] for sample in read_jsonl(run_dir / "areal_samples.jsonl") if sample["step"] == 1}
    assert set(failed) <= first_step, "a re-issued prompt was not trained with its batch"
    (accounting,) = read_jsonl(run_dir / "areal_accounting.jsonl")
    assert (accounting["rejected"], accounting["failed_groups"], accounting["reissued_groups"]) == (0, 3, 3)


def test_a_killed_cpu_rollout_server_stops_the_run_naming_it_instead_of_spinning(tiny_dir, tmp_path):
    """The areal_cpu server is not restarted: its death must end the run with a reason, within the watchdog."""
    import signal
    import time

    import psutil

    from tests.integration.conftest import cli_output, kill_tree, read_jsonl, start_cli

    run_dir = tmp_path / "run"
    watchdog_s = 120
    process = start_cli(*train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, 6, f"areal.watchdog_s={watchdog_s}"))
    try:
        deadline = time.monotonic() + 600
        while len(read_jsonl(run_dir / "areal_steps.jsonl")) < 1:
            assert process.poll() is None and time.monotonic() < deadline, f"no step 1:\n{cli_output(process)}"
            time.sleep(0.5)
        servers = [
            p for p in psutil.process_iter(["cmdline"]) if "CPURolloutServer" in " ".join(p.info["cmdline"] or [])
        ]
        assert servers, "no CPURolloutServer actor process found"
        for server in servers:
            server.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = process.wait(timeout=watchdog_s + 120)
        stopped_after = time.monotonic() - killed
    finally:
        if process.poll() is None:
            kill_tree(process)
    log = (run_dir / "train.log").read_text()
    assert code != 0
    assert stopped_after < watchdog_s + 60, f"the run took {stopped_after:.0f} s to stop"
    assert "rollout server" in log and ("died" in log or "in a row failed" in log), log[-3000:]
    assert (run_dir / "train.log").stat().st_size < 20_000_000  # no error loop filling the disk


def test_ctrl_c_checkpoints_and_stops_the_run_within_seconds_leaving_no_process(tiny_dir, tmp_path):
    import os
    import signal
    import time

    import psutil

    from tests.integration.conftest import cli_output, kill_tree, read_jsonl, run_processes, start_cli

    run_dir = tmp_path / "run"
    # Checkpoints every 5 steps: the stop checkpoints the last finished step on its way out.
    cli = start_cli(*train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, 20, "trainer.save_freq=5"))
    try:
        deadline = time.monotonic() + 600
        while len(read_jsonl(run_dir / "areal_steps.jsonl")) < 1:
            assert cli.poll() is None and time.monotonic() < deadline, f"no step 1:\n{cli_output(cli)}"
            time.sleep(0.5)
        processes = run_processes(cli)  # this run's, not other processes on the machine
        assert len(processes) >= 5, [p.name() for p in processes]  # driver, Ray's head, trainer, engine, ...
        os.killpg(cli.pid, signal.SIGINT)  # what Ctrl-C delivers to the foreground process group
        interrupted = time.monotonic()
        code = cli.wait(timeout=120)
        stopped_after = time.monotonic() - interrupted
    finally:
        if cli.poll() is None:
            kill_tree(cli)
    assert code == 128 + signal.SIGINT
    assert stopped_after < 45, f"Ctrl-C took {stopped_after:.0f} s to stop the run"
    trained = len(read_jsonl(run_dir / "areal_steps.jsonl"))
    latest = int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert latest == trained >= 1  # not step 5's periodic one: the stop saved the last finished step
    assert f"stopped on request (Ctrl-C or SIGTERM) after step {trained}" in (run_dir / "train.log").read_text()
    psutil.wait_procs(processes, timeout=15)  # the run's own processes exit as the CLI's cleanup reaches them
    left = []
    for process in processes:  # is_running() also compares the start time: a reused pid is not this process
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline())[:120])
        except psutil.NoSuchProcess:
            continue
    assert not left, left
