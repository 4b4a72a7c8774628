"""A trajectory interrupted by a weight update, regenerated from its record alone, bit for bit (areal_cpu)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from areal_plugins.replay.requests import ReplayError, chunk_requests, regenerate
from areal_plugins.rollout.cpu.engine import STOP_ABORTED, ContinuousBatchingEngine

NO_EOS: list[int] = []
PROMPT = [5, 6, 7]
LENGTH = 40
TEMPERATURE = 0.7


def newer(model, shift: float) -> dict[str, torch.Tensor]:
    return {name: value + shift for name, value in model.state_dict().items()}


def original_run(model) -> tuple[list[list], list[int], list[float]]:
    """The target request among others in a batch-invariant engine, aborted after a few tokens for an update to
    version 1 and continued as prompt + partial output among other requests: what the async trainer does. Returns
    the record (chunks as the client writes them), the tokens and the log-probs."""
    engine = ContinuousBatchingEngine(copy.deepcopy(model), NO_EOS, max_batch_size=6, batch_invariant=True)

    async def go():
        target = asyncio.create_task(engine.generate(PROMPT, LENGTH, temperature=TEMPERATURE))
        others = [asyncio.create_task(engine.generate([9] * n, 30, temperature=TEMPERATURE)) for n in range(1, 8)]
        while engine.generated_tokens < 20:  # the target, in the first batch, has a few tokens
            await asyncio.sleep(0.001)
        engine.abort_all()
        first = await target
        await asyncio.gather(*others)
        engine.load_state_dict(newer(model, 0.01), version=1)
        rest = [asyncio.create_task(engine.generate([4] * n, 30, temperature=TEMPERATURE)) for n in range(1, 4)]
        second = await engine.generate([*PROMPT, *first.token_ids], LENGTH - len(first.token_ids), TEMPERATURE)
        await asyncio.gather(*rest)
        return first, second

    first, second = asyncio.run(go())
    assert first.stop_reason == STOP_ABORTED and 0 < len(first.token_ids) < LENGTH
    chunks = [[0, 0, first.seed], [len(first.token_ids), 1, second.seed]]
    return chunks, first.token_ids + second.token_ids, first.logprobs + second.logprobs


def replay(model, chunks: list[list], version_1_shift: float):
    # Another base seed: the seeds the engine would derive itself differ, so only the recorded ones draw the same.
    engine = ContinuousBatchingEngine(copy.deepcopy(model), NO_EOS, batch_invariant=True, seed=1)

    async def serve_version(version: int) -> None:
        if version != engine.version:
            engine.load_state_dict(newer(model, version_1_shift), version=version)

    async def generate(prompt_ids: list[int], max_tokens: int, seed: int):
        return await engine.generate(prompt_ids, max_tokens, temperature=TEMPERATURE, seed=seed)

    return asyncio.run(regenerate(PROMPT, chunk_requests(chunks, LENGTH), generate, serve_version))


def test_an_interrupted_trajectory_is_regenerated_bit_for_bit_from_its_record(random_qwen2):
    chunks, tokens, logprobs = original_run(random_qwen2)
    replayed = replay(random_qwen2, chunks, version_1_shift=0.01)
    assert replayed.token_ids == tokens
    assert replayed.logprobs == logprobs  # exact floats
    cut = chunks[1][0]
    assert replayed.versions == [0] * cut + [1] * (LENGTH - cut)


def test_other_weights_at_version_1_show_from_the_cut_on(random_qwen2):
    chunks, _, logprobs = original_run(random_qwen2)
    replayed = replay(random_qwen2, chunks, version_1_shift=0.02)  # what a changed learning rate would train
    cut = chunks[1][0]
    assert replayed.logprobs[:cut] == logprobs[:cut]
    assert replayed.logprobs[cut] != logprobs[cut]


def test_a_record_that_cannot_be_replayed_is_refused_saying_why():
    with pytest.raises(ReplayError, match="did not seed its requests"):
        chunk_requests([[0, 0, None]], 10)
    with pytest.raises(ReplayError, match=r"first tokens \[0, 7, 5\] do not cut a response of 10"):
        chunk_requests([[0, 0, 1], [7, 1, 2], [5, 2, 3]], 10)
    assert [(c.start, c.max_tokens, c.version) for c in chunk_requests([[0, 0, 1], [7, 1, 2]], 10)] == [
        (0, 7, 0),
        (7, 3, 1),
    ]
