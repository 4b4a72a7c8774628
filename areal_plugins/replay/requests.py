"""Regenerate one recorded request chunk by chunk: what a replay of an asynchronous run asks its engine.

A trajectory's record (``chunks`` in ``areal_samples.jsonl``, docs/reference/run_records.md) lists the requests that
produced it: where each started in the response, under which weight version and with which seed. Each request but
the last was cut by an interruption where the next one starts. Asking the engine for the same requests (prompt plus
the tokens so far, ``max_tokens`` up to the next cut, the recorded seed, after the engine serves the recorded
version) regenerates the trajectory bit for bit on an engine whose output depends on the request alone
(``areal_cpu`` with ``batch_invariant``). A whole run's replay does the same request by request inside verl's
agent loop (:mod:`areal_plugins.replay.agent_loop_side`), which also counts its requests for the trainer's holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from areal_plugins.rollout.base import Generated


class ReplayError(ValueError):
    """A record that cannot be replayed, or a regeneration that left it."""


@dataclass(frozen=True)
class ChunkRequest:
    start: int  # the response token this request generates first
    max_tokens: int  # up to the next request's start, or the response's end
    version: int  # the weights it ran under
    seed: int


def chunk_requests(chunks: list[list], response_tokens: int) -> list[ChunkRequest]:
    """The requests that regenerate a trajectory of ``response_tokens`` tokens recorded as ``chunks``
    (``[first token, version, seed]`` each)."""
    if not chunks:
        raise ReplayError("the trajectory records no request: nothing to regenerate")
    starts = [int(chunk[0]) for chunk in chunks]
    in_order = all(a < b for a, b in itertools.pairwise(starts))
    if starts[0] != 0 or not in_order or starts[-1] >= response_tokens:
        raise ReplayError(
            f"the requests' first tokens {starts} do not cut a response of {response_tokens} tokens in order"
        )
    if any(chunk[2] is None for chunk in chunks):
        raise ReplayError(
            "the run's engine did not seed its requests, so its samples cannot be drawn again: record the run with "
            "areal_cpu, or with verl's vllm and actor_rollout_ref.rollout.custom.areal_seeded_sampling=true"
        )
    ends = [*starts[1:], response_tokens]
    return [
        ChunkRequest(start, end - start, int(chunk[1]), int(chunk[2]))
        for start, end, chunk in zip(starts, ends, chunks, strict=True)
    ]


async def regenerate(
    prompt_ids: list[int],
    plan: list[ChunkRequest],
    generate: Callable[[list[int], int, int], Awaitable[Generated]],
    serve_version: Callable[[int], Awaitable[None]],
) -> Generated:
    """Ask for each request of ``plan`` in turn: ``serve_version(v)`` returns once the engine serves weights ``v``,
    ``generate(prompt_ids, max_tokens, seed)`` generates. Returns the whole response (tokens, log-probs, versions).
    Raises :class:`ReplayError` where a request produced another number of tokens than recorded (the
    regeneration left the record there)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    output: Generated | None = None
    for request in plan:
        await serve_version(request.version)
        output = await generate([*prompt_ids, *tokens], request.max_tokens, request.seed)
        if len(output.token_ids) != request.max_tokens:
            raise ReplayError(
                f"the request from response token {request.start} under version {request.version} produced "
                f"{len(output.token_ids)} tokens where the record has {request.max_tokens}"
            )
        tokens.extend(output.token_ids)
        logprobs.extend(output.logprobs or [])
        versions.extend(output.versions or [request.version] * len(output.token_ids))
    assert output is not None  # chunk_requests never returns an empty plan
    return Generated(tokens, logprobs, versions, output.stop_reason, seed=None)  # each request had its own
