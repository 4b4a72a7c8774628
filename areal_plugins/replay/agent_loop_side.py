"""The rollout client's side of a replay: a request asks for its recorded trajectory's requests, in turn.

Each recorded request runs once the engines serve its recorded version, with its recorded seed and ``max_tokens``
up to where the record cut it (docs/replay.md). A request that cannot follow (its version is past, or the engine
returned fewer tokens than recorded) stops there and returns what it has: the trainer finds the tokens differ
from the record and reports the divergence. Its remaining requests are marked generated all the same (also when it
fails), so the trainer never waits for them. A request that fails is not retried by the record: the conductor keeps its
error, and the trainer stops the replay naming the trajectory and the error.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from areal_plugins.agent_loop.episodes import CURRENT_EPISODE, version_fields
from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient, SpanningFields, current_answer
from areal_plugins.agent_loop.partial_outputs import PartialOutput, take_resumed
from areal_plugins.agent_loop.routed_experts import routed_experts_fields
from areal_plugins.core.trajectory_rows import CHUNKS_FIELD, MEDIA_FIELD, REPLAY_OF, images_digest, prompt_digest
from areal_plugins.replay.conductor import find_conductor
from areal_plugins.rollout.base import SEED_FIELD

logger = logging.getLogger(__name__)

_found: dict[str, Any] = {}


class ReplayingLLMClient(InterruptibleLLMClient):
    """The rollout client of a replay (the driver picks it when ``areal.replay.run_dir`` is set): a request whose
    prompt the record has follows the recorded trajectory's requests; any other runs as in a live run."""

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any):
        media = images_digest(kwargs.get("image_data"))
        recorded = await claim_recorded(prompt_ids, media)
        if recorded is None:
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        answer = current_answer()
        resumed = await take_resumed(*answer, prompt_ids, media) if answer is not None else None
        return await follow_record(
            self._generate_once, request_id, prompt_ids, sampling_params, recorded, resumed, **kwargs
        )


def _conductor() -> Any:
    if "handle" not in _found:
        _found["handle"] = find_conductor()
        if _found["handle"] is None:
            raise RuntimeError("areal.replay.run_dir is set but the replay's conductor actor is not running")
    return _found["handle"]


async def claim_recorded(prompt_ids: list[int], media: str | None = None) -> dict[str, Any] | None:
    """The recorded trajectory this request follows (``name`` and ``plan``), or None for a prompt the recorded
    run never trained (it generates freely; no step trains it). Inside an agent-loop episode the claim names the
    episode's group and answer index, so that two groups of one prompt in flight at once never mix."""
    episode = CURRENT_EPISODE.get()
    group_key = episode.group_uid if episode is not None else None
    member = episode.session if episode is not None else None
    return await _conductor().claim.remote(prompt_digest(list(prompt_ids), media), group_key, member)


async def follow_record(
    generate_once: Callable[..., Awaitable[Any]],
    request_id: str,
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    recorded: dict[str, Any],
    resumed: PartialOutput | None = None,
    **kwargs: Any,
) -> Any:
    """Generate the recorded trajectory ``recorded`` request by request; verl's ``TokenOutput``. ``resumed``: what
    the replay's starting checkpoint kept of it (its requests before the checkpoint are not asked again)."""
    from verl.workers.rollout.replica import TokenOutput

    conductor = _conductor()
    episode = CURRENT_EPISODE.get()
    if episode is not None:  # waiting for a version is the engine's time, as a request parked at its gate
        episode.enter_engine()
    limit_key = "max_new_tokens" if "max_new_tokens" in sampling_params else "max_tokens"
    resumed = resumed or PartialOutput("")
    tokens, log_probs = list(resumed.tokens), list(resumed.log_probs)
    versions, chunks = list(resumed.versions), [list(chunk) for chunk in resumed.chunks]
    spanning = SpanningFields(routed_experts=resumed.routed_experts)  # merged as a live run merges them
    output = None
    stop_reason = resumed.stop_reason or "aborted"
    plan = recorded["plan"]
    counted = 0  # the plan's requests counted as generated, so that no hold waits for them
    try:
        for index, (start, max_tokens, version, seed) in enumerate(plan):
            if start < len(tokens):  # made before the checkpoint the replay resumed from
                counted += 1
                continue
            following = len(tokens) == start and await conductor.serve.remote(version)
            if following:
                params = {**sampling_params, limit_key: max_tokens, "seed": seed}
                output = await generate_once(
                    request_id, prompt_ids=[*prompt_ids, *tokens], sampling_params=params, **kwargs
                )
                chunk_versions = output.extra_fields.get("token_versions") or [version] * len(output.token_ids)
                if output.token_ids:
                    chunks.append([len(tokens), chunk_versions[0], output.extra_fields.get(SEED_FIELD)])
                spanning.add(output)
                tokens.extend(output.token_ids)
                log_probs.extend(output.log_probs or [])
                versions.extend(chunk_versions)
                stop_reason = output.stop_reason
                following = len(output.token_ids) == max_tokens
            await conductor.generated.remote(version)
            counted += 1
            if not following:  # the rest cannot run as recorded
                logger.warning("replay: %s left its record at request %d of %d", recorded["name"], index + 1, len(plan))
                break
    except BaseException as error:  # failed or cancelled: the trainer stops the replay, naming it
        await conductor.failed.remote(recorded["name"], f"{type(error).__name__}: {error}")
        raise
    finally:  # no hold waits for the requests it will not make
        for _, _, later_version, _ in plan[counted:]:
            await conductor.generated.remote(later_version)
    if episode is not None:
        episode.add_turn(versions, max(len(chunks) - 1, 0), chunks)
    extra = dict(output.extra_fields) if output is not None else {}
    extra.pop(SEED_FIELD, None)
    extra |= version_fields(versions) | {"num_interrupts": max(len(chunks) - 1, 0), CHUNKS_FIELD: chunks}
    extra[REPLAY_OF] = recorded["name"]
    if (media := images_digest(kwargs.get("image_data"))) is not None:
        extra[MEDIA_FIELD] = media
    extra["num_cached_tokens"] = spanning.num_cached_tokens
    extra.update(routed_experts_fields(spanning.routed_experts))
    return TokenOutput(
        token_ids=tokens,
        log_probs=log_probs,
        routed_experts=spanning.routed_experts,
        stop_reason="length" if stop_reason in ("aborted", "abort") else stop_reason,
        num_preempted=spanning.num_preempted,
        extra_fields=extra,
    )
