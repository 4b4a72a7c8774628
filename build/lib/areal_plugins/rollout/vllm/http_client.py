"""HTTP client of one vLLM server: streamed token-in/token-out generation, interruption, weight reload.

Generation streams ``/v1/completions`` with the prompt as token ids, so an interrupted request still
returns every token it generated, with its log-prob (``finish_reason == "abort"``). Interruption is
vLLM's own ``/pause?mode=abort`` and ``/resume``; weights load with ``/collective_rpc`` calling our
worker extension, which answers with the version and a layout-free checksum of what it now holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

#: vLLM's finish reason for a request cut short by ``/pause?mode=abort``.
ABORTED = "abort"
#: Seconds an idle pooled connection is kept; below the server's keep-alive (server.py sets 60 s).
IDLE_CONNECTION_S = 30.0


@dataclass
class Generation:
    """What one request produced (possibly cut short: ``finish_reason == "abort"``)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


#: Seconds to open a connection to the local server (it is up, or the call fails fast and the server is checked).
CONNECT_TIMEOUT_S = 30.0


class VLLMClient:
    """Talks to the server at ``url`` (one aiohttp session per event loop)."""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0) -> None:
        self.url = url
        self.model = model
        # A silence of timeout_s fails a call, not its length: a long chain of thought streams for longer than any
        # total a 2.4M-parameter model suggests, and cutting it costs a re-prefill of everything generated.
        self.timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Drop idle connections before the server does (uvicorn: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, we set 60 s):
            # reusing one the server is closing fails the request with "connection reset by peer".
            connector = aiohttp.TCPConnector(keepalive_timeout=IDLE_CONNECTION_S)
            self._session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        ignore_eos: bool = False,
        seed: int | None = None,
        on_tokens: Callable[[int], None] | None = None,
        into: Generation | None = None,
    ) -> Generation:
        """Stream one request; ``on_tokens(n)`` is told as each batch of ``n`` tokens arrives.

        ``into`` receives the tokens as they stream, so a caller that cancels the request (closing the
        stream makes vLLM abort it) still holds every token generated so far.
        """
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "ignore_eos": ignore_eos,
            "logprobs": 0,  # the sampled token's own log-prob
            "return_tokens_as_token_ids": True,
            "stream": True,
        }
        if seed is not None:
            payload["seed"] = seed
        result = into if into is not None else Generation()
        session = await self.session()
        async with session.post(f"{self.url}/v1/completions", json=payload) as response:
            if response.status != 200:
                raise RuntimeError(f"vLLM /v1/completions answered {response.status}: {await response.text()}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data:") :])["choices"][0]
                logprobs = choice.get("logprobs") or {}
                tokens = logprobs.get("tokens") or []
                for token, logprob in zip(tokens, logprobs.get("token_logprobs") or [], strict=True):
                    result.token_ids.append(int(token.split(":", 1)[1]))  # "token_id:123"
                    result.logprobs.append(float(logprob))
                if on_tokens is not None and tokens:
                    on_tokens(len(tokens))
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
        return result

    async def _post(self, path: str, body: dict[str, Any] | None = None, **params: str) -> Any:
        session = await self.session()
        async with session.post(f"{self.url}{path}", json=body or {}, params=params) as response:
            text = await response.text()
            if response.status != 200:
                raise RuntimeError(f"vLLM {path} answered {response.status}: {text}")
            return json.loads(text) if text else None

    async def pause(self) -> None:
        """Abort every in-flight request (each returns its partial output) and hold new ones."""
        await self._post("/pause", mode="abort")

    async def resume(self) -> None:
        await self._post("/resume")

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (KV computed under earlier weights)."""
        await self._post("/reset_prefix_cache")

    async def reload_weights(self, weights_path: str, version: int) -> dict[str, Any]:
        """Load the safetensors in ``weights_path``; the worker's report (version, checksum)."""
        answer = await self._post(
            "/collective_rpc", {"method": "areal_reload", "kwargs": {"weights_path": weights_path, "version": version}}
        )
        return _first_worker(answer)

    async def report(self) -> dict[str, Any]:
        return _first_worker(await self._post("/collective_rpc", {"method": "areal_report"}))


def _first_worker(answer: Any) -> dict[str, Any]:
    results = answer.get("results", answer) if isinstance(answer, dict) else answer
    return results[0] if isinstance(results, list) else results
