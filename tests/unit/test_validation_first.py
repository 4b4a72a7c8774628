"""verl's periodic validation goes ahead of the training backlog on ``areal_cpu`` (issue 47, item 7).

At 7B scale tens of thousands of training requests are in flight when a validation starts; queued behind them it
lasted as long as draining them. A validation request is marked by the episode it runs in (verl's
``trajectory["validate"]``), sent with the mark by our client where the backend declares ``validation_first``, and
the engine gives it the next free slot of its running batch, ahead of every waiting training request; the running
batch is not preempted. Order is counted by which request finishes when, never by wall time: every request decodes
a fixed number of tokens (no end-of-sequence token), so each finishes a known number of model steps after it is
admitted.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf

from areal_plugins.rollout.base import VALIDATION_KWARG
from areal_plugins.rollout.cpu.engine import STOP_ABORTED, STOP_COMPLETED, ContinuousBatchingEngine
from areal_plugins.testing.holds import FinishFirstGroups

NO_EOS: list[int] = []
#: Every request decodes exactly this many tokens: one from its prefill, then one per decode step.
TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from areal_plugins.tiny.model import TinyModelSpec, build_tiny_model

    out = tmp_path_factory.mktemp("validation_first_model")
    build_tiny_model(out, TinyModelSpec(warmstart_steps=0, hidden_size=64, intermediate_size=128))
    return out


def finish_order(server: Any, backlog: int, marked: bool) -> list[str]:
    """``backlog`` training requests through the server's ``generate`` (verl's entry), then, once the engine has
    started on them, one validation request; the names in the order the requests finished."""
    params = {"max_tokens": TOKENS, "ignore_eos": True, "logprobs": True}
    order: list[str] = []

    async def ask(name: str, prompt: list[int], **kwargs: Any) -> None:
        output = await server.generate(prompt, dict(params), name, **kwargs)
        assert output.stop_reason == STOP_COMPLETED and len(output.token_ids) == TOKENS
        order.append(name)

    async def scenario() -> None:
        training = [asyncio.create_task(ask(f"t{i}", [5 + i, 9, 9])) for i in range(backlog)]
        while server.engine.generated_tokens == 0:  # the first two are running, the rest wait
            await asyncio.sleep(0)
        mark = {VALIDATION_KWARG: True} if marked else {}
        await asyncio.gather(*training, ask("val", [50, 9, 9], **mark))

    asyncio.run(scenario())
    return order


def test_a_validation_request_finishes_before_the_training_backlog(model_dir):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    server = CPURolloutServer(str(model_dir), response_length=64, max_model_len=128, max_batch_size=2)
    # By hand, 2 slots, 4 tokens a request: t0 and t1 run in steps 1-4 (the validation arrives during them and is not
    # let in ahead of them); in step 5 the two freed slots go to the validation request, first, and to t2; both end
    # in step 8; then t3 and t4 (steps 9-12), t5 (13-16). First come, first served, it would have finished last.
    assert finish_order(server, backlog=6, marked=True) == ["t0", "t1", "val", "t2", "t3", "t4", "t5"]
    unmarked = CPURolloutServer(str(model_dir), response_length=64, max_model_len=128, max_batch_size=2)
    assert finish_order(unmarked, backlog=6, marked=False)[-1] == "val"  # the queue it would have waited in


def test_validation_requests_keep_their_own_order_ahead_of_training(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=1)
    order: list[str] = []

    async def ask(name: str, prompt: list[int], validation: bool) -> None:
        await engine.generate(prompt, max_tokens=2, request_id=name, ignore_eos=True, validation=validation)
        order.append(name)

    async def scenario() -> None:
        asks = [("t0", False), ("t1", False), ("v0", True), ("t2", False), ("v1", True)]
        # All asked before the engine admits any: the two validation requests first, in their order, then training.
        await asyncio.gather(*(ask(name, [7 + i, 3], validation) for i, (name, validation) in enumerate(asks)))

    asyncio.run(scenario())
    assert order == ["v0", "v1", "t0", "t1", "t2"]


async def settled(engine: ContinuousBatchingEngine) -> None:
    """Wait until nothing is waiting or running (held requests are neither)."""
    while engine._running or engine._waiting:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.01)


def test_a_validation_request_is_never_held_and_takes_no_group_that_finishes(random_qwen2):
    # One group finishes per version; every other is held after 1 token. The validation prompt is asked first.
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=4, holds=FinishFirstGroups(1, 1))

    async def scenario() -> tuple[Any, Any, asyncio.Future]:
        validation = asyncio.ensure_future(engine.generate([40, 41], max_tokens=3, request_id="v", validation=True))
        first = asyncio.ensure_future(engine.generate([5, 6], max_tokens=3, request_id="a"))
        second = asyncio.ensure_future(engine.generate([7, 8], max_tokens=3, request_id="b"))
        await asyncio.sleep(0)
        await settled(engine)
        return validation, first, second

    async def go() -> None:
        validation, first, second = await scenario()
        # The validation request ran to its end; the first training group is still the one that finishes.
        assert validation.done() and validation.result().stop_reason == STOP_COMPLETED
        assert first.done() and first.result().stop_reason == STOP_COMPLETED
        assert not second.done() and [r.request_id for r in engine._held] == ["b"]
        engine.abort_all()
        assert (await second).stop_reason == STOP_ABORTED

    asyncio.run(go())


def test_an_abort_cuts_a_validation_request_which_continues_under_the_new_version(random_qwen2):
    engine = ContinuousBatchingEngine(random_qwen2, NO_EOS, max_batch_size=2)
    state = {name: tensor.clone() for name, tensor in random_qwen2.state_dict().items()}

    async def go() -> None:
        running = asyncio.ensure_future(engine.generate([4, 5], max_tokens=50, request_id="v", validation=True))
        while engine.generated_tokens < 2:
            await asyncio.sleep(0)
        assert engine.abort_all() == ["v"]
        partial = await running
        assert partial.stop_reason == STOP_ABORTED and partial.versions == [0] * len(partial.token_ids)
        engine.load_state_dict(state, version=1)
        # The client continues it as prompt + partial output, still marked.
        rest = await engine.generate(
            [4, 5, *partial.token_ids], max_tokens=3, request_id="v2", ignore_eos=True, validation=True
        )
        assert rest.stop_reason == STOP_COMPLETED and rest.versions == [1, 1, 1]

    asyncio.run(go())


# ---------------------------------------------------------------------- the client marks validation requests


class RecordingServer:
    """A rollout server's handle (verl's client calls ``generate.remote``): the first request is aborted after one
    token (a weight update), the resubmission completes; the keywords of each request are kept."""

    def __init__(self) -> None:
        self.keywords: list[dict[str, Any]] = []
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs: Any):
        from verl.workers.rollout.replica import TokenOutput

        self.keywords.append(kwargs)
        aborted = len(self.keywords) == 1
        return TokenOutput(
            token_ids=[11] if aborted else [12, 13],
            log_probs=[-0.1] if aborted else [-0.2, -0.3],
            stop_reason="aborted" if aborted else "completed",
            extra_fields={"global_steps": len(self.keywords) - 1},
        )


def balancer(server: RecordingServer) -> SimpleNamespace:
    """verl's load balancer's calls, as the base client makes them, over one server."""

    async def fields() -> list[str]:
        return []

    async def acquire(request_id: str, **fields: Any) -> tuple[str, RecordingServer]:
        return "s0", server

    return SimpleNamespace(
        require_acquire_fields=SimpleNamespace(remote=fields),
        require_release_fields=SimpleNamespace(remote=fields),
        acquire_server=SimpleNamespace(remote=acquire),
        release_server=SimpleNamespace(remote=lambda **kwargs: None),
    )


def keywords_sent(backend: str, validation: bool | None, monkeypatch) -> list[dict[str, Any]]:
    """What reached the server for one interrupted call from an episode (None: no episode) on ``backend``."""
    from verl.workers.rollout import llm_server

    from areal_plugins.agent_loop.episodes import CURRENT_EPISODE, EpisodeRecord
    from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient

    async def no_pause(seconds: float) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(llm_server, "asyncio", SimpleNamespace(sleep=no_pause, gather=asyncio.gather))
    config = {"actor_rollout_ref": {"rollout": {"name": backend, "response_length": 8}}, "trainer": {"save_freq": -1}}
    server = RecordingServer()
    client = InterruptibleLLMClient(OmegaConf.create(config), balancer(server))

    async def call() -> Any:
        if validation is not None:
            CURRENT_EPISODE.set(EpisodeRecord(validation=validation))
        return await client.generate("r", prompt_ids=[1, 2], sampling_params={"max_tokens": 3})

    output = asyncio.run(call())
    assert output.token_ids == [11, 12, 13]
    return server.keywords


@pytest.mark.parametrize("backend", ["areal_cpu", "vllm"])
def test_the_client_marks_every_request_of_a_validation_episode(backend, monkeypatch):
    sent = keywords_sent(backend, validation=True, monkeypatch=monkeypatch)
    assert [kwargs.get(VALIDATION_KWARG) for kwargs in sent] == [True, True]  # the resubmission keeps the mark


def test_a_client_marks_its_second_validation_call_too(monkeypatch):
    """The backend's answer is cached on the client: the cache must not hide the method (a bool attribute of the
    method's name did, failing every validation call after a client's first: 'bool' object is not callable)."""
    from verl.workers.rollout import llm_server

    from areal_plugins.agent_loop.episodes import CURRENT_EPISODE, EpisodeRecord
    from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient

    async def no_pause(seconds: float) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(llm_server, "asyncio", SimpleNamespace(sleep=no_pause, gather=asyncio.gather))
    config = {
        "actor_rollout_ref": {"rollout": {"name": "areal_cpu", "response_length": 8}},
        "trainer": {"save_freq": -1},
    }
    server = RecordingServer()
    client = InterruptibleLLMClient(OmegaConf.create(config), balancer(server))

    async def call(request_id: str) -> Any:
        CURRENT_EPISODE.set(EpisodeRecord(validation=True))
        return await client.generate(request_id, prompt_ids=[1, 2], sampling_params={"max_tokens": 3})

    asyncio.run(call("first"))
    second = asyncio.run(call("second"))  # the server completes it at once
    assert second.token_ids == [12, 13]
    assert [kwargs.get(VALIDATION_KWARG) for kwargs in server.keywords] == [True, True, True]


@pytest.mark.parametrize(("backend", "validation"), [("areal_cpu", False), ("areal_cpu", None), ("sglang", True)])
def test_the_client_does_not_mark_training_or_a_backend_without_validation_first(backend, validation, monkeypatch):
    """verl's sglang server takes no keyword it does not know: it never gets the mark."""
    sent = keywords_sent(backend, validation=validation, monkeypatch=monkeypatch)
    assert len(sent) == 2 and all(VALIDATION_KWARG not in kwargs for kwargs in sent)


def test_the_episode_of_a_validation_prompt_is_marked_as_verl_passes_it(monkeypatch):
    """verl's TransferQueue worker runs each episode with ``trajectory=...`` (``validate`` set by ``_validate``)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from areal_plugins.agent_loop.episode_workers import EpisodeAgentLoopWorker
    from areal_plugins.agent_loop.episodes import CURRENT_EPISODE

    seen: list[bool] = []

    async def verls_episode(self: Any, sampling_params: dict, trajectory: dict, **kwargs: Any) -> None:
        record = CURRENT_EPISODE.get()
        assert record is not None
        seen.append(record.validation)

    monkeypatch.setattr(AgentLoopWorker, "_run_agent_loop", verls_episode)
    worker = object.__new__(EpisodeAgentLoopWorker)
    worker.environment_timeout_s = 60.0

    async def run(validate: bool) -> None:
        await worker._run_agent_loop({}, trajectory={"validate": validate}, uid="u", session_id=0)

    asyncio.run(run(True))
    asyncio.run(run(False))
    assert seen == [True, False]


def test_areal_async_routes_vllms_priority_scheduling():
    """vLLM orders its waiting queue by priority only under ``scheduling_policy: priority`` (fcfs ignores it)."""
    from areal_plugins.config.routing import ROUTED_VERL_KEYS, verl_setting
    from areal_plugins.config.settings import ArealConfig

    assert ROUTED_VERL_KEYS["actor_rollout_ref.rollout.scheduling_policy"] == "scheduling_policy"
    assert verl_setting("scheduling_policy", ArealConfig(enable=True, mode="async")) == "priority"
    assert verl_setting("scheduling_policy", ArealConfig(enable=True, mode="sync")) == "fcfs"  # verl's default
    assert verl_setting("scheduling_policy", ArealConfig(enable=False)) == "fcfs"
