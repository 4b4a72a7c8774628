"""A rollout server's control calls are never starved by its generation requests (real Ray, real areal_cpu server).

Requests parked at a server's closed gate (a weight update in progress) each hold one of the actor's slots. With
verl's sizing (here 4 slots) and more requests parked than that, the statistics call and the resume that would
let them go never start; with ours (every request the trainer can have in flight, plus control slots) they do.
"""

from __future__ import annotations

import pytest
import ray
from omegaconf import OmegaConf

from areal_plugins.rollout.server_slots import (
    CONTROL_SLOTS,
    bound_requests_from_config,
    bound_requests_in_flight,
    server_concurrency,
)

pytestmark = pytest.mark.integration

VERL_SLOTS = 4  # stands for verl's max(1000, max_num_seqs + 16)
PARKED = 12  # three times that


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    from areal_plugins.tiny.model import TinyModelSpec, build_tiny_model

    out = tmp_path_factory.mktemp("random_model")
    build_tiny_model(out, TinyModelSpec(warmstart_steps=0))
    return out


@pytest.fixture(scope="module")
def local_ray():
    import areal_bench  # the paced engine's class is the bench's (tools/): Ray ships that package to the workers

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=areal_bench.runtime_env())
    yield
    ray.shutdown()


def park_requests(server) -> list:
    ray.get(server.get_version.remote())
    ray.get(server.abort_all_requests.remote(), timeout=30)  # the gate closes: requests park
    params = {"max_tokens": 8, "temperature": 1.0, "logprobs": True}
    parked = [server.generate.remote([10 + i, 11, 12], params, f"request-{i}") for i in range(PARKED)]
    ready, _ = ray.wait(parked, timeout=2)
    assert not ready  # parked
    return parked


def cpu_server(random_model, max_concurrency: int):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    return (
        ray.remote(CPURolloutServer)
        .options(max_concurrency=max_concurrency)
        .remote(model_path=str(random_model), response_length=8, max_model_len=64, max_batch_size=4)
    )


def test_with_verls_sizing_parked_requests_starve_the_control_calls(random_model, local_ray):
    server = cpu_server(random_model, VERL_SLOTS)
    park_requests(server)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(server.get_stats.remote(), timeout=5)
    ray.kill(server)


def test_with_ours_resume_and_statistics_run_while_every_bounded_request_is_parked(random_model, local_ray):
    bound_requests_in_flight(PARKED)
    try:
        slots = server_concurrency(VERL_SLOTS)
    finally:
        bound_requests_in_flight(0)
    assert slots == PARKED + CONTROL_SLOTS
    server = cpu_server(random_model, slots)
    parked = park_requests(server)
    assert ray.get(server.get_stats.remote(), timeout=10)["in_flight"] == 0
    ray.get(server.resume_generation.remote(), timeout=10)
    outputs = ray.get(parked, timeout=120)
    assert all(out.stop_reason == "completed" and len(out.token_ids) >= 1 for out in outputs)


def test_the_bound_is_what_admission_allows_times_the_answers_per_prompt():
    def config(**areal):
        return OmegaConf.create(
            {"data": {"train_batch_size": 512}, "actor_rollout_ref": {"rollout": {"n": 16}}, "areal": areal}
        )

    assert bound_requests_from_config(config(mode="async", max_staleness=4)) == 5 * 512 * 16  # the paper's 1.5B
    assert bound_requests_from_config(config(mode="async", max_staleness=4, max_concurrent_rollouts=600)) == 600 * 16
    assert bound_requests_from_config(config(mode="sync")) == 512 * 16


def test_under_verls_own_trainers_our_replica_gives_its_server_a_slot_for_every_parked_request(local_ray, monkeypatch):
    """verl's own trainers set no bound (ours does). Our replica (verl's registry, ``launch_servers``) then sizes the
    server past any number parked: 1,100 requests parked beyond verl's 1,040 slots, and the statistics and resume
    calls still run. verl's colocate_async on areal_paced at 128 x 16 hung in its weight update without it."""
    import asyncio
    from types import SimpleNamespace

    from areal_bench import verl_backend
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    import areal_plugins.verl_plugin  # noqa: F401  (registers our backends, as verl's plugin loading does)
    from areal_plugins.rollout import verl_registration

    # The paced engine is a benchmark's stand-in: the bench registers it (for this test only).
    monkeypatch.setattr(verl_registration, "BACKENDS", dict(verl_registration.BACKENDS))
    verl_backend.register()
    verl_registration.register_rollout_backends()

    config = RolloutConfig(
        name="areal_paced",
        mode="async",
        prompt_length=8,
        response_length=1,
        free_cache_engine=False,
        engine_kwargs={"areal_paced": {"tokens_per_s": 1000.0}},
    )
    model = SimpleNamespace(path="unused", local_path=None)  # the paced engine loads no model
    replica = get_rollout_replica_class("areal_paced")(
        replica_rank=0, config=config, model_config=model, gpus_per_node=1
    )
    assert replica.max_concurrency == 1040  # verl's sizing: max(1000, max_num_seqs + 16)
    asyncio.run(replica.launch_servers())
    (server,) = replica.servers
    ray.get(server.abort_all_requests.remote(), timeout=30)  # the gate closes: requests park
    parked = [server.generate.remote([i, 1], {"logprobs": True}, f"request-{i}") for i in range(1100)]
    ready, _ = ray.wait(parked, timeout=2)
    assert not ready
    assert ray.get(server.get_stats.remote(), timeout=30)["in_flight"] == 0
    ray.get(server.resume_generation.remote(), timeout=30)
    outputs = ray.get(parked, timeout=120)
    assert all(out.token_ids == [7] and out.stop_reason == "completed" for out in outputs)
    ray.kill(server)
