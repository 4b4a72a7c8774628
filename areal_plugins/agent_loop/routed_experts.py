"""Router replay's routed experts of one trajectory: what its records say of them and how a checkpoint holds them.

A mixture-of-experts engine with router replay on (``rollout.enable_rollout_routing_replay``) returns, per request,
the experts that routed each position fed through the model (prompt + generated - 1 rows of layers x top-k ids).
The rollout client merges them across an interrupted call's requests (agent_loop/llm_client.py); here: the
record's summary of the merged array, and its form in a checkpoint's line of kept outputs (partial_outputs.py).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import numpy as np

from areal_plugins.core.trajectory_rows import ROUTED_EXPERTS_FIELD


class RoutesNotRecordedError(RuntimeError):
    """An engine returned routes that no top-k router can have chosen: router replay would train on made-up ones."""


def require_recorded_routes(routed: Any, rows: int) -> None:
    """Raise :class:`RoutesNotRecordedError` where one of the last ``rows`` rows of ``routed`` (tokens, layers, k)
    names an expert twice: a top-k router picks k distinct experts, so a repeat means the engine did not record
    that position (vLLM's CPU build under ``torch.compile`` returns all zeros: its mixture-of-experts layer is traced,
    so the capture hook bound after compiling never runs). With k = 1 nothing can be told apart, and nothing is
    checked."""
    array = np.asarray(routed)
    if array.ndim != 3 or array.shape[2] < 2 or rows <= 0:
        return
    tail = np.sort(array[-rows:], axis=-1)
    repeated = (tail[..., 1:] == tail[..., :-1]).any(axis=-1)
    if repeated.any():
        position, layer = (int(i) for i in np.argwhere(repeated)[0])
        raise RoutesNotRecordedError(
            f"the engine returned routes naming an expert twice in {int(repeated.sum())} of {repeated.size} "
            f"(token, layer) slots, e.g. {tail[position, layer].tolist()} at layer {layer}: a top-k router picks "
            f"{array.shape[2]} distinct experts, so these were never recorded and router replay would train on them. "
            "On vLLM's CPU build set actor_rollout_ref.rollout.enforce_eager=true (its compiled graph skips the "
            "capture); elsewhere set actor_rollout_ref.rollout.enable_rollout_routing_replay=false and report it"
        )


def routed_experts_fields(routed: Any) -> dict[str, Any]:
    """For the run's records (what the trainer's batch carries), none without router replay: ``[rows, digest]`` of a
    trajectory's merged routed experts, how many token positions they cover (prompt + response - 1: the last token
    is never fed through the model) and 16 hex digits of the SHA-256 of the ids as little-endian int32, exact
    across runs (a replay's must match its record's)."""
    if routed is None:
        return {}
    array = np.ascontiguousarray(np.asarray(routed), dtype="<i4")
    return {ROUTED_EXPERTS_FIELD: [int(array.shape[0]), hashlib.sha256(array.tobytes()).hexdigest()[:16]]}


def encode_experts(routed: Any) -> dict[str, Any] | None:
    """Routed experts as a checkpoint line holds them: int16 ids (as verl's batch keeps them), little-endian, in
    base64 with their shape; None without router replay. A copy: the client may replace the array meanwhile."""
    if routed is None:
        return None
    values = np.ascontiguousarray(routed, dtype="<i2")
    return {"shape": list(values.shape), "int16": base64.b64encode(values.tobytes()).decode()}


def decode_experts(kept: dict[str, Any] | None) -> Any:
    """:func:`encode_experts` undone: the ids as an int16 array of their shape, or None."""
    if not kept:
        return None
    return np.frombuffer(base64.b64decode(kept["int16"]), dtype="<i2").reshape(kept["shape"]).copy()
