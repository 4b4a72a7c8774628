"""The CPU generation engine against independent references: full forward passes and HF generate."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from areal_plugins.rollout.cpu.engine import (
    STOP_ABORTED,
    STOP_COMPLETED,
    ContinuousBatchingEngine,
    sample_tokens,
)

NO_EOS: list[int] = []  # random weights: never stop early, so lengths are exact


def full_forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Reference: log-probs of ``tokens`` from one forward pass over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def sample_token(logits, temperature, top_p, top_k, generator):
    """One row through the engine's batched sampler."""
    return sample_tokens(logits[None], [temperature], [top_p], [top_k], [generator])[0]


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_logprobs_match_full_forward(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=3, seed=1)
    prompts = [[5, 6, 7], [9] * 11, [1, 2, 3, 4, 5, 6], [42], [7, 7]]  # more than one batch, ragged

    async def go():
        return await asyncio.gather(*[engine.generate(p, max_tokens=9, temperature=0.8) for p in prompts])

    results = run(go())
    for prompt, result in zip(prompts, results, strict=True):
        assert result.stop_reason == STOP_COMPLETED
        assert len(result.token_ids) == 9
        reference = full_forward_logprobs(random_qwen2, prompt, result.token_ids, temperature=0.8)
        torch.testing.assert_close(torch.tensor(result.logprobs), reference, atol=1e-4, rtol=0)
        assert result.versions == [0] * 9


def test_greedy_matches_transformers_generate(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=4)
    prompts = [[3, 1, 4, 1, 5], [2, 7]]

    async def go():
        return await asyncio.gather(*[engine.generate(p, max_tokens=12, temperature=0.0) for p in prompts])

    results = run(go())
    for prompt, result in zip(prompts, results, strict=True):
        expected = random_qwen2.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert result.token_ids == expected


def test_stops_at_eos_and_keeps_it(random_qwen2):
    # Find what greedy emits second, then declare that token an EOS: generation must stop on it.
    probe = ContinuousBatchingEngine(random_qwen2, NO_EOS)
    first_two = run(probe.generate([8, 9, 10], max_tokens=2, temperature=0.0)).token_ids
    engine = ContinuousBatchingEngine(random_qwen2, [first_two[1]])
    result = run(engine.generate([8, 9, 10], max_tokens=50, temperature=0.0))
    assert result.token_ids[-1] == first_two[1]
    assert len(result.token_ids) <= 2 and result.stop_reason == STOP_COMPLETED


def test_ignore_eos_generates_to_the_limit_like_vllm(random_qwen2):
    # Every token is an end-of-sequence token: a request stops after one, unless it ignores them.
    every_token = list(range(random_qwen2.config.vocab_size))
    engine = ContinuousBatchingEngine(random_qwen2, every_token)
    assert len(run(engine.generate([8, 9, 10], max_tokens=7)).token_ids) == 1
    result = run(engine.generate([8, 9, 10], max_tokens=7, ignore_eos=True))
    assert len(result.token_ids) == 7 and result.stop_reason == STOP_COMPLETED


def test_abort_returns_partial_output(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=2)

    async def go():
        tasks = [asyncio.create_task(engine.generate([1, 2, 3], max_tokens=400)) for _ in range(3)]
        while engine.generated_tokens < 6:  # both running requests have produced tokens
            await asyncio.sleep(0.001)
        aborted = engine.abort_all()
        return aborted, await asyncio.gather(*tasks)

    aborted, results = run(go())
    assert len(aborted) == 3
    assert all(r.stop_reason == STOP_ABORTED for r in results)
    lengths = sorted(len(r.token_ids) for r in results)
    assert lengths[0] == 0  # the third request was still waiting for a batch slot
    assert 0 < lengths[-1] < 400
    for result in results:
        assert len(result.logprobs) == len(result.versions) == len(result.token_ids)


def test_weight_update_mid_generation_stamps_new_version(random_qwen2):
    import copy

    model = copy.deepcopy(random_qwen2)
    engine = ContinuousBatchingEngine(model, NO_EOS)
    new_weights = {k: v + 0.01 for k, v in model.state_dict().items()}

    async def go():
        task = asyncio.create_task(engine.generate([4, 5, 6], max_tokens=60))
        while engine.generated_tokens < 5:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.load_state_dict, new_weights, 1)
        return await task

    result = run(go())
    switch = result.versions.index(1)
    assert 0 < switch < 60
    assert result.versions == [0] * switch + [1] * (60 - switch)
    assert engine.version == 1
    # Reference for the first new-version token: the old weights build the KV cache of everything
    # before it, the new weights run the one decode step that scores it.
    old_model = random_qwen2
    new_model = copy.deepcopy(random_qwen2)
    new_model.load_state_dict(new_weights)
    prefix = [4, 5, 6, *result.token_ids[: switch - 1]]
    with torch.no_grad():
        cache = old_model(torch.tensor([prefix]), use_cache=True).past_key_values
        step = torch.tensor([[result.token_ids[switch - 1]]])
        new_logits = new_model(step, past_key_values=cache, use_cache=True).logits[0, -1]
        old_logits = old_model(torch.tensor([[*prefix, result.token_ids[switch - 1]]])).logits[0, -1]
    token = result.token_ids[switch]
    expected = float(torch.log_softmax(new_logits.float(), dim=-1)[token])
    stale = float(torch.log_softmax(old_logits.float(), dim=-1)[token])
    assert result.logprobs[switch] == pytest.approx(expected, abs=1e-4)
    assert abs(expected - stale) > 1e-3  # the old weights would have scored it differently


def test_load_state_dict_rejects_mismatched_weights(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS)
    with pytest.raises(RuntimeError, match="unexpected"):
        engine.load_state_dict({"not.a.weight": torch.zeros(1)}, version=3)
    assert engine.version == 0


def test_sample_token_logprob_is_hand_derived():
    # logits log([1, 2, 3]) at T = 1: p = [1/6, 2/6, 3/6]; greedy picks index 2 with log(1/2).
    logits = torch.log(torch.tensor([1.0, 2.0, 3.0]))
    token, logprob = sample_token(logits, 0.0, 1.0, -1, torch.Generator().manual_seed(0))
    assert token == 2 and logprob == pytest.approx(math.log(0.5), abs=1e-6)
    # T = 0.5 squares the odds: p ∝ [1, 4, 9]; top_k=1 leaves only index 2, log-prob untruncated.
    token, logprob = sample_token(logits, 0.5, 1.0, 1, torch.Generator().manual_seed(0))
    assert token == 2 and logprob == pytest.approx(math.log(9 / 14), abs=1e-6)


def test_sampled_frequencies_follow_the_distribution_and_zero_mass_is_never_drawn():
    # p = [0.1, 0, 0.3, 0.6] at T = 1: 4000 rows of 5 draws each (one generator per row, as per request).
    n_rows, per_row = 4000, 5
    logits = torch.log(torch.tensor([0.1, 0.0, 0.3, 0.6])).expand(n_rows, 4)
    generators = [torch.Generator().manual_seed(seed) for seed in range(n_rows)]
    counts = [0, 0, 0, 0]
    for _ in range(per_row):
        for token, _ in sample_tokens(logits, [1.0] * n_rows, [1.0] * n_rows, [-1] * n_rows, generators):
            counts[token] += 1
    n = n_rows * per_row
    assert counts[1] == 0
    for token, p in ((0, 0.1), (2, 0.3), (3, 0.6)):
        sigma = math.sqrt(p * (1 - p) / n)  # binomial standard error: 0.002-0.0035 here
        assert abs(counts[token] / n - p) < 4 * sigma, (token, counts)


def test_a_rows_draw_does_not_depend_on_the_rows_beside_it():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    alone = [sample_token(logits[row], 0.7, 1.0, -1, torch.Generator().manual_seed(row))[0] for row in range(6)]
    together = sample_tokens(
        logits, [0.7] * 6, [1.0] * 6, [-1] * 6, [torch.Generator().manual_seed(r) for r in range(6)]
    )
    assert [token for token, _ in together] == alone
    # A greedy row in the batch takes its argmax and leaves the others' draws alone.
    mixed = sample_tokens(
        logits,
        [0.7, 0.0, 0.7, 0.7, 0.7, 0.7],
        [1.0] * 6,
        [-1] * 6,
        [torch.Generator().manual_seed(r) for r in range(6)],
    )
    assert mixed[1][0] == int(torch.argmax(logits[1]))
    assert [t for i, (t, _) in enumerate(mixed) if i != 1] == [t for i, t in enumerate(alone) if i != 1]


def test_top_p_never_samples_outside_nucleus():
    # p = [0.5, 0.3, 0.2]: top_p = 0.6 keeps the two most likely tokens only.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    generator = torch.Generator().manual_seed(0)
    drawn = {sample_token(logits, 1.0, 0.6, -1, generator)[0] for _ in range(300)}
    assert drawn == {0, 1}


def test_rejects_bad_requests(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS)
    with pytest.raises(ValueError, match="max_tokens"):
        run(engine.generate([1], max_tokens=0))
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        run(engine.generate([], max_tokens=3))


def test_samples_do_not_depend_on_batching_or_arrival_order(random_qwen2):
    # η = 0 must reproduce synchronous training: the same requests must give the same samples
    # whether they share a batch or not and in whatever order they arrive.
    prompts = [[5, 6, 7], [9] * 11, [5, 6, 7], [42]]  # a repeated prompt gets two different draws

    def sample(order: list[int], max_batch_size: int) -> dict[int, list[int]]:
        engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=max_batch_size, seed=3)

        async def go():
            return await asyncio.gather(*[engine.generate(prompts[i], max_tokens=8) for i in order])

        return dict(zip(order, [r.token_ids for r in run(go())], strict=True))

    together = sample([0, 1, 2, 3], max_batch_size=4)
    one_at_a_time = sample([3, 1, 0, 2], max_batch_size=1)
    assert together[1] == one_at_a_time[1] and together[3] == one_at_a_time[3]
    # The repeated prompt: first and second asks map to the same two draws, which differ.
    assert together[0] == one_at_a_time[0] and together[2] == one_at_a_time[2]
    assert together[0] != together[2]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batch_invariant_decoding_gives_a_request_the_same_bits_alone_or_among_others(random_qwen2, temperature):
    # A replay regenerates a request among other requests than the original run had in flight. Batched decoding
    # left-pads the caches, and a log-prob then changes in its last bits with the batch (measured up to 4e-6 on
    # the tiny model, in 14 of 32 tokens); decoded alone, nothing of the others reaches it.
    def generate(others: int, batch_invariant: bool):
        engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=8, batch_invariant=batch_invariant)

        async def go():
            target = engine.generate([5, 6, 7], max_tokens=24, temperature=temperature, seed=11)
            rest = [engine.generate([9] * n + [3], 24 - n, temperature=temperature, seed=n) for n in range(others)]
            return await asyncio.gather(target, *rest)

        return run(go())[0]

    alone, among_others = generate(0, batch_invariant=True), generate(7, batch_invariant=True)
    assert alone.token_ids == among_others.token_ids
    assert alone.logprobs == among_others.logprobs  # exact floats, not close ones
    # Decoding alone is the same computation as a batch of one (no padding): the full-forward reference holds.
    reference = full_forward_logprobs(random_qwen2, [5, 6, 7], alone.token_ids, temperature=temperature)
    torch.testing.assert_close(torch.tensor(alone.logprobs), reference, atol=1e-4, rtol=0)


def test_released_weights_free_their_storage_and_come_back_with_the_next_load(random_qwen2):
    import copy

    model = copy.deepcopy(random_qwen2)
    engine = ContinuousBatchingEngine(model, NO_EOS)
    parameters = sum(p.numel() * p.element_size() for p in random_qwen2.parameters())  # counted independently
    assert engine.weight_bytes() == parameters
    before = run(engine.generate([4, 5, 6], max_tokens=6, temperature=0.0)).token_ids
    engine.release_weights()
    assert engine.weight_bytes() == 0 and not engine.has_weights
    with pytest.raises(RuntimeError, match="weights were released"):
        run(engine.generate([4, 5, 6], max_tokens=6, temperature=0.0))
    litter = [torch.full((8,), float("nan")) for _ in range(1000)]  # reuse freed memory: no stale values survive
    engine.load_state_dict(random_qwen2.state_dict(), version=1)
    del litter
    assert engine.weight_bytes() == parameters
    for name, buffer in random_qwen2.named_buffers():  # not in any state dict: kept across the release
        torch.testing.assert_close(engine.model.get_buffer(name), buffer)
    after = run(engine.generate([4, 5, 6], max_tokens=6, temperature=0.0))
    assert after.token_ids == before and after.versions == [1] * 6  # same weights, rotary buffers intact


def test_single_request_abort_returns_its_partial_output_and_leaves_the_others(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=2)

    async def go():
        tasks = [asyncio.create_task(engine.generate([1, 2, 3], max_tokens=40, request_id=f"r{i}")) for i in range(2)]
        while engine.generated_tokens < 4:
            await asyncio.sleep(0.001)
        assert engine.abort("r0") and not engine.abort("nope")
        return await asyncio.gather(*tasks)

    first, second = run(go())
    assert first.stop_reason == STOP_ABORTED and 0 < len(first.token_ids) < 40
    assert second.stop_reason == STOP_COMPLETED and len(second.token_ids) == 40
