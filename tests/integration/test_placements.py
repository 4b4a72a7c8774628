"""Placements on verl's machinery: the colocated engines follow verl's lifecycle (abort, sleep, update, resume)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import OBSERVED_STEPS, assert_within_staleness_bound, read_jsonl

pytestmark = pytest.mark.integration


def test_colocated_engines_sleep_with_weights_released_and_wake_with_the_new_ones(observed_run):
    _, _, run_dir = observed_run  # the main recipe: colocated, rollout.free_cache_engine: true
    events = [e for e in read_jsonl(run_dir / "replica_events.jsonl") if e["replica"] == 0]
    updates = [i for i, e in enumerate(events) if e["event"] == "update" and e["version"] >= 1]
    assert [events[i]["version"] for i in updates] == list(range(1, OBSERVED_STEPS + 1))
    for i in updates:
        before = [e for e in events[:i] if e["event"] != "wake_up"][-2:]
        after = next(e for e in events[i + 1 :] if e["event"] != "wake_up")
        # verl's order: interrupt, sleep (the weights' storage freed), load the new weights, resume.
        assert [e["event"] for e in before] == ["abort", "sleep"], before
        assert before[1]["released"] is True and before[1]["weight_bytes"] == 0
        assert events[i]["weight_bytes"] > 0  # the update brought the weights back
        assert after["event"] == "resume" and after["version"] == events[i]["version"]
        # The adapter woke the engine for the weights before loading them (verl's hybrid update).
        woken = [e for e in events[:i] if e["event"] == "wake_up"]
        assert woken and woken[-1]["time"] > before[1]["time"]


def test_the_weight_update_hooks_fire_where_the_hook_docs_say(observed_run):
    """hookspecs.py: colocated engines are asleep when areal_before_weight_update fires (they slept when sampling
    ended), the weights load after it, and areal_on_weights_updated follows the engine's load of that version."""
    _, hooks, run_dir = observed_run
    engine = [e for e in read_jsonl(run_dir / "replica_events.jsonl") if e["replica"] == 0]
    before = {e["version"]: e["time"] for e in hooks if e["event"] == "before_weight_update"}
    after = {e["version"]: e["time"] for e in hooks if e["event"] == "weights_updated"}
    assert sorted(before) == list(range(1, OBSERVED_STEPS + 1))  # not for the initial sync (version 0)
    for version, fired in before.items():
        loaded = next(e["time"] for e in engine if e["event"] == "update" and e["version"] == version)
        slept = max(e["time"] for e in engine if e["event"] == "sleep" and e["time"] < loaded)
        assert slept < fired < loaded < after[version], (version, slept, fired, loaded, after[version])


SEPARATE_STEPS = 3


@pytest.fixture(scope="module")
def separate_run(tiny_dir, tmp_path_factory):
    from tests.integration.conftest import train_tiny

    run_dir = tmp_path_factory.mktemp("separate") / "run"
    steps = train_tiny("grpo_cpu_async_separate.yaml", run_dir, tiny_dir, SEPARATE_STEPS)
    return steps, run_dir


def gpu_actors(run_dir) -> list[dict]:
    """Actors holding (fake) GPU slots, as Ray placed them (recorded by the trainer after setup)."""

    def gpus(actor: dict) -> float:  # Ray names a placement group's share "GPU_group_<bundle>_<group id>"
        return sum(v for k, v in actor["required_resources"].items() if k == "GPU" or k.startswith("GPU_group_"))

    return [a for a in read_jsonl(run_dir / "ray_actors.jsonl") if gpus(a) > 0]


@pytest.mark.full
def test_separate_engines_hold_a_resource_pool_disjoint_from_the_trainers(separate_run):
    _, run_dir = separate_run
    actors = gpu_actors(run_dir)
    rollout = [a for a in actors if a["class_name"] == "CheckpointEngineWorker"]
    trainer = [a for a in actors if a["class_name"] != "CheckpointEngineWorker"]
    assert rollout and trainer, actors
    assert not {a["placement_group_id"] for a in rollout} & {a["placement_group_id"] for a in trainer}
    assert not {a["pid"] for a in rollout} & {a["pid"] for a in trainer}


def test_colocated_engines_live_in_the_trainers_workers(observed_run):
    _, _, run_dir = observed_run
    actors = gpu_actors(run_dir)
    assert actors and not [a for a in actors if a["class_name"] == "CheckpointEngineWorker"]
    assert len({a["placement_group_id"] for a in actors}) == 1  # one pool: the engines share the trainer's slots


@pytest.mark.full
def test_separate_weights_cross_by_the_checkpoint_engine_and_engines_never_sleep(separate_run):
    steps, run_dir = separate_run
    assert len(steps) == SEPARATE_STEPS
    syncs = [s for s in read_jsonl(run_dir / "weight_syncs.jsonl") if s["event"] == "update"]
    # Version 0 at start, then one per step, each loaded and checked by checksum on the engine's side.
    assert [s["version"] for s in syncs] == list(range(SEPARATE_STEPS + 1))
    assert len({s["checksum"] for s in syncs}) == SEPARATE_STEPS + 1
    events = read_jsonl(run_dir / "replica_events.jsonl")
    assert not [e for e in events if e["event"] == "sleep"]  # generation never yields the devices
    assert [e["version"] for e in events if e["event"] == "update"] == list(range(SEPARATE_STEPS + 1))
    samples, steps = read_jsonl(run_dir / "areal_samples.jsonl"), read_jsonl(run_dir / "areal_steps.jsonl")
    assert_within_staleness_bound(samples, steps, 2)  # the recipe's η


@pytest.mark.full
def test_separate_throughput_counts_the_engines_devices_too(separate_run):
    """perf/throughput = tokens / (seconds x devices): 1 trainer + 1 rollout device in the separate recipe."""

    _, run_dir = separate_run
    rows = [row["data"] for row in read_jsonl(run_dir / "metrics.jsonl") if "perf/throughput" in row["data"]]
    assert rows
    for row in rows:
        devices = row["perf/total_num_tokens"] / (row["perf/time_per_step"] * row["perf/throughput"])
        assert devices == pytest.approx(2.0, rel=1e-6)


@pytest.mark.full
def test_a_mixture_of_experts_trains_in_the_engines_own_pool_with_router_replay(moe_dir, tmp_path):
    """The tiny Qwen2-MoE with router replay, ``placement: separate`` on ``areal_cpu`` (``areal_gloo``): the
    expert weights cross by the checkpoint engine at every version, and every trained trajectory carries its
    routing, prompt + response - 1 rows (CI's MoE run is colocated: test_replay.py)."""
    from tests.integration.conftest import train_tiny

    run_dir = tmp_path / "run"
    steps = train_tiny(
        "grpo_cpu_async_separate.yaml",
        run_dir,
        moe_dir,
        SEPARATE_STEPS,
        "++actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    )
    assert [s["training/global_step"] for s in steps] == list(range(1, SEPARATE_STEPS + 1))
    syncs = [s for s in read_jsonl(run_dir / "weight_syncs.jsonl") if s["event"] == "update"]
    assert [s["version"] for s in syncs] == list(range(SEPARATE_STEPS + 1))
    assert len({s["checksum"] for s in syncs}) == SEPARATE_STEPS + 1  # each version different
    samples = read_jsonl(run_dir / "areal_samples.jsonl")
    assert samples and all(
        s["routed_experts_rows"] == s["prompt_tokens"] + s["response_tokens"] - 1 for s in samples
    ), samples[:2]
    assert_within_staleness_bound(samples, read_jsonl(run_dir / "areal_steps.jsonl"), 2)
