"""Episode records across turns: the rollout client's merge, alignment, the environment watchdog, tool accounting."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from areal_plugins.agent_loop.episode_workers import EpisodeAgentLoopWorker, EpisodeStalledError, account_tool_calls
from areal_plugins.agent_loop.episodes import CURRENT_EPISODE, EpisodeAlignmentError, EpisodeRecord
from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient
from areal_plugins.core.trajectory_rows import CHUNKS_FIELD
from areal_plugins.rollout.base import SEED_FIELD


def scripted_server(monkeypatch, chunks: list[tuple[list[int], list[int], str]]) -> list[list[int]]:
    """verl's client answers with ``chunks`` (tokens, versions, stop reason) in turn; returns the prompts it saw."""
    prompts: list[list[int]] = []
    queue = list(chunks)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        prompts.append(list(prompt_ids))
        tokens, versions, stop = queue.pop(0)
        extra = {"token_versions": versions, "global_steps": versions[-1] if versions else 0}
        return TokenOutput(
            token_ids=tokens,
            log_probs=[-0.5] * len(tokens),
            stop_reason=stop,
            extra_fields=extra | {SEED_FIELD: 100 + len(prompts)},  # the k-th request the server saw: seed 100 + k
        )

    monkeypatch.setattr(LLMServerClient, "generate", generate)
    return prompts


def client() -> InterruptibleLLMClient:
    instance = object.__new__(InterruptibleLLMClient)
    instance.config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(response_length=32)))
    return instance


async def two_turns(llm: InterruptibleLLMClient, record: EpisodeRecord) -> None:
    CURRENT_EPISODE.set(record)
    await llm.generate("episode", prompt_ids=[100], sampling_params={"max_tokens": 8})
    await llm.generate("episode", prompt_ids=[100, 1, 2, 3, 50, 51], sampling_params={"max_tokens": 8})


def test_a_two_turn_episode_keeps_every_turns_versions_and_says_where_updates_met_it(monkeypatch):
    # Turn 1 under version 0; the weights move to 1 during the tool call; turn 2 is interrupted
    # after two tokens and resumed under version 2.
    prompts = scripted_server(
        monkeypatch,
        [([1, 2, 3], [0, 0, 0], "completed"), ([7, 8], [1, 1], "aborted"), ([9, 10], [2, 2], "completed")],
    )
    record = EpisodeRecord()
    asyncio.run(two_turns(client(), record))
    assert record.versions == [0, 0, 0, 1, 1, 2, 2]
    assert record.turn_tokens == [3, 4]
    assert (record.interrupts_within_turns, record.updates_between_turns) == (1, 1)
    assert prompts[2] == [100, 1, 2, 3, 50, 51, 7, 8]  # the interrupted turn resumed as prompt + partial
    fields = record.extra_fields(trained_tokens=7, truncated=False)
    assert (fields["min_global_steps"], fields["max_global_steps"], fields["num_interrupts"]) == (0, 2, 1)
    assert fields["token_versions"] == [0, 0, 0, 1, 1, 2, 2]
    # The schedule a replay follows: turn 1 from token 0 (request 1), turn 2 from token 3 (request 2) and its
    # continuation from token 5 (request 3), each with its version and seed.
    assert fields[CHUNKS_FIELD] == [[0, 0, 101], [3, 1, 102], [5, 2, 103]]
    # verl cut the response after 4 tokens: the continuation produced none of them.
    assert record.extra_fields(trained_tokens=4, truncated=True)[CHUNKS_FIELD] == [[0, 0, 101], [3, 1, 102]]


def test_outside_an_episode_the_client_reports_its_call_alone(monkeypatch):
    scripted_server(monkeypatch, [([4, 5], [3, 3], "aborted"), ([6], [4], "completed")])
    out = asyncio.run(client().generate("one", prompt_ids=[100], sampling_params={"max_tokens": 8}))
    assert out.token_ids == [4, 5, 6]
    assert out.extra_fields["token_versions"] == [3, 3, 4]
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (3, 4)
    assert out.extra_fields["num_interrupts"] == 1
    assert out.extra_fields[CHUNKS_FIELD] == [[0, 3, 101], [2, 4, 102]]
    assert SEED_FIELD not in out.extra_fields  # only per request, in its chunk


def test_a_request_that_returned_nothing_is_not_a_chunk(monkeypatch):
    # Rejected behind a closed gate (no tokens), then run in full under version 5.
    scripted_server(monkeypatch, [([], [], "aborted"), ([4, 5], [5, 5], "completed")])
    out = asyncio.run(client().generate("one", prompt_ids=[100], sampling_params={"max_tokens": 8}))
    assert out.extra_fields[CHUNKS_FIELD] == [[0, 5, 102]]


def test_versions_that_cannot_line_up_with_the_trained_tokens_are_refused():
    record = EpisodeRecord()
    record.add_turn([0, 0, 0], 0)
    record.add_turn([1, 1], 0)
    with pytest.raises(EpisodeAlignmentError, match="generated 5 tokens over 2 turn"):
        record.extra_fields(trained_tokens=6, truncated=True)  # more trained tokens than generated
    with pytest.raises(EpisodeAlignmentError):
        record.extra_fields(trained_tokens=4, truncated=False)  # a generated token lost without truncation
    # verl cut the response at response_length: the versions of the kept tokens.
    assert record.extra_fields(trained_tokens=4, truncated=True)["token_versions"] == [0, 0, 0, 1]


def test_time_outside_the_engine_runs_only_between_turns():
    record = EpisodeRecord()
    record.enter_engine()
    assert record.seconds_outside_engine() == 0.0
    record.add_turn([0], 0)
    assert record.seconds_outside_engine(now=time.monotonic() + 5) >= 5
    record.finished = True
    assert record.seconds_outside_engine(now=time.monotonic() + 5) == 0.0


def watched_worker(limit_s: float) -> EpisodeAgentLoopWorker:
    worker = object.__new__(EpisodeAgentLoopWorker)
    worker.environment_timeout_s = limit_s
    return worker


def test_an_episode_stuck_in_a_tool_fails_and_is_cancelled(monkeypatch):
    cancelled = []

    async def stuck_in_a_tool(self, *args, **kwargs):
        record = CURRENT_EPISODE.get()
        record.enter_engine()
        record.add_turn([0, 0], 0)  # turn 1 done; the tool never returns
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.append(True)

    monkeypatch.setattr(AgentLoopWorker, "_run_agent_loop", stuck_in_a_tool)
    start = time.monotonic()
    with pytest.raises(EpisodeStalledError, match=r"outside the engine .* after 1 turn"):
        asyncio.run(watched_worker(0.4)._run_agent_loop({}, {}))
    assert time.monotonic() - start < 3
    assert cancelled == [True]


def test_one_stalled_episode_among_many_fails_alone(monkeypatch):
    # One timer watches all of a worker's episodes: it must cancel the stuck one and no other.
    async def episode(self, index, *args, **kwargs):
        record = CURRENT_EPISODE.get()
        record.enter_engine()
        if index == 3:  # turn 1 done, then a tool that never returns
            record.add_turn([0], 0)
            await asyncio.sleep(3600)
        await asyncio.sleep(0.8)  # the others generate, longer than the limit
        record.add_turn([0], 0)
        return index

    monkeypatch.setattr(AgentLoopWorker, "_run_agent_loop", episode)
    worker = watched_worker(0.4)

    async def many():
        return await asyncio.gather(*[worker._run_agent_loop(i) for i in range(6)], return_exceptions=True)

    results = asyncio.run(many())
    assert [r for i, r in enumerate(results) if i != 3] == [0, 1, 2, 4, 5]
    assert isinstance(results[3], EpisodeStalledError)


def test_a_long_generation_is_not_a_stalled_episode(monkeypatch):
    async def slow_engine(self, *args, **kwargs):
        record = CURRENT_EPISODE.get()
        record.enter_engine()
        await asyncio.sleep(1.0)  # parked behind a weight update, longer than the limit
        record.add_turn([0], 0)
        return "episode output"

    monkeypatch.setattr(AgentLoopWorker, "_run_agent_loop", slow_engine)
    assert asyncio.run(watched_worker(0.3)._run_agent_loop({}, {})) == "episode output"


def test_tool_calls_are_timed_and_failures_counted_while_verl_still_sees_them(monkeypatch):
    from verl.tools import function_tool
    from verl.tools.function_tool import load_function_tools_from_path

    import areal_plugins.tiny

    # verl loads the tool by its file path; a test file in this process that imported the module by name registered
    # the same function under another module: verl's registry refuses the second (its own registry, this test's copy).
    monkeypatch.setattr(function_tool, "FUNCTION_TOOL_REGISTRY", {})
    (calculator,) = load_function_tools_from_path(str(next(iter(areal_plugins.tiny.__path__)) + "/calculator_tool.py"))
    account_tool_calls(calculator)
    account_tool_calls(calculator)  # wrapping twice must not count twice

    async def episode() -> EpisodeRecord:
        record = EpisodeRecord()
        CURRENT_EPISODE.set(record)
        assert await calculator.call({"expression": "37+48"}) == "85"
        with pytest.raises(ValueError, match="adds two whole numbers"):
            await calculator.call({"expression": "37*48"})
        return record

    record = asyncio.run(episode())
    assert (record.tool_calls, record.tool_failures) == (2, 1)
    assert record.tool_seconds > 0
