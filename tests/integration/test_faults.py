"""Faults inside a real run: what stops it, what it recovers from, and what it tells the user."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.conftest import train_args, train_tiny, with_example_plugin

pytestmark = pytest.mark.integration


def restart_then_finish(process, run_dir, deadline: float) -> tuple[list[dict], int, str]:
    """Wait for the CLI's first restart line, take the records the failed attempt left (during the 10 s back-off),
    then wait for the end: (the failed attempt's samples, exit code, the CLI's output)."""
    from tests.integration.conftest import cli_output, kill_tree, read_jsonl

    try:
        while "restart 1/1" not in cli_output(process, last=20000):
            assert process.poll() is None and time.monotonic() < deadline, f"no restart:\n{cli_output(process)}"
            time.sleep(0.2)
        failed_attempt = read_jsonl(run_dir / "areal_samples.jsonl")
        code = process.wait(timeout=1200)
    finally:
        if process.poll() is None:
            kill_tree(process)
    return failed_attempt, code, cli_output(process, last=20000)


def assert_each_group_trained_once(failed_attempt: list[dict], run_dir, steps: int, checkpoint: int) -> None:
    """Steps up to ``checkpoint`` come from the failed attempt, the later ones from the resumed one; every prompt
    group of the recipe (16 per step) is trained, none twice across the restart."""
    from tests.integration.conftest import read_jsonl

    resumed = read_jsonl(run_dir / "areal_samples.jsonl")[len(failed_attempt) :]
    assert {s["step"] for s in resumed} == set(range(checkpoint + 1, steps + 1))
    trained = {(s["step"], s["group"]) for s in failed_attempt if s["step"] <= checkpoint}
    trained |= {(s["step"], s["group"]) for s in resumed}
    groups = [group for _, group in trained]
    assert len(trained) == steps * 16
    assert len(groups) == len(set(groups)), "a prompt group was trained twice across the restart"


@pytest.mark.full
def test_a_trainer_worker_error_is_named_and_the_run_resumes_by_itself_training_each_group_once(tiny_dir, tmp_path):
    """``--max-restarts 1``: a third party's policy loss (the example plugin's) raises once in the trainer worker, in
    step 3, after step 2 was checkpointed. The CLI's restart line names the worker's own error; verl restarts from
    the step-2 checkpoint and trains all four steps, each prompt group once, every reward scored by the plugin's
    reward function (through ``areal_make_reward_fn``, in the reward workers)."""
    import time

    from tests.integration.conftest import read_jsonl, start_cli

    run_dir, steps, observer_log = tmp_path / "run", 4, tmp_path / "observer.jsonl"
    plugin_env = with_example_plugin(
        # The loss is called once per micro-batch: the recipe's fixed micro-batches (two per step) put its 5th call
        # in step 3; token-budget ones would vary in number with the lengths.
        AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_AFTER="4",
        AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_ONCE=str(tmp_path / "loss_failed"),  # the restarted run does not fail
        AREAL_EXAMPLE_OBSERVER_REWARD="quarter",  # a third party's reward: every rollout scores 0.25
        AREAL_EXAMPLE_OBSERVER_LOG=str(observer_log),
    )
    args = train_args(
        "grpo_cpu_async.yaml", run_dir, tiny_dir, steps, "trainer.save_freq=1", "areal.micro_batch.max_tokens=null"
    )
    process = start_cli(*args, "--max-restarts", "1", env=plugin_env)
    failed_attempt, code, output = restart_then_finish(process, run_dir, time.monotonic() + 900)
    assert code == 0, output[-3000:]
    (restart_line,) = [line for line in output.splitlines() if "restart 1/1" in line]
    assert "FloatingPointError" in restart_line and "hit a NaN (deliberate)" in restart_line, restart_line
    assert "resuming from the checkpoint of step 2" in restart_line, restart_line
    # Every step saved (save_freq=1) with our state; the failed attempt logged steps 1-2, the resumed one 3-4, all
    # in the run's one metrics.jsonl (nothing kept aside).
    saved = sorted(int(path.name.rsplit("_", 1)[1]) for path in (run_dir / "checkpoints").glob("global_step_*"))
    assert saved == list(range(1, steps + 1))
    assert all((run_dir / "checkpoints" / f"global_step_{s}" / "areal_state.json").exists() for s in saved)
    assert not list(run_dir.glob("metrics.before-*.jsonl"))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["data"]["critic/score/min"] == m["data"]["critic/score/max"] == 0.25 for m in metrics)
    assert any(record["event"] == "reward" for record in read_jsonl(observer_log))
    assert_each_group_trained_once(failed_attempt, run_dir, steps, checkpoint=2)


@pytest.mark.full
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


@pytest.mark.full
def test_a_killed_cpu_rollout_server_stops_the_run_naming_it_instead_of_spinning(tiny_dir, tmp_path):
    """The areal_cpu server is not restarted: its death must end the run with a reason, within the watchdog."""
    import time

    from tests.integration.conftest import cli_output, kill_tree, read_jsonl, sigkill_processes_running, start_cli

    run_dir = tmp_path / "run"
    watchdog_s = 120
    process = start_cli(*train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, 6, f"areal.watchdog_s={watchdog_s}"))
    try:
        deadline = time.monotonic() + 600
        while len(read_jsonl(run_dir / "areal_steps.jsonl")) < 1:
            assert process.poll() is None and time.monotonic() < deadline, f"no step 1:\n{cli_output(process)}"
            time.sleep(0.5)
        assert sigkill_processes_running("CPURolloutServer"), "no CPURolloutServer actor process found"
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


@pytest.mark.full
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


# The same restart, after a process death instead of an error.
@pytest.mark.full
def test_a_trainer_worker_killed_once_is_resumed_automatically_and_the_run_finishes(tiny_dir, tmp_path):
    """``--max-restarts 1``: the trainer's worker process is SIGKILLed after the step-2 checkpoint; the CLI names
    the failure, restarts verl from that checkpoint by itself, and the run trains all of its steps, each prompt
    group once."""
    import time

    from tests.integration.conftest import cli_output, kill_tree, sigkill_processes_running, start_cli

    run_dir, steps = tmp_path / "run", 4
    marker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    process = start_cli(
        *train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, steps, "trainer.save_freq=1"), "--max-restarts", "1"
    )
    try:
        deadline = time.monotonic() + 900
        while not (marker.exists() and marker.read_text().strip() == "2"):
            assert process.poll() is None and time.monotonic() < deadline, (
                f"no step-2 checkpoint:\n{cli_output(process)}"
            )
            time.sleep(0.2)
        assert sigkill_processes_running("ray::WorkerDict"), "no trainer worker process (ray::WorkerDict) found"
    except BaseException:
        kill_tree(process)
        raise
    killed_attempt, code, output = restart_then_finish(process, run_dir, deadline)
    assert code == 0, output[-3000:]
    assert "resuming from the checkpoint of step 2" in output, output[-3000:]
    # Every step trained and saved (save_freq=1); the resumed attempt logged the steps after the checkpoint, after
    # the killed one's in the same metrics.jsonl (its step 2 may lack a line: verl saves a step before it logs it).
    saved = sorted(int(path.name.rsplit("_", 1)[1]) for path in (run_dir / "checkpoints").glob("global_step_*"))
    assert saved == list(range(1, steps + 1))
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged in ([1, 2, 3, 4], [1, 3, 4]), logged
    assert_each_group_trained_once(killed_attempt, run_dir, steps, checkpoint=2)


def test_a_step_longer_than_the_watchdog_trains_and_a_hung_worker_is_stopped_within_it_then_resumed(tiny_dir, tmp_path):
    """``areal.watchdog_s=20`` on steps whose update alone computes for longer: eight fixed micro-batches of at
    least 3 s each (the trainer-slowed test knob; a 7B step of tens of minutes in kind). Step 1 trains: every
    micro-batch counts as progress. In step 2 the example plugin's loss hangs once: the stall guard stops that
    attempt within ``watchdog_s`` of the last progress, the CLI's restart line names the guard's reason, and the
    resumed run trains step 2 to the end (``--max-restarts 1``)."""
    from tests.integration.conftest import cli_output, read_jsonl, start_cli

    run_dir, steps, watchdog_s, delay_s, micro_batches = tmp_path / "run", 2, 20, 3.0, 8
    plugin_env = with_example_plugin(
        AREAL_TEST_TRAINER_MICROBATCH_DELAY_S=str(delay_s),
        AREAL_EXAMPLE_OBSERVER_LOSS_HANGS_AFTER=str(micro_batches),  # its 9th call: step 2's first micro-batch
        AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_ONCE=str(tmp_path / "hung_once"),  # the resumed attempt does not hang
    )
    args = train_args(
        "grpo_cpu_async.yaml",
        run_dir,
        tiny_dir,
        steps,
        f"areal.watchdog_s={watchdog_s}",
        "trainer.save_freq=1",
        # verl's fixed micro-batches: 16 prompts x 8 answers in micro-batches of 16, one loss call each.
        "areal.micro_batch.max_tokens=null",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={128 // micro_batches}",
    )
    process = start_cli(*args, "--max-restarts", "1", env=plugin_env)
    deadline = time.monotonic() + 900
    while len(read_jsonl(run_dir / "areal_steps.jsonl")) < 1:
        assert process.poll() is None and time.monotonic() < deadline, f"no step 1:\n{cli_output(process)}"
        time.sleep(0.2)
    while "TrainerStalledError" not in (run_dir / "train.log").read_text():
        assert process.poll() is None and time.monotonic() < deadline, f"no stall:\n{cli_output(process)}"
        time.sleep(0.2)
    # The hang began when the plugin's loss made its marker file; the guard's report must follow within the
    # watchdog (its limit after the last micro-batch began, plus one look). The teardown after it (the interrupt's
    # grace, Ray's shutdown) is not the guard's and is not timed: over a minute on a busy box.
    fired_after_hang = time.time() - (tmp_path / "hung_once").stat().st_mtime
    failed_attempt, code, output = restart_then_finish(process, run_dir, deadline)
    assert code == 0, output[-3000:]
    (restart_line,) = [line for line in output.splitlines() if "restart 1/1" in line]
    assert "TrainerStalledError" in restart_line and "is stuck" in restart_line, restart_line
    assert fired_after_hang < watchdog_s, f"the guard fired {fired_after_hang:.0f} s into the hang"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    # Each step's update took longer than the watchdog, by verl's own timer: the guard let both run.
    updates = [m["data"]["timing_s/update_actor"] for m in metrics]
    assert all(update > watchdog_s for update in updates), updates
    assert_each_group_trained_once(failed_attempt, run_dir, steps, checkpoint=1)


def test_a_dead_replica_of_two_costs_capacity_not_the_run(tiny_dir, tmp_path):
    """``placement: separate`` with two areal_cpu replicas: one server is SIGKILLed just after the engines resumed
    generating under version 3, after step 3 (the admission loop has new groups to send then, so requests are in
    flight on it). Its requests continue on the other replica, the run drops it (load balancer, weight sync,
    statistics) and goes on training, each prompt group once, none lost. A replacement starts on the freed device,
    takes the weights of the next sync like the survivor (the same checksum) and only then requests. The run is
    stopped (the CLI's stop request) once the replacement has generated under a version it was synced: its
    joining is waited for, not raced against a fixed number of steps."""
    import os
    import time

    from tests.integration.conftest import cli_output, kill_tree, read_jsonl, sigkill_processes_running, start_cli

    # At most 40 steps: the replacement takes about a minute to start (it joined at version 8 in CI rehearsals);
    # the run stops at the first step boundary after it served, so it rarely gets far.
    run_dir, most_steps, killed_after = tmp_path / "run", 40, 3
    two_replicas = ("actor_rollout_ref.rollout.n_gpus_per_node=2", "ray_kwargs.ray_init.num_gpus=3")
    # The trainer on verl's default engine, FSDP1: its updates reach the engines' own pool through areal_gloo's
    # stages (the observed run, test_plugins_in_a_run.py, covers FSDP1 colocated).
    fsdp1 = ("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.ref.strategy=fsdp")
    # Requests are in flight at the kill by construction: every model step of the engines takes at least 0.25 s, so
    # an answer of more than 4 tokens begun after the resume is still being generated 1 s later, on any machine.
    slow_engines = dict(os.environ, AREAL_TEST_ENGINE_STEP_DELAY_S="0.25")
    process = start_cli(
        *train_args("grpo_cpu_async_separate.yaml", run_dir, tiny_dir, most_steps, *two_replicas, *fsdp1),
        env=slow_engines,
    )

    def replica_events() -> list[dict]:
        return read_jsonl(run_dir / "replica_events.jsonl")

    def replacement_generated() -> bool:  # an update of replica 2 that found tokens it generated since the last one
        return any(e["event"] == "update" and e["replica"] == 2 and e["generated_tokens"] > 0 for e in replica_events())

    try:
        deadline = time.monotonic() + 1200

        def serving_version(version: int) -> int:
            return sum(e["event"] == "resume" and e.get("version") == version for e in replica_events())

        while serving_version(killed_after) < 2:  # both replicas
            assert process.poll() is None and time.monotonic() < deadline, f"no version 3:\n{cli_output(process)}"
            time.sleep(0.1)
        time.sleep(1.0)  # the admission loop sends its next groups
        assert sigkill_processes_running("ray::CPURolloutServer", at_most=1) == 1
        while not replacement_generated():
            assert process.poll() is None and time.monotonic() < deadline, (
                f"the replacement never generated under a synced version:\n{cli_output(process)}"
            )
            time.sleep(0.2)
        (run_dir / "areal_stop_requested").write_text("test\n")  # what the CLI's Ctrl-C writes (cli/control.py)
        code = process.wait(timeout=600)
    finally:
        if process.poll() is None:
            kill_tree(process)
    output = cli_output(process, last=20000)
    log = (run_dir / "train.log").read_text()
    # The stop lands at a phase boundary: in the batch wait (the last finished step is the last verl logged) or
    # after a step's update or weight sync (that step is trained and in our step record, areal_steps.jsonl; verl
    # logs its metrics line only at the step's end, which the stop skips). Either way our record names it.
    steps = len(read_jsonl(run_dir / "areal_steps.jsonl"))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert len(metrics) in (steps - 1, steps), (len(metrics), steps)
    assert steps < most_steps and code != 0, output[-3000:]  # stopped by the request, not by the step count
    assert f"stopped on request (Ctrl-C or SIGTERM) after step {steps}" in log, output[-3000:]
    assert "its requests continue on another replica" in log  # some were in flight
    lost = [e for e in replica_events() if e["event"] == "lost"]
    # Every update went through the workers' stages while the engines generated (areal_gloo stages), then paused
    # them for the load alone: one record per version, the whole model kept by each worker. The stop comes at a
    # step boundary: after step ``steps``'s update (its sync not made) or after its sync.
    transfers = read_jsonl(run_dir / "weight_transfers.jsonl")
    synced = [t["version"] for t in transfers]
    assert synced in (list(range(steps)), list(range(steps + 1))), synced
    assert all(t["staged_bytes_per_worker"] > 0 and t["engines_paused_s"] >= 0 for t in transfers), transfers
    assert "'strategy': 'fsdp'," in log and "'strategy': 'fsdp2'" not in log  # verl's resolved config, printed
    assert len(lost) == 1 and lost[0]["replicas_left"] == 1, lost
    assert metrics[0]["data"]["areal/rollout_replicas"] == 2 and metrics[-1]["data"]["areal/rollout_replicas"] == 2
    assert metrics[-1]["data"]["areal/rollout_replicas_replaced"] == 1
    # Every weight version reached the surviving replica, each checked.
    survivor = 1 - lost[0]["replica"]
    syncs = [e for e in read_jsonl(run_dir / "weight_syncs.jsonl") if e["event"] == "update"]
    updates = [e for e in syncs if e.get("replica") == survivor]
    assert sorted({e["version"] for e in updates}) == synced
    # The replacement (replica 2) joined at a sync after the loss, then took every later version, each with the
    # survivor's checksum, and generated tokens while it served (its first update finds none generated).
    events = replica_events()
    (joined,) = [e for e in events if e["event"] == "joined"]
    assert joined["replaces"] == lost[0]["replica"] and joined["replica"] == 2
    assert killed_after < joined["version"] < synced[-1]
    by_version = {e["version"]: e["checksum"] for e in updates}
    replacement = [e for e in syncs if e.get("replica") == 2]
    assert [e["version"] for e in replacement] == list(range(joined["version"], synced[-1] + 1))
    assert all(e["checksum"] == by_version[e["version"]] for e in replacement)
    generated = [e["generated_tokens"] for e in events if e["event"] == "update" and e["replica"] == 2]
    assert generated[0] == 0 and max(generated) > 0, generated
    # No prompt lost, none trained twice: counted from the records of what was drawn and what was trained. The
    # batch of a step the stop cut after its old log-probs was taken (consumed) but not trained.
    (accounting,) = read_jsonl(run_dir / "areal_accounting.jsonl")
    trained = [(s["step"], s["group"]) for s in read_jsonl(run_dir / "areal_samples.jsonl")]
    assert accounting["rejected"] == 0 and accounting["consumed"] == len(set(trained))
    assert accounting["failed_groups"] == 0  # requests continued where they were: no group failed and re-ran
    drawn = [uid for line in read_jsonl(run_dir / "areal_submissions.jsonl") for uid in line["uids"]]
    assert len(drawn) == len(set(drawn))
    groups = {group for _, group in trained}
    assert len(set(trained)) == len(groups) >= steps * 16, "a prompt group was lost or trained twice"
