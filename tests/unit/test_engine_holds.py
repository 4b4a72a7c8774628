"""Interruptions by construction (testing/holds.py): only the first prompt groups of a weight version finish.

The tests count by hand what must finish and what must be held, whatever the speed of the machine: no timing is
involved, the engine is driven until it has nothing left to decode.
"""

from __future__ import annotations

import asyncio

import pytest

from areal_plugins.rollout.cpu.engine import STOP_ABORTED, STOP_COMPLETED, ContinuousBatchingEngine
from areal_plugins.testing.faults import ENGINE_STEP_DELAY_ENV, fault_plan
from areal_plugins.testing.holds import FinishFirstGroups

NO_EOS: list[int] = []


async def settled(engine: ContinuousBatchingEngine) -> None:
    """Wait until nothing is waiting or running (held requests are neither)."""
    while engine._running or engine._waiting:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.01)  # the tasks awaiting finished requests resume


def test_only_the_first_groups_finish_and_the_others_are_held_with_output_to_cut(random_qwen2):
    # 4 groups (prompts) x 3 answers, asked interleaved; 2 groups finish per version, held requests stop at 2 tokens.
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=2, holds=FinishFirstGroups(2, 2))
    prompts = {group: [group + 3, 11, 12] for group in range(4)}
    order = [(group, answer) for answer in range(3) for group in range(4)]  # g0a0 g1a0 g2a0 g3a0 g0a1 ...

    async def go():
        tasks = {
            (g, a): asyncio.ensure_future(engine.generate(prompts[g], max_tokens=6, request_id=f"r{g}-{a}"))
            for g, a in order
        }
        await asyncio.sleep(0)  # every request is asked for before any is decoded
        await settled(engine)
        finished = {key: task.result() for key, task in tasks.items() if task.done()}
        held = len(engine._held)
        assert engine.abort_all()
        cut = {key: await task for key, task in tasks.items() if key not in finished}
        return finished, held, cut

    finished, held, cut = asyncio.run(go())
    # Groups 0 and 1 were asked for first: their 6 requests run to the end, batch of 2 or not.
    assert sorted(finished) == [(g, a) for g in (0, 1) for a in range(3)]
    assert all(r.stop_reason == STOP_COMPLETED and len(r.token_ids) == 6 for r in finished.values())
    # Groups 2 and 3 decoded 2 tokens each and waited: the abort cuts them with that output.
    assert held == 6
    assert sorted(cut) == [(g, a) for g in (2, 3) for a in range(3)]
    assert all(r.stop_reason == STOP_ABORTED and len(r.token_ids) == 2 for r in cut.values())


def test_a_continuation_keeps_its_group_and_new_weights_choose_the_groups_again(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=4, holds=FinishFirstGroups(1, 1))
    state = {name: tensor.clone() for name, tensor in random_qwen2.state_dict().items()}

    async def go():
        first = asyncio.ensure_future(engine.generate([5, 6], max_tokens=4, request_id="a"))
        second = asyncio.ensure_future(engine.generate([7, 8], max_tokens=4, request_id="b"))
        await asyncio.sleep(0)
        await settled(engine)
        assert first.done() and not second.done()  # group [5, 6] finishes, [7, 8] is held after 1 token
        engine.abort("b")
        partial = await second
        assert partial.stop_reason == STOP_ABORTED and len(partial.token_ids) == 1
        engine.load_state_dict(state, version=1)  # version 1: the first group asked for finishes again
        # Under version 1 another answer of the prompt [7, 8] is asked for first, then "b" continues as prompt +
        # partial output under a new request id (verl's client draws one per call), then a new prompt: "b" is still of
        # the group [7, 8], which finishes under version 1; the new prompt's group is held.
        sibling = asyncio.ensure_future(engine.generate([7, 8], max_tokens=3, request_id="d"))
        resumed = asyncio.ensure_future(engine.generate([7, 8, *partial.token_ids], max_tokens=3, request_id="b2"))
        other = asyncio.ensure_future(engine.generate([9, 9], max_tokens=4, request_id="c"))
        await asyncio.sleep(0)
        await settled(engine)
        assert sibling.done() and resumed.done() and resumed.result().stop_reason == STOP_COMPLETED
        assert resumed.result().versions == [1, 1, 1]
        assert not other.done() and engine.num_in_flight == 1
        # New weights release a held request: it goes on under them.
        engine.load_state_dict(state, version=2)
        result = await asyncio.wait_for(other, timeout=60)
        assert result.stop_reason == STOP_COMPLETED and result.versions == [1, 2, 2, 2]

    asyncio.run(go())


def test_without_holds_every_request_finishes(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=2)

    async def go():
        return await asyncio.gather(*[engine.generate([g + 3, 4], max_tokens=3, request_id=str(g)) for g in range(5)])

    assert all(r.stop_reason == STOP_COMPLETED for r in asyncio.run(go()))


@pytest.mark.parametrize(
    ("groups", "tokens", "key"), [(0, 1, "finish_groups_per_version"), (1, 0, "hold_others_at_token")]
)
def test_a_hold_that_could_not_work_is_refused_naming_the_key(groups, tokens, key):
    with pytest.raises(ValueError, match=f"engine_kwargs.areal_cpu.{key}"):
        FinishFirstGroups(groups, tokens)


def test_the_step_delay_comes_from_its_variable_and_a_bad_value_is_refused(monkeypatch, random_qwen2):
    monkeypatch.delenv(ENGINE_STEP_DELAY_ENV, raising=False)
    assert fault_plan().engine_step_delay_s == 0.0
    monkeypatch.setenv(ENGINE_STEP_DELAY_ENV, "0.25")
    assert fault_plan().engine_step_delay_s == 0.25
    for bad in ("fast", "-1"):
        monkeypatch.setenv(ENGINE_STEP_DELAY_ENV, bad)
        with pytest.raises(ValueError, match=ENGINE_STEP_DELAY_ENV):
            fault_plan()
    # The delay is spent in every model step: 3 tokens of one request are 3 steps (one prefill, two decodes).
    import time

    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, step_delay_s=0.2)
    started = time.perf_counter()
    asyncio.run(engine.generate([3, 4], max_tokens=3))
    assert time.perf_counter() - started >= 0.6


def test_the_trainers_micro_batch_delay_comes_from_its_variable_and_is_spent_in_the_loss(monkeypatch):
    import time

    import torch

    from areal_plugins.testing.faults import TRAINER_MICROBATCH_DELAY_ENV
    from areal_plugins.trainer_workers import policy_loss

    def fresh(value: str | None) -> float:
        if value is None:
            monkeypatch.delenv(TRAINER_MICROBATCH_DELAY_ENV, raising=False)
        else:
            monkeypatch.setenv(TRAINER_MICROBATCH_DELAY_ENV, value)
        return fault_plan().trainer_microbatch_delay_s

    assert fresh(None) == 0.0
    for bad in ("slow", "-0.5"):
        with pytest.raises(ValueError, match=TRAINER_MICROBATCH_DELAY_ENV):
            fresh(bad)
    assert fresh("0.3") == 0.3
    zeros = torch.zeros(1, 4)
    started = time.perf_counter()
    with pytest.raises(ValueError):  # the delay comes first: before the loss looks at its inputs
        policy_loss.areal_decoupled_policy_loss(zeros, zeros, zeros, torch.ones(1, 4), "token-mean")
    assert time.perf_counter() - started >= 0.3
