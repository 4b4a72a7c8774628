"""An in-memory stand-in for verl's TransferQueue, as the rollout manager sees it (one partition, "train").

It answers the three calls a manager makes (``kv_list``, ``kv_batch_get``, ``kv_clear``) with what verl 0.9.1's
agent loop writes, and plays the agent loop's part: :meth:`add_prompt` registers a prompt group as verl does
when a prompt is submitted, :meth:`finish` writes its finished trajectories (or marks it failed). It is what
:func:`areal_plugins.testing.check_rollout_manager` drives a manager with; the integration tests run against
the real TransferQueue.
"""

from __future__ import annotations

from typing import Any


def _as_batch(values: list[Any]) -> Any:
    """One field of several rows as TransferQueue hands it out: a jagged nested tensor, or a list."""
    import torch

    if isinstance(values[0], torch.Tensor):
        return torch.nested.as_nested_tensor(values, layout=torch.jagged)
    return values


class InMemoryTransferQueue:
    """Tags and rows by key, like TransferQueue's key-value API; ``tags``/``rows`` are open for inspection."""

    def __init__(self) -> None:
        self.tags: dict[str, dict[str, Any]] = {}
        self.rows: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ what the manager calls

    def kv_list(self, partition_id: str) -> dict[str, dict[str, dict[str, Any]]]:
        return {partition_id: {key: dict(tag) for key, tag in self.tags.items()}}

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> dict[str, Any]:
        return {
            name: _as_batch([self.rows[key][name] for key in keys])
            for name in select_fields
            if all(name in self.rows[key] for key in keys)
        }

    def kv_tags(self, keys: list[str], partition_id: str) -> dict[str, dict[str, Any]] | None:
        """The tags of ``keys``; None when one is not held (TransferQueue's ``kv_retrieve_meta`` leaves it out)."""
        if any(key not in self.tags for key in keys):
            return None
        return {key: dict(self.tags[key]) for key in keys}

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        for key in keys:
            self.tags.pop(key, None)
            self.rows.pop(key, None)

    # ------------------------------------------------------------------ what verl's agent loop does

    def add_prompt(self, uid: str) -> None:
        """A prompt group was submitted: its prompt is registered, running."""
        self.tags[uid] = {"is_prompt": True, "status": "running", "global_steps": 1}

    def finish(self, uid: str, rewards: list[float], versions: list[list[int]], status: str = "finished") -> None:
        """The group ended: one trajectory per reward (response tokens generated under ``versions``), or none
        with ``status="failure"``."""
        import torch

        for i, (reward, token_versions) in enumerate(zip(rewards, versions, strict=True)):
            key = f"{uid}_{i}_0"
            n = len(token_versions)
            self.tags[key] = {"status": "success", "min_global_steps": min(token_versions)}
            self.rows[key] = {
                "prompts": torch.tensor([1, 2, 3]),
                "responses": torch.arange(n),
                "response_mask": torch.ones(n, dtype=torch.long),
                "rollout_log_probs": torch.full((n,), -0.5),
                "rm_scores": torch.tensor([0.0] * (n - 1) + [reward]),
                "extra_fields": {"token_versions": token_versions, "num_interrupts": int(len(set(token_versions)) > 1)},
            }
        self.tags[uid]["status"] = status

    def trajectory_keys(self, uid: str) -> list[str]:
        """The keys of ``uid``'s trajectories held now."""
        return sorted(key for key in self.tags if key.startswith(f"{uid}_"))
