"""The vLLM client times out on silence, not on length: a stream longer than the timeout, with chunks in
between, completes; a server that stops sending fails the call."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from areal_plugins.rollout.vllm.http_client import VLLMClient


async def _stream(chunks: int, gap_s: float) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(chunks):
            await asyncio.sleep(gap_s)
            await response.write(f"data: {i}\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/stream", handler)
    return app


async def _read(chunks: int, gap_s: float, timeout_s: float) -> bytes:
    runner = web.AppRunner(await _stream(chunks, gap_s))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = VLLMClient(f"http://127.0.0.1:{port}", "model", timeout_s=timeout_s)
    try:
        session = await client.session()
        async with session.get(f"{client.url}/stream") as response:
            return await response.read()
    finally:
        await client.close()
        await runner.cleanup()


def test_a_stream_longer_than_the_timeout_completes():
    """8 chunks 0.25 s apart: 2 s in all against a 1 s timeout (a total timeout would cut it at 1 s)."""
    body = asyncio.run(_read(chunks=8, gap_s=0.25, timeout_s=1.0))
    assert body.count(b"data:") == 8


def test_a_silent_server_fails_the_call():
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(_read(chunks=1, gap_s=3.0, timeout_s=1.0))
