"""What every areal rollout server (``areal_cpu``, ``areal_vllm``) does the same way for verl's server contract.

Request checks and token budget, the per-token version fields verl and our client read, the audit
trail of weight loads, and the contract methods that have nothing to do on a CPU replica.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def token_budget(
    backend: str, prompt_ids: list[int], params: dict[str, Any], max_model_len: int, response_length: int, media: bool
) -> int:
    """``max_tokens`` of a request (popped from ``params``), within ``max_model_len``; text-only requests."""
    if media:
        raise ValueError(f"the {backend} rollout backend serves text-only models; drop multimodal inputs")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens leaves no room within max_model_len={max_model_len}; "
            "raise data.max_prompt_length/rollout.response_length or shorten the prompt"
        )
    max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", response_length))
    return max(1, min(int(max_tokens), room))


def version_fields(served_version: int, versions: list[int]) -> dict[str, Any]:
    """``extra_fields`` of a response: the served version and the version of every token."""
    extra: dict[str, Any] = {"global_steps": served_version, "token_versions": versions}
    if versions:
        extra["min_global_steps"] = min(versions)
        extra["max_global_steps"] = max(versions)
    return extra


def record_weight_sync(replica: int, version: int, checksum: Any, event: str) -> None:
    """Append to ``$AREAL_RUN_DIR/weight_syncs.jsonl``: an audit trail of the weights served."""
    run_dir = os.environ.get("AREAL_RUN_DIR")
    if not run_dir:
        return
    record = {"time": time.time(), "replica": replica, "event": event, "version": version, "checksum": checksum}
    with open(os.path.join(run_dir, "weight_syncs.jsonl"), "a") as handle:
        handle.write(json.dumps(record) + "\n")


class CPUReplicaContract:
    """verl server-contract methods with nothing to do here (memory is not scarce, one request abort)."""

    async def resume_generation(self) -> None:
        raise NotImplementedError

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id, "error": "single-request abort is not supported"}

    async def resume_engine_generation(self) -> None:
        return None

    async def open_submission_gate(self) -> None:
        await self.resume_generation()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None
