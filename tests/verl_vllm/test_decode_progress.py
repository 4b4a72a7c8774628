"""verl's vLLM server under ``areal_async`` counts tokens as vLLM streams them, not when a request returns.

The stall guard and the step metrics read the server's ``generated_tokens``. A 16k-token answer decoding at 25
tokens/s returns after 11 minutes: counted at its return, the engine looked idle all that while. Real verl server
code (its gate), a stand-in engine that streams cumulative outputs as vLLM's ``AsyncLLM.generate`` does.
"""

from __future__ import annotations

import asyncio
import inspect
import types

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

from areal_plugins.rollout.verl_vllm.server import ArealVLLMHttpServer
from tests.verl_vllm.test_abort_interrupts import server_of


class StreamingEngine:
    """Streams one request's tokens a step at a time, as cumulative outputs, pausing where the test says."""

    def __init__(self, steps: list[list[int]]) -> None:
        self.steps = steps
        self.output_processor = types.SimpleNamespace(request_states={})
        self.resume = asyncio.Event()

    async def add_request(self, *args, **kwargs) -> None:
        pass

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        for index, tokens in enumerate(self.steps):
            if index == 2:  # mid-answer: the test reads the count here
                await self.resume.wait()
            yield types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=list(tokens))], finished=False)


def test_tokens_count_while_the_answer_decodes_and_once_each():
    async def scenario() -> tuple[int, int, int]:
        server = server_of(ArealVLLMHttpServer)
        server.generated_tokens = 0
        server.engine = StreamingEngine([[1], [1, 2, 3], [1, 2, 3, 4, 5]])
        assert await server._park_until_admitted("r1") is None

        async def consume() -> None:  # as verl's generate does: iterate self.engine.generate to the end
            async for _ in server.engine.generate(prompt=None, sampling_params=None, request_id="r1"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        mid_answer = server.generated_tokens
        server.engine.resume.set()
        await task
        after = server.generated_tokens
        assert await server._park_until_admitted("r2") is None  # the engine is wrapped once, not twice
        server.engine.resume.clear()
        server.engine.steps = [[7], [7, 8]]
        await consume()
        return mid_answer, after, server.generated_tokens

    mid_answer, after, second = asyncio.run(scenario())
    assert (mid_answer, after, second) == (3, 5, 7)


def test_verl_iterates_the_engines_generate_in_its_own():
    """What the count relies on: verl's ``generate`` reads ``self.engine.generate`` and iterates every output."""
    source = inspect.getsource(vLLMHttpServer.generate)
    assert "self.engine.generate(" in source and "async for output in generator" in source
