"""Rows of verl's TransferQueue and agent-loop outputs as our trajectories, and their digests.

Shared by every process that reads or writes a trajectory: the agent-loop workers summarise what they wrote (the
settled-group report), the driver reads rows back into :class:`Trajectory` objects for plugins and records, a replay
compares digests. Pure: the standard library and our trajectory type only.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import sys
from array import array
from typing import Any

from areal_plugins.core.trajectory import Trajectory

#: ``extra_fields`` key of a trajectory's requests: ``[first generated token, version, seed]`` for each request that
#: produced tokens, in order (a request continued after an interruption starts a new one).
CHUNKS_FIELD = "areal_chunks"
#: ``extra_fields`` key of a trajectory's routed experts (router replay), merged across its requests: ``[rows,
#: digest]`` (agent_loop/llm_client.py), recorded as ``routed_experts_rows`` / ``routed_experts_digest``.
ROUTED_EXPERTS_FIELD = "areal_routed_experts"
#: ``extra_fields`` key of the digest of a prompt's pictures (:func:`images_digest`); absent without pictures.
MEDIA_FIELD = "areal_prompt_media"
#: The sample field naming the recorded trajectory a replayed one follows (``group/key``).
REPLAY_OF = "replay_of"


class MissingRolloutFieldError(RuntimeError):
    """A finished rollout lacks a field asynchronous training cannot do without."""


def trajectory_info(trajectory: Trajectory) -> dict[str, Any]:
    """What the buffer and the run's records keep of one trajectory (its tokens stay in TransferQueue)."""
    return {
        "head_version": trajectory.head_version,
        "tail_version": max(trajectory.versions, default=trajectory.head_version),
        "num_interrupts": int(trajectory.extra.get("num_interrupts", 0)),
        **schedule_fields(trajectory),
        "prompt_tokens": len(trajectory.prompt_ids),
        "response_tokens": len(trajectory.response_ids),
        "reward": trajectory.reward,
        "reward_report": reward_report(trajectory.extra),
        **episode_report(trajectory.extra),
        **routed_experts_report(trajectory.extra),
    }


def routed_experts_report(extra: dict[str, Any]) -> dict[str, Any]:
    """How many token positions the trajectory's routed experts cover, and their digest (empty without router
    replay)."""
    summary = extra.get(ROUTED_EXPERTS_FIELD)
    if not summary:
        return {}
    rows, digest = summary
    return {"routed_experts_rows": int(rows), "routed_experts_digest": str(digest)}


def schedule_fields(trajectory: Trajectory) -> dict[str, Any]:
    """What a replay of this trajectory follows and checks: its requests (``chunks``: first response token, version,
    seed), digests of its prompt and response tokens and of its behaviour log-probs, and in a replay the recorded
    trajectory it followed."""
    kept = len(trajectory.response_ids)
    chunks = [
        [int(start), int(version), None if seed is None else int(seed)]
        for start, version, seed in trajectory.extra.get(CHUNKS_FIELD) or []
        if start < kept
    ]
    fields = {
        "chunks": chunks,
        "prompt_digest": prompt_digest(trajectory.prompt_ids, trajectory.extra.get(MEDIA_FIELD)),
        "response_digest": token_digest(trajectory.response_ids),
        "logprobs_digest": logprobs_digest(trajectory.behav_logprobs),
    }
    if REPLAY_OF in trajectory.extra:  # a replayed trajectory: which recorded one it followed
        fields[REPLAY_OF] = trajectory.extra[REPLAY_OF]
    return fields


def token_digest(token_ids: list[int]) -> str:
    """A short, stable digest of a token sequence: 16 hex digits of the SHA-256 of its ids as little-endian
    64-bit integers (packed in C: joining 4k ids as text cost a fifth of a trajectory's settling)."""
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return hashlib.sha256(packed.tobytes()).hexdigest()[:16]


def images_digest(images: Any) -> str | None:
    """16 hex digits of the SHA-256 of a request's pictures (verl's ``image_data``: PIL images, or bytes), in order;
    None without pictures. A vision-language model's prompt holds each picture as placeholder tokens that are the same
    whatever the picture, so this is what tells apart prompts of one text (:func:`prompt_digest`, the tests' holds)."""
    if not images:
        return None
    digest = hashlib.sha256()
    for image in images:
        if isinstance(image, bytes | bytearray):
            digest.update(bytes(image))
        elif hasattr(image, "tobytes"):  # a PIL image: its pixels, with the size and mode that lay them out
            digest.update(f"{image.mode}:{image.size}:".encode())
            digest.update(image.tobytes())
        else:
            raise TypeError(f"a request's image_data holds a {type(image).__name__}, neither a PIL image nor bytes")
    return digest.hexdigest()[:16]


def prompt_digest(prompt_ids: list[int], media: str | None = None) -> str:
    """A prompt's identity: its tokens' digest, with its pictures' (``media``) mixed in where it has any (a picture's
    placeholder tokens are the same whatever the picture)."""
    tokens = token_digest(prompt_ids)
    return tokens if not media else hashlib.sha256(f"{tokens}:{media}".encode()).hexdigest()[:16]


def logprobs_digest(logprobs: list[float]) -> str:
    """A short digest of behaviour log-probs, exact to the last bit (the float32 values the engine returned)."""
    return hashlib.sha256(struct.pack(f"<{len(logprobs)}f", *logprobs)).hexdigest()[:16]


def reward_report(extra: dict[str, Any]) -> dict[str, float]:
    """The reward service's report on one trajectory (``areal_reward_*`` of verl's reward_extra_info)."""
    info = extra.get("reward_extra_info") or {}
    return {key: float(value) for key, value in dict(info).items() if key.startswith("areal_reward_")}


#: An episode's counts (agent_loop/episodes.py) as our trajectory records name them.
EPISODE_FIELDS = {
    "areal_turns": "turns",
    "areal_turn_tokens": "turn_tokens",
    "areal_updates_between_turns": "updates_between_turns",
    "areal_tool_calls": "tool_calls",
    "areal_tool_failures": "tool_failures",
    "areal_tool_seconds": "tool_seconds",
}


def episode_report(extra: dict[str, Any]) -> dict[str, Any]:
    """The turn, tool and interrupt counts of the trajectory's episode (empty from a non-areal worker)."""
    return {name: extra[key] for key, name in EPISODE_FIELDS.items() if key in extra}


def tensor_rows(tensor: Any) -> list[list[Any]]:
    """Each row of a batch tensor (TransferQueue hands out jagged nested tensors) as a Python list.

    One conversion for the whole group: indexing a nested tensor row by row costs a dispatch per
    row and field, which made up a quarter of the driver's CPU time in the admission loop.
    """
    if not getattr(tensor, "is_nested", False):
        return [row if isinstance(row, list) else [row] for row in tensor.tolist()]
    try:
        values, offsets = tensor.values().tolist(), tensor.offsets().tolist()
    except (AttributeError, RuntimeError):  # a strided nested tensor has no offsets
        return [row.tolist() for row in tensor.unbind()]
    return [values[start:end] for start, end in itertools.pairwise(offsets)]


def group_trajectories(data: Any, uid: str) -> list[Trajectory]:
    """The rows of one group's TransferQueue batch as the :class:`Trajectory` objects plugins see."""
    if "rollout_log_probs" not in data.keys():
        raise MissingRolloutFieldError(
            f"rollout group {uid}: no behaviour log-probs (rollout_log_probs) reached the trainer; the decoupled "
            "objective and the accept hook need them: remove the override "
            "actor_rollout_ref.rollout.calculate_log_probs=false"
        )
    prompts, responses = tensor_rows(data["prompts"]), tensor_rows(data["responses"])
    masks, behavs = tensor_rows(data["response_mask"]), tensor_rows(data["rollout_log_probs"])
    scores = tensor_rows(data["rm_scores"]) if "rm_scores" in data.keys() else None
    out = []
    for row, (prompt, tokens, mask, logprobs) in enumerate(zip(prompts, responses, masks, behavs, strict=True)):
        extra = data["extra_fields"][row]
        extra = dict(getattr(extra, "data", extra) or {})
        reward = float(sum(scores[row])) if scores is not None else None
        out.append(trajectory_from_row(uid, prompt, tokens, mask, logprobs, reward, extra))
    return out


def output_summary(uid: str, output: Any) -> dict[str, Any] | None:
    """:func:`trajectory_info` of a verl ``AgentLoopOutput`` as the admission loop would read it back from
    TransferQueue (behaviour log-probs and reward are stored there as float32; the digest packs log-probs as float32
    either way); None when the output lacks a field the loop insists on: the loop then reads the rows and names it."""
    if output.response_logprobs is None:
        return None
    reward = None if output.reward_score is None else array("f", [output.reward_score])[0]
    try:
        trajectory = trajectory_from_row(
            uid,
            list(output.prompt_ids),
            list(output.response_ids),
            list(output.response_mask),
            list(output.response_logprobs),
            reward,
            dict(output.extra_fields),
        )
    except MissingRolloutFieldError:
        return None
    return trajectory_info(trajectory)


def trajectory_from_row(
    uid: str,
    prompt: list[int],
    tokens: list[int],
    mask: list[int],
    logprobs: list[float],
    reward: float | None,
    extra: dict[str, Any],
) -> Trajectory:
    """One written trajectory as plugins see it: the response tokens the mask keeps, their log-probs and versions."""
    if len(mask) != len(tokens):
        raise MissingRolloutFieldError(
            f"rollout group {uid}: {len(tokens)} response tokens but a response_mask of {len(mask)}"
        )
    whole = 0 not in mask  # every response token generated (single-turn): no copy through the mask
    response = tokens if whole else [token for token, keep in zip(tokens, mask, strict=True) if keep]
    behav = logprobs if whole else [value for value, keep in zip(logprobs, mask, strict=True) if keep]
    versions = list(extra.get("token_versions") or [])[: len(response)]
    if len(versions) < len(response):
        raise MissingRolloutFieldError(
            f"rollout group {uid}: a trajectory of {len(response)} response tokens carries {len(versions)} "
            "token versions; staleness needs the version of every token. The rollout client must be "
            "areal_plugins' InterruptibleLLMClient (areal.enable: true selects it): check that the recipe does "
            "not replace actor_rollout_ref.rollout.agent.agent_loop_manager_class or the LLM client"
        )
    return Trajectory(
        prompt_ids=prompt,
        response_ids=response,
        behav_logprobs=behav,
        versions=versions,
        reward=reward,
        group_id=uid,
        extra=extra,
    )
