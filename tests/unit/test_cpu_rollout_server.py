"""The areal_cpu rollout server's contract without Ray: generate, abort, sleep, update with the checksum
handshake, resume — what verl's replica, checkpoint manager and our adapter call on it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_plugins.weight_sync.errors import WeightSyncError

PARAMS = {"max_tokens": 64, "temperature": 1.0, "logprobs": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from areal_plugins.tiny.model import TinyModelSpec, build_tiny_model

    out = tmp_path_factory.mktemp("cpu_server_model")
    build_tiny_model(out, TinyModelSpec(warmstart_steps=0, hidden_size=64, intermediate_size=128))
    return out


def make_server(model_dir, free_cache_engine: bool):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    return CPURolloutServer(str(model_dir), response_length=64, max_model_len=128, free_cache_engine=free_cache_engine)


def test_abort_sleep_update_resume_in_verls_order(model_dir):
    server = make_server(model_dir, free_cache_engine=True)
    weights = {k: v.clone() + 0.01 for k, v in server.engine.model.state_dict().items()}
    parameter_bytes = sum(p.numel() * p.element_size() for p in server.engine.model.parameters())

    async def scenario():
        tasks = [asyncio.create_task(server.generate([5, 6, 7], dict(PARAMS), f"r{i}")) for i in range(3)]
        while server.engine.generated_tokens < 6:
            await asyncio.sleep(0.001)
        aborted = await server.abort_all_requests()
        partial = await asyncio.gather(*tasks)
        parked = asyncio.create_task(server.generate([5, 6, 7], dict(PARAMS), "parked"))  # behind the closed gate
        await server.sleep()
        asleep = await server.get_stats()
        reply = await server.update_weights(weights, 1)
        server.verify_weights(reply, weights, 1, "the test replica")
        await server.resume_generation()
        return aborted, partial, asleep, await parked, await server.get_stats()

    aborted, partial, asleep, parked, awake = asyncio.run(scenario())
    assert sorted(aborted["request_ids"]) == ["r0", "r1", "r2"]
    assert all(p.stop_reason == "aborted" and len(p.token_ids) < 64 for p in partial)
    assert asleep["weight_bytes"] == 0 and asleep["kv_cache_bytes"] == 0  # sleep released the weights
    assert awake["weight_bytes"] == parameter_bytes
    assert parked.extra_fields["token_versions"] == [1] * len(parked.token_ids)  # ran on the new weights only


def test_sleep_keeps_memory_without_free_cache_engine_like_verls_servers(model_dir):
    server = make_server(model_dir, free_cache_engine=False)
    asyncio.run(server.sleep())
    assert asyncio.run(server.get_stats())["weight_bytes"] > 0


def test_a_weight_sync_that_did_not_land_is_refused(model_dir):
    server = make_server(model_dir, free_cache_engine=False)
    sent = {k: v.clone() + 0.02 for k, v in server.engine.model.state_dict().items()}
    reply = asyncio.run(server.update_weights(sent, 3))
    other = {k: v + 1.0 for k, v in sent.items()}
    with pytest.raises(WeightSyncError, match="the trainer sent version 3 checksum"):
        server.verify_weights(reply, other, 3, "the test replica")
    with pytest.raises(WeightSyncError, match="reports version 3"):
        server.verify_weights(reply, sent, 4, "the test replica")


def test_resume_before_the_weights_came_back_is_refused(model_dir):
    server = make_server(model_dir, free_cache_engine=True)
    asyncio.run(server.sleep())
    with pytest.raises(WeightSyncError, match="weight update must come before resume_generation"):
        asyncio.run(server.resume_generation())
    assert torch.is_tensor(next(server.engine.model.parameters()))


def test_rollout_ignore_eos_is_every_requests_default_and_a_request_may_override_it(model_dir):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    def lengths(ignore_eos: bool) -> list[int]:
        server = CPURolloutServer(str(model_dir), response_length=64, max_model_len=128, ignore_eos=ignore_eos)
        server.engine.eos_token_ids = set(range(server.engine.model.config.vocab_size))  # every token ends a response

        async def scenario():
            default = await server.generate([5, 6, 7], dict(PARAMS), "default")
            honour = await server.generate([5, 6, 7], {**PARAMS, "ignore_eos": False}, "honour")
            ignore = await server.generate([5, 6, 7], {**PARAMS, "ignore_eos": True}, "ignore")
            return [len(default.token_ids), len(honour.token_ids), len(ignore.token_ids)]

        return asyncio.run(scenario())

    assert lengths(ignore_eos=False) == [1, 1, 64]
    assert lengths(ignore_eos=True) == [64, 1, 64]  # verl's rollout.ignore_eos, as its vLLM server applies it


def test_a_request_reports_its_seed_and_that_seed_draws_the_same_tokens_on_another_server(model_dir):
    """What a replay relies on: the server says which seed it sampled a request with, and a server with a different
    base seed, given that seed, samples the same tokens (temperature 1, so the tokens depend on the draw)."""
    from areal_plugins.rollout.base import SEED_FIELD

    first = make_server(model_dir, free_cache_engine=False)
    other = make_server(model_dir, free_cache_engine=False)
    other.engine._seeds.seed = first.engine.seed + 1  # another run's seeds

    async def answers():
        original = await first.generate([5, 6, 7], dict(PARAMS), "a")
        seed = original.extra_fields[SEED_FIELD]
        replayed = await other.generate([5, 6, 7], {**PARAMS, "seed": seed}, "b")
        unseeded = await other.generate([5, 6, 7], dict(PARAMS), "c")
        return original, seed, replayed, unseeded

    original, seed, replayed, unseeded = asyncio.run(answers())
    assert isinstance(seed, int)
    assert replayed.extra_fields[SEED_FIELD] == seed
    assert replayed.token_ids == original.token_ids and replayed.log_probs == original.log_probs
    assert unseeded.extra_fields[SEED_FIELD] != seed and unseeded.token_ids != original.token_ids


def test_the_engine_knobs_of_a_recipe_reach_the_server_and_an_unknown_one_is_refused_naming_the_valid_ones(model_dir):
    from omegaconf import OmegaConf

    from areal_plugins.rollout.cpu.server import CPURolloutServer
    from areal_plugins.rollout.verl_registration import engine_options

    server = CPURolloutServer(str(model_dir), response_length=8, max_model_len=32, batch_invariant=True)
    assert server.engine.batch_invariant and not make_server(model_dir, free_cache_engine=False).engine.batch_invariant

    def rollout(**knobs):
        return OmegaConf.create({"name": "areal_cpu", "engine_kwargs": {"areal_cpu": knobs}})

    assert engine_options(rollout(batch_invariant=True, num_threads=1)) == {"batch_invariant": True, "num_threads": 1}
    with pytest.raises(ValueError, match=r"unknown keys \['batch_invariance'\]; valid keys: .*batch_invariant"):
        engine_options(rollout(batch_invariant=True, batch_invariance=True))
    with pytest.raises(ValueError, match=r"batch_invariant must be true or false, got 'false'"):
        engine_options(rollout(batch_invariant="false"))
