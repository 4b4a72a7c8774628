"""An abort on verl's vLLM server under ``areal_async`` interrupts at once, also with requests queued in the engine.

verl's abort first waits until every request past its submission gate has reached the engine, but counts a
request as arrived only at its first output. A request queued behind ``max_num_seqs`` has none, so the abort (and
the weight update behind it) waited until the queue had drained, up to 60 s. Our server counts a request as
arrived when the engine's ``add_request`` returns. Real verl server code (gate, abort), a stand-in engine.
"""

from __future__ import annotations

import asyncio
import types

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

from areal_plugins.rollout.verl_vllm.server import _ENTERING, ArealVLLMHttpServer


class QueueingEngine:
    """What the server's gate and abort touch of vLLM's ``AsyncLLM``: requests are queued, none produces output."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.output_processor = types.SimpleNamespace(request_states={})
        self.arrival = asyncio.Event()
        self.arrival.set()

    async def add_request(self, request_id: str, *args, **kwargs) -> None:
        await self.arrival.wait()
        self.output_processor.request_states[request_id] = object()
        self.events.append(f"queued {request_id}")

    async def pause_generation(self, **kwargs) -> None:
        self.events.append("paused")

    async def generate(self, *args, **kwargs):  # the server wraps it to count tokens; no request here decodes
        return
        yield


def server_of(cls: type) -> vLLMHttpServer:
    """The server's gate state as verl's ``__init__`` sets it (no engine is launched)."""
    server = object.__new__(cls)
    if cls is ArealVLLMHttpServer:
        server._entering_engine = set()
    server.node_rank = 0
    server.global_steps = 0
    server._submission_paused = False
    server._rejecting = False
    server._resume_event = asyncio.Event()
    server._admitting = 0
    server.engine = QueueingEngine()
    return server


async def submit(server: vLLMHttpServer, request_id: str) -> None:
    """A request through verl's gate into the engine's queue, as ``generate`` does before any output."""
    assert await server._park_until_admitted(request_id) is None
    await server.engine.add_request(request_id)


def test_an_abort_does_not_wait_for_requests_queued_in_the_engine():
    async def scenario() -> tuple[list[str], bool]:
        ours, verls = server_of(ArealVLLMHttpServer), server_of(vLLMHttpServer)
        for server in (ours, verls):
            await submit(server, "queued-1")
            await submit(server, "queued-2")
        await asyncio.wait_for(ours.abort_all_requests(), timeout=2)
        try:  # verl's own count still holds both requests: its abort waits (60 s)
            await asyncio.wait_for(verls.abort_all_requests(), timeout=1)
            verl_waited = False
        except TimeoutError:
            verl_waited = True
        return ours.engine.events, verl_waited

    events, verl_waited = asyncio.run(scenario())
    assert events == ["queued queued-1", "queued queued-2", "paused"]
    assert verl_waited, "verl's abort no longer waits for queued requests: the override may be retired"


def test_an_abort_still_waits_for_a_request_on_its_way_into_the_engine():
    """Past the gate but not in the engine yet: the pause must come after it arrives, so that it is interrupted."""

    async def scenario() -> list[str]:
        server = server_of(ArealVLLMHttpServer)
        server.engine.arrival.clear()
        arriving = asyncio.create_task(submit(server, "arriving"))
        await asyncio.sleep(0.05)
        abort = asyncio.create_task(server.abort_all_requests())
        await asyncio.sleep(0.2)
        assert not abort.done(), "the abort paused the engine before a request past the gate had arrived"
        server.engine.arrival.set()
        await asyncio.wait_for(asyncio.gather(arriving, abort), timeout=2)
        return server.engine.events

    assert asyncio.run(scenario()) == ["queued arriving", "paused"]


class ArrivingInTurn(QueueingEngine):
    """Each ``add_request`` call returns when its own turn is let through (``turns[i]`` for the i-th call)."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = [asyncio.Event(), asyncio.Event()]
        self.calls = 0

    async def add_request(self, request_id: str, *args, **kwargs) -> None:
        turn = self.turns[self.calls]
        self.calls += 1
        await turn.wait()
        await super().add_request(request_id, *args, **kwargs)


def test_a_repeated_request_id_on_its_way_into_the_engine_still_holds_the_abort():
    """Two requests with one id past the gate: the first reaching the engine must not count the second as arrived."""

    async def scenario() -> list[str]:
        server = server_of(ArealVLLMHttpServer)
        server.engine = engine = ArrivingInTurn()
        first = asyncio.create_task(submit(server, "same-id"))
        second = asyncio.create_task(submit(server, "same-id"))
        await asyncio.sleep(0.05)
        engine.turns[0].set()
        await asyncio.wait_for(first, timeout=2)  # in the engine; the second is still on its way
        abort = asyncio.create_task(server.abort_all_requests())
        await asyncio.sleep(0.2)
        assert not abort.done(), "the abort paused the engine before the second request with that id had arrived"
        engine.turns[1].set()
        await asyncio.wait_for(asyncio.gather(second, abort), timeout=2)
        return engine.events

    assert asyncio.run(scenario()) == ["queued same-id", "queued same-id", "paused"]


def test_a_request_that_never_reaches_the_engine_does_not_hold_aborts():
    async def scenario() -> None:
        server = server_of(ArealVLLMHttpServer)
        assert await server._park_until_admitted("failed-early") is None
        server._entering_engine.discard(_ENTERING.get())  # what generate's cleanup does when it raises
        await asyncio.wait_for(server.abort_all_requests(), timeout=2)

    asyncio.run(scenario())


def test_a_parked_request_is_not_waited_for():
    """A request parked behind the closed gate has not passed it: an abort during a sync must not wait for it."""

    async def scenario() -> list[str]:
        server = server_of(ArealVLLMHttpServer)
        await server.abort_all_requests()
        parked = asyncio.create_task(submit(server, "parked"))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(server.abort_all_requests(), timeout=2)
        await server.open_submission_gate()
        await asyncio.wait_for(parked, timeout=2)
        return server.engine.events

    assert asyncio.run(scenario()) == ["paused", "paused", "queued parked"]


def test_vllms_generate_reaches_the_engine_through_add_request():
    """The override counts a request as arrived when ``add_request`` returns: vLLM's ``generate`` must call it (a
    vLLM that adds requests another way would make every abort stop waiting for arrivals)."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    assert "await self.add_request(" in inspect.getsource(AsyncLLM.generate)
