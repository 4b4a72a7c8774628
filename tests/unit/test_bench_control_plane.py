"""The control-plane bench (tools/bench_control_plane.py): its arithmetic on hand-derived values, the paced engine
stand-in it drives (tools/areal_bench/paced_engine.py), and a tiny run that produces a row (no Ray)."""

from __future__ import annotations

import asyncio
import json

import pytest
from areal_bench.paced_engine import PacedRolloutServer

from tests.unit.tool_scripts import load_tool

bench = load_tool("bench_control_plane")


def test_driver_cpu_per_step_and_per_thousand_trajectories():
    # CPU time 10.0 s when the first counted step begins, then 10.5, 11.5, 12.0 at the ends of three steps:
    # 2.0 s over 3 steps = 2/3 s per step; 128 trajectories a step -> 1000 * (2/3) / 128 = 5.2083 s per 1k.
    per_step, per_1k = bench.cpu_per_step([10.0, 10.5, 11.5, 12.0], trajectories_per_step=128)
    assert per_step == pytest.approx(2 / 3)
    assert per_1k == pytest.approx(5.208333, rel=1e-6)
    with pytest.raises(ValueError):
        bench.cpu_per_step([10.0], trajectories_per_step=128)


def test_admission_latency_is_from_the_decision_to_the_earliest_arrival_on_any_engine():
    decided = {1: 100.0, 2: 100.5, 3: 101.0}
    # Group 1 reached engine b first (100.1, not a's 100.2): 0.1 s. Group 2: 101.0 - 100.5 = 0.5 s. Group 3 has not
    # arrived yet and group 4 was decided in an earlier step: neither counts.
    arrivals = [{1: 100.2, 2: 101.0}, {1: 100.1, 4: 99.0}]
    assert bench.admission_latencies(decided, arrivals) == pytest.approx([0.1, 0.5])


def test_batch_ready_to_trainer_counts_from_the_later_of_ready_and_asked():
    assert bench.ready_to_trainer(ready_at=5.0, asked_at=3.0, has_at=5.25) == pytest.approx(0.25)  # trainer waited
    assert bench.ready_to_trainer(ready_at=2.0, asked_at=3.0, has_at=3.1) == pytest.approx(0.1)  # batch waited


def test_configurations_and_the_request_bound():
    config = bench.Config.parse("512x16:4:8")
    assert (config.batch, config.answers, config.eta, config.engines) == (512, 16, 4, 8)
    assert config.requests_bound == 40_960  # (η + 1) x B x n: the issue's ~41,000 requests in flight
    assert config.trajectories_per_step == 8192
    assert not config.listing and bench.Config.parse("512x16:4:8:listing").listing
    with pytest.raises(SystemExit, match="BxN:ETA:ENGINES"):
        bench.Config.parse("512x16")
    with pytest.raises(SystemExit, match="BxN:ETA:ENGINES"):
        bench.Config.parse("512x16:4:8:lists")


def test_other_processes_cpu_by_role_counts_new_processes_from_zero():
    # Engine pid 1 ran 3.5 - 2.0 = 1.5 s; engine pid 3 started meanwhile and ran 1.0 s; worker pid 2 is gone by the
    # second reading; raylet pid 4 ran 0.25 s.
    before = {1: ("PacedRolloutServer", 2.0), 2: ("RolloutWorker", 5.0), 4: ("raylet", 1.0)}
    after = {1: ("PacedRolloutServer", 3.5), 3: ("PacedRolloutServer", 1.0), 4: ("raylet", 1.25)}
    assert bench.cpu_of_others(before, after) == pytest.approx({"PacedRolloutServer": 2.5, "raylet": 0.25})
    assert bench.process_role(["ray::PacedRolloutServer.generate"], "python") == "PacedRolloutServer"
    assert bench.process_role(["/usr/bin/raylet", "--x"], "raylet") == "raylet"


def test_groups_are_split_among_workers_as_verl_chunks_a_batch():
    assert bench.split([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert bench.split([], 3) == [[], [], []]


def test_the_paced_engine_aborts_with_partial_output_parks_new_requests_and_serves_the_new_version():
    async def scenario():
        engine = PacedRolloutServer(tokens_per_s=1000.0)
        params = {"max_tokens": 10_000, "logprobs": True}  # 10 s unless aborted
        first = asyncio.create_task(engine.generate([5, 1, 2], dict(params), "a"))
        await asyncio.sleep(0.05)
        assert (await engine.get_stats())["in_flight"] == 1
        await engine.abort_all_requests()
        out = await asyncio.wait_for(first, timeout=5)
        assert out.stop_reason == "aborted"
        assert 0 < len(out.token_ids) < 10_000 and len(out.log_probs) == len(out.token_ids)
        assert out.extra_fields["token_versions"] == [0] * len(out.token_ids)
        partial = len(out.token_ids)
        parked = asyncio.create_task(engine.generate([6, 1], {"max_tokens": 4}, "b"))  # gate closed: it waits
        await asyncio.sleep(0.05)
        assert not parked.done()
        reply = await engine.update_weights({}, 1)
        PacedRolloutServer.verify_weights(reply, {}, 1, "engine 0")
        await engine.resume_generation()
        out = await asyncio.wait_for(parked, timeout=5)
        assert (out.token_ids, out.stop_reason, out.log_probs) == ([7] * 4, "completed", None)
        assert out.extra_fields["token_versions"] == [1] * 4
        assert set(engine.take_arrivals()) == {5, 6} and engine.take_arrivals() == {}
        stats = await engine.get_stats()
        assert (stats["generated_tokens"], stats["in_flight"], stats["version"]) == (partial + 4, 0, 1)

    asyncio.run(scenario())


def test_a_tiny_local_run_produces_a_row(tmp_path):
    out_file = tmp_path / "control_plane.json"
    printed: list[str] = []
    argv = [
        "--rig", "local", "--configs", "4x2:1:2", "--repeats", "1", "--steps", "2", "--warmup", "0",
        "--train-s", "0.02", "--update-s", "0.01", "--tokens-per-s", "4000", "--lengths", "4:16",
        "--idle-s", "0.05", "--out", str(out_file),
    ]  # fmt: skip
    result = bench.main(argv, out=printed.append)
    (row,) = json.loads(out_file.read_text())["rows"]
    assert row == json.loads(json.dumps(result["rows"][0]))
    assert row["name"] == "4x2 eta=1 engines=2" and row["repeats"] == 1 and row["steps_per_repeat"] == 2
    assert row["cpu_s_per_step"]["median"] > 0 and row["cpu_s_per_step"]["repeats"] == 1  # its records' shape
    assert row["cpu_s_per_1k_trajectories"]["median"] == pytest.approx(1000 * row["cpu_s_per_step"]["median"] / 8)
    for measure in ("admission_s", "ready_to_trainer_s", "abort_s", "resume_s", "stats_at_update_s"):
        assert row[measure]["median"] is not None and row[measure]["median"] >= 0, measure
    assert row["listing_entries"]["median"] > 0
    assert "| 4x2 eta=1 engines=2 | 1 × 2 |" in printed[-1]


def test_areal_paced_is_built_from_verls_replica_arguments_and_declares_no_weights(paced_backend):
    """rollout.name=areal_paced (the bench's paced workload): our replica's constructor arguments build it, its rate
    is its own engine option (refused for areal_cpu), and areal_async refuses it unless both weight capabilities
    are waived, since it holds no weights."""
    from areal_bench.paced_engine import VerlPacedServer
    from omegaconf import OmegaConf

    from areal_plugins.config.settings import ArealConfigError
    from areal_plugins.rollout.capabilities import check_backend_capabilities
    from areal_plugins.rollout.verl_registration import engine_options, server_class

    cls = server_class("areal_paced")
    assert cls is VerlPacedServer
    rollout = OmegaConf.create({"name": "areal_paced", "engine_kwargs": {"areal_paced": {"tokens_per_s": 250.0}}})
    options = engine_options(rollout)
    assert options == {"tokens_per_s": 250.0}
    with pytest.raises(ValueError, match=r"unknown keys \['tokens_per_s'\]"):
        engine_options(OmegaConf.create({"name": "areal_cpu", "engine_kwargs": {"areal_cpu": {"tokens_per_s": 1}}}))
    # areal_cpu's model-bound knobs would be ignored by a paced engine: refused, not dropped.
    with pytest.raises(ValueError, match=r"unknown keys \['num_threads'\]; valid keys: tokens_per_s"):
        engine_options(OmegaConf.create({"name": "areal_paced", "engine_kwargs": {"areal_paced": {"num_threads": 2}}}))
    with pytest.raises(ValueError, match=r"engine_kwargs\.areal_paced\.tokens_per_s must be a number .* got '50'"):
        cls(model_path="unused", response_length=8, max_model_len=40, tokens_per_s="50")

    async def one_answer():
        # The arguments ArealRolloutReplica.launch_servers passes every backend, plus the engine option.
        engine = cls(
            model_path="unused", response_length=8, max_model_len=40, max_batch_size=4, num_threads=2, seed=0,
            replica_rank=3, free_cache_engine=False, ignore_eos=False, batch_invariant=False, **options,
        )  # fmt: skip
        started = asyncio.get_running_loop().time()
        out = await engine.generate([1, 2, 3], {"logprobs": True}, "r")  # no max_tokens: the response length
        return engine, out, asyncio.get_running_loop().time() - started

    engine, out, took = asyncio.run(one_answer())
    assert engine.replica_rank == 3 and out.token_ids == [7] * 8 and out.stop_reason == "completed"
    assert 8 / 250.0 <= took < 1.0  # 32 ms at 250 tokens/s
    with pytest.raises(ValueError, match="free_cache_engine=false"):
        cls(model_path="unused", response_length=8, max_model_len=40, free_cache_engine=True)
    with pytest.raises(ArealConfigError, match=r"weight_update.*\n.*weight_checksum"):
        check_backend_capabilities("areal_paced")
    assert check_backend_capabilities("areal_paced", ["weight_update", "weight_checksum"]) == [
        "weight_update",
        "weight_checksum",
    ]
