"""A run joins an existing Ray cluster of three nodes on this machine and loses the engines' node mid-run.

Ray's own multi-node mechanism on one host (``ray.cluster_utils.Cluster``): a head with no GPU slot and two
nodes with one fake GPU slot each, so verl's pools put the trainer on one node and the standalone engines
(``placement: separate``) on the other. The nodes' processes are started by the cluster, not by the CLI,
so they see nothing of the CLI's environment: what they know of the run came with the Ray job. The example
plugin is installed on every node (on their ``PYTHONPATH``); its setting (where to log) travels in the job's
runtime_env.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.integration.conftest import (
    EXAMPLE_PLUGIN_DIR,
    assert_within_staleness_bound,
    cli_output,
    kill_tree,
    read_jsonl,
    run_cli,
    start_cli,
    train_args,
)

pytestmark = [pytest.mark.integration, pytest.mark.full]
STEPS = 6
LOST_AFTER_CHECKPOINT = 2
MAX_STALENESS = 2  # the separate recipe's η


class PluginInstalled:
    """Nodes started inside this block have the example plugin installed (on their ``PYTHONPATH``)."""

    def __enter__(self) -> None:
        self.before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE_PLUGIN_DIR), self.before) if p)

    def __exit__(self, *exc) -> None:
        if self.before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = self.before


class TokenAuthentication:
    """Ray's token authentication for every process started inside this block (docs/cluster.md): the nodes inherit
    ``RAY_AUTH_MODE=token`` and the token, and so does the CLI the tests start (they pass ``os.environ`` on)."""

    NAMES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

    def __enter__(self) -> None:
        import secrets

        from ray._private.authentication_test_utils import reset_auth_token_state

        self.before = {name: os.environ.get(name) for name in self.NAMES}
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        reset_auth_token_state()  # this process's Ray reads the token anew

    def __exit__(self, *exc) -> None:
        from ray._private.authentication_test_utils import reset_auth_token_state

        for name, value in self.before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reset_auth_token_state()


@pytest.fixture(scope="module")
def cluster():
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    with TokenAuthentication():  # as docs/cluster.md starts a cluster: nobody without the token runs code on it
        with PluginInstalled():
            cluster = Cluster(
                initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0, "include_dashboard": True}
            )
            for _ in range(2):
                cluster.add_node(num_cpus=4, num_gpus=1)
        yield cluster
        cluster.shutdown()
    # Else a later plain ray.init() on this machine would try to join the dead cluster.
    Path(get_ray_address_file(None)).unlink(missing_ok=True)


def test_the_cluster_refuses_a_client_without_its_token_and_check_says_this_shell_has_one(cluster):
    """The cluster the run joins has token authentication on: a client without the token is refused (asked in a
    process of its own by what ``check`` asks), and ``check``'s warning is silent for a shell that sends it."""
    from areal_plugins.cli.cluster_env import accepts_without_token, auth_warning

    assert accepts_without_token(cluster.address) is False
    assert auth_warning(cluster.address, False, dict(os.environ)) is None
    assert "RAY_AUTH_MODE=token" in (auth_warning(cluster.address, False, {}) or "")


def cluster_args(run_dir, tiny_dir, observer_log) -> list[str]:
    job_env = "++ray_kwargs.ray_init.runtime_env.env_vars"
    return train_args(
        "grpo_cpu_async_separate.yaml",
        run_dir,
        tiny_dir,
        STEPS,
        "trainer.save_freq=1",
        f"{job_env}.AREAL_EXAMPLE_OBSERVER_LOG='{observer_log}'",  # a plugin's setting, for every node
    )


def actors_by_class(run_dir) -> dict[str, dict]:
    return {a["class_name"].rsplit(".", 1)[-1]: a for a in read_jsonl(run_dir / "ray_actors.jsonl")}


@pytest.fixture(scope="module")
def lost_node_run(cluster, tiny_dir, tmp_path_factory):
    """Run until step LOST_AFTER_CHECKPOINT is checkpointed, remove the engines' node, resume on a new one."""
    base = tmp_path_factory.mktemp("cluster")
    run_dir, observer_log = base / "run", base / "observer.jsonl"
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    args = cluster_args(run_dir, tiny_dir, observer_log)
    marker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    process = start_cli(*args, env=env)
    try:
        deadline = time.monotonic() + 600
        while not (marker.exists() and marker.read_text().strip() == str(LOST_AFTER_CHECKPOINT)):
            assert process.poll() is None, f"stopped before its checkpoint:\n{cli_output(process)}"
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.2)
        engines_node = actors_by_class(run_dir)["CPURolloutServer"]["node_id"]
        (node,) = [n for n in cluster.worker_nodes if n.node_id == engines_node]
        cluster.remove_node(node, allow_graceful=False)  # the machine is gone: raylet and workers at once
        lost = time.monotonic()
        code = process.wait(timeout=300)
        stopped_after = time.monotonic() - lost
    finally:
        if process.poll() is None:
            kill_tree(process)
    before = {name: read_jsonl(run_dir / name) for name in ("areal_submissions.jsonl", "areal_samples.jsonl")}
    for name in before:
        (run_dir / name).rename(run_dir / f"lost.{name}")
    lost_log = (run_dir / "train.log").read_text()
    last_checkpoint = int(marker.read_text())
    (run_dir / "train.log").rename(run_dir / "lost.train.log")
    with PluginInstalled():  # a replacement machine joins; the same command resumes
        cluster.add_node(num_cpus=4, num_gpus=1)
    run_cli(*args, env=env)
    return {
        "run_dir": run_dir,
        "observer": read_jsonl(observer_log),
        "engines_node": engines_node,
        "code": code,
        "stopped_after": stopped_after,
        "lost_log": lost_log,
        "before": before,
        "last_checkpoint": last_checkpoint,
    }


def test_trainer_and_engines_run_on_two_nodes_the_cli_never_started(lost_node_run, cluster):
    by_job: dict[str, list[dict]] = {}  # both runs' actors, as Ray placed them
    for actor in read_jsonl(lost_node_run["run_dir"] / "ray_actors.jsonl"):
        by_job.setdefault(actor["job_id"], []).append(actor)
    assert len(by_job) == 2
    for actors in by_job.values():
        trainer = {a["node_id"] for a in actors if a["class_name"].endswith("WorkerDict")}
        engines = {a["node_id"] for a in actors if a["class_name"] == "CPURolloutServer"}
        assert len(trainer) == len(engines) == 1 and trainer != engines
        assert cluster.head_node.node_id not in trainer | engines
    first_job = min(by_job)
    assert {a["node_id"] for a in by_job[first_job] if a["class_name"] == "CPURolloutServer"} == {
        lost_node_run["engines_node"]
    }


def test_the_engines_node_sends_its_records_to_the_run_directory(lost_node_run):
    run_dir = lost_node_run["run_dir"]
    sources = read_jsonl(run_dir / "record_sources.jsonl")
    assert {"replica_events.jsonl", "weight_syncs.jsonl"} <= {
        s["file"] for s in sources if s["node"] == lost_node_run["engines_node"]
    }


def test_every_node_runs_the_plugin_with_the_jobs_settings(lost_node_run):
    run_dir, observer = lost_node_run["run_dir"], lost_node_run["observer"]
    actors = [a for a in read_jsonl(run_dir / "ray_actors.jsonl") if a["class_name"].endswith("WorkerDict")]
    trainer_pids = {a["pid"] for a in actors}
    # The trainer workers (on a node the CLI never touched) loaded the plugin and read its log setting.
    assert trainer_pids & {e["pid"] for e in observer if e["event"] == "make_policy_loss"}
    # Both runs' reward workers loaded it (the second on nodes of which one joined after the loss).
    assert len({e["pid"] for e in observer if e["event"] == "make_reward_fn"}) == 2


def test_losing_the_engines_node_stops_the_run_naming_the_node(lost_node_run):
    assert lost_node_run["code"] != 0
    assert lost_node_run["stopped_after"] < 120, f"{lost_node_run['stopped_after']:.0f} s to stop"
    log = lost_node_run["lost_log"]
    assert f"node {lost_node_run['engines_node'][:8]}) died" in log, log[-3000:]


def test_the_resumed_run_on_a_replacement_node_loses_no_prompt(lost_node_run):
    run_dir, before = lost_node_run["run_dir"], lost_node_run["before"]
    (restored,) = read_jsonl(run_dir / "areal_restored.jsonl")
    saved, resumed_from = restored["saved"], lost_node_run["last_checkpoint"]
    # Buffered samples may let the trainer finish (and save) a step after the node went: resume from the last.
    assert resumed_from >= LOST_AFTER_CHECKPOINT and restored["version"] == resumed_from
    drawn = [uid for line in before["areal_submissions.jsonl"][: saved["submissions"]] for uid in line["uids"]]
    consumed = {s["group"] for s in before["areal_samples.jsonl"] if s["step"] <= resumed_from}
    assert saved["staleness_controller"]["rejected"] == 0  # nothing filtered: every drawn group is trained or alive
    assert set(restored["uids"]) == set(drawn) - consumed, "a prompt alive at the checkpoint was lost or invented"
    steps = [s["step"] for s in read_jsonl(run_dir / "areal_steps.jsonl")]
    assert steps[-(STEPS - resumed_from) :] == list(range(resumed_from + 1, STEPS + 1))
    assert json.loads((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text()) == STEPS


def test_after_resume_each_group_is_trained_once_and_none_beyond_the_bound_uncounted(lost_node_run):
    run_dir, before = lost_node_run["run_dir"], lost_node_run["before"]
    resumed_from = lost_node_run["last_checkpoint"]
    trained_before = {s["group"] for s in before["areal_samples.jsonl"] if s["step"] <= resumed_from}
    after = read_jsonl(run_dir / "areal_samples.jsonl")
    assert after and not {s["group"] for s in after} & trained_before, "a group trained before was trained again"
    steps_of: dict[str, set[int]] = {}
    for sample in after:
        steps_of.setdefault(sample["group"], set()).add(sample["step"])
    assert all(len(steps) == 1 for steps in steps_of.values())  # all of a group's trajectories in one step
    assert_within_staleness_bound(after, read_jsonl(run_dir / "areal_steps.jsonl"), MAX_STALENESS)
