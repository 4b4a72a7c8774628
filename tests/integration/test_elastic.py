"""A node joins the Ray cluster mid-run and a new rollout replica starts on it (``areal.max_rollout_replicas``).

Ray's multi-node mechanism on one host (``ray.cluster_utils.Cluster``): a head with no GPU slot and a node with two
fake GPU slots (the trainer and the recipe's one replica, ``placement: separate``). After step 2 a node with one GPU
slot joins; the run starts a second replica there, which takes the weights of the next sync (checked like the first
replica's) and only then requests.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.integration.conftest import cli_output, kill_tree, read_jsonl, start_cli, train_args

pytestmark = [pytest.mark.integration, pytest.mark.full]
STEPS = 10
GROW_AFTER_STEP = 2


@pytest.fixture(scope="module")
def cluster():
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0})
    cluster.add_node(num_cpus=6, num_gpus=2)
    yield cluster
    cluster.shutdown()
    Path(get_ray_address_file(None)).unlink(missing_ok=True)  # else a later ray.init() joins the dead cluster


def test_a_node_that_joins_mid_run_hosts_a_new_replica_that_serves_after_a_weight_sync(cluster, tiny_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = train_args("grpo_cpu_async_separate.yaml", run_dir, tiny_dir, STEPS, "++areal.max_rollout_replicas=2")
    process = start_cli(*args, env=dict(os.environ, RAY_ADDRESS=cluster.address))
    try:
        deadline = time.monotonic() + 900
        while len(read_jsonl(run_dir / "areal_steps.jsonl")) < GROW_AFTER_STEP:
            assert process.poll() is None and time.monotonic() < deadline, f"no step 2:\n{cli_output(process)}"
            time.sleep(0.2)
        cluster.add_node(num_cpus=4, num_gpus=1)  # a machine joins
        code = process.wait(timeout=1200)
    finally:
        if process.poll() is None:
            kill_tree(process)
    assert code == 0, cli_output(process)[-3000:]
    events = read_jsonl(run_dir / "replica_events.jsonl")
    (growing,) = [e for e in events if e["event"] == "growing"]
    (joined,) = [e for e in events if e["event"] == "joined"]
    assert growing["replica"] == joined["replica"] == 1 and joined["replaces"] is None
    assert GROW_AFTER_STEP <= joined["version"] < STEPS
    # The new replica took every version from the one it joined at, each with replica 0's checksum, and generated.
    syncs = [e for e in read_jsonl(run_dir / "weight_syncs.jsonl") if e["event"] == "update"]
    first = {e["version"]: e["checksum"] for e in syncs if e["replica"] == 0}
    added = [e for e in syncs if e["replica"] == 1]
    assert [e["version"] for e in added] == list(range(joined["version"], STEPS + 1))
    assert all(e["checksum"] == first[e["version"]] for e in added)
    generated = [e["generated_tokens"] for e in events if e["event"] == "update" and e["replica"] == 1]
    assert generated[0] == 0 and generated[-1] > 0, generated
    # It ran on the node that joined, and the run trained every step, each prompt group once.
    servers = [a for a in read_jsonl(run_dir / "ray_actors.jsonl") if a.get("class_name") == "CPURolloutServer"]
    assert len({a["node_id"] for a in servers}) == 2, servers
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    last = metrics[-1]["data"]
    assert last["areal/rollout_replicas"] == 2 and last["areal/rollout_replicas_added"] == 1
    trained = [(s["step"], s["group"]) for s in read_jsonl(run_dir / "areal_samples.jsonl")]
    assert len({group for _, group in trained}) == len(set(trained)) == STEPS * 16
