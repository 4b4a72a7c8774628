"""The vLLM rollout server's *decision* after a failed call: retry on a live server, ask for a replacement
of a dead one, retry budgets per server.

No server runs here: the process is a stand-in that says whether it is up, and the replacement is a
recorded call. That a real vLLM server killed mid-request is really restarted, reloaded with the
served weights and its requests finished is tested against a real server in
``tests/integration/test_vllm_engine.py``.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from areal_plugins.rollout.vllm.server import TRANSIENT_RETRIES, VLLMRolloutServer


class StandInProcess:
    """What the policy reads of the server process: up or not, answering /health or not."""

    def __init__(self, up: bool) -> None:
        self.up = up
        self.restarts = 0

    def alive(self) -> bool:
        return self.up

    def healthy(self) -> bool:
        return self.up


def rollout_server(process: StandInProcess) -> VLLMRolloutServer:
    server = VLLMRolloutServer.__new__(VLLMRolloutServer)  # no real server: only the decision runs
    server.server = process
    server.client = "client-0"
    restarted = []

    async def record_replacement(error, incarnation):  # stands in for the real restart
        process.restarts += 1
        server.client = f"client-{process.restarts}"
        process.up = True
        restarted.append(error)

    server._restart_if_dead = record_replacement
    return server


def failing(times: int):
    calls = []

    async def call(client):
        calls.append(client)
        if len(calls) <= times:
            raise aiohttp.ClientOSError(104, "Connection reset by peer")
        return "done"

    return call, calls


def test_a_dropped_connection_on_a_live_server_is_retried_without_a_restart():
    process = StandInProcess(up=True)
    server = rollout_server(process)
    call, calls = failing(TRANSIENT_RETRIES)
    assert asyncio.run(server._on_live_server(call)) == "done"
    assert calls == ["client-0"] * (TRANSIENT_RETRIES + 1) and process.restarts == 0


def test_a_live_server_that_keeps_failing_stops_with_the_error():
    server = rollout_server(StandInProcess(up=True))
    call, calls = failing(TRANSIENT_RETRIES + 1)
    with pytest.raises(RuntimeError, match=f"failed {TRANSIENT_RETRIES + 1} times while the server is up"):
        asyncio.run(server._on_live_server(call))
    assert len(calls) == TRANSIENT_RETRIES + 1


def test_a_dead_server_is_asked_for_a_replacement_and_the_call_goes_to_the_new_client():
    process = StandInProcess(up=False)
    server = rollout_server(process)
    call, calls = failing(1)
    assert asyncio.run(server._on_live_server(call)) == "done"
    assert calls == ["client-0", "client-1"] and process.restarts == 1


def test_a_replaced_server_gets_its_own_retry_budget():
    process = StandInProcess(up=False)
    server = rollout_server(process)
    call, calls = failing(1 + TRANSIENT_RETRIES)  # the dead server's failure, then the new one's resets
    assert asyncio.run(server._on_live_server(call)) == "done"
    assert calls == ["client-0"] + ["client-1"] * (TRANSIENT_RETRIES + 1) and process.restarts == 1


def test_only_a_finished_stream_counts_as_completed():
    from areal_plugins.rollout.vllm.server import verl_stop_reason

    assert verl_stop_reason("stop") == "completed" and verl_stop_reason("length") == "completed"
    assert verl_stop_reason("abort") == "aborted"  # /pause?mode=abort
    assert verl_stop_reason(None) == "aborted"  # the stream ended without saying why: verl re-issues it
