"""Staleness-bounded admission of rollouts (AReaL, arXiv 2505.24298 §5.1; docs/design.md, Admission).

Rollouts are admitted, not discarded: with batch size ``B`` (trajectories or groups the trainer
consumes per step), staleness bound ``η``, ``running`` rollouts in flight and ``accepted`` finished
and kept, the number that may be submitted at trainer version ``v`` is::

    capacity(v) = min(max_concurrent - running, (η + v + 1) * B - (accepted + running))

so no sample consumed at version ``v`` can have been started before version ``v - η``. A rejected
rollout frees its slot. Pure Python, thread-safe, no Ray or verl.
"""

from __future__ import annotations

import threading


class StalenessController:
    """Counts rollouts in flight, accepted and rejected, and answers how many more may start.

    Args:
        max_staleness: η ≥ 0; 0 reproduces synchronous training.
        batch_size: B ≥ 1, trajectories (or GRPO groups) consumed per trainer step.
        max_concurrent: most rollouts in flight at once (engine capacity), ≥ 1.
    """

    def __init__(self, max_staleness: int, batch_size: int, max_concurrent: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 = synchronous), got {max_staleness}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.max_concurrent = max_concurrent
        self._lock = threading.Lock()
        self._running = 0
        self._accepted = 0
        self._rejected = 0

    @property
    def running(self) -> int:
        return self._running

    @property
    def accepted(self) -> int:
        return self._accepted

    @property
    def rejected(self) -> int:
        return self._rejected

    def capacity(self, version: int) -> int:
        """How many rollouts may be submitted now at trainer ``version`` (may be negative)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        with self._lock:
            by_concurrency = self.max_concurrent - self._running
            by_staleness = (self.max_staleness + version + 1) * self.batch_size - (self._accepted + self._running)
            return min(by_concurrency, by_staleness)

    def on_submit(self, count: int = 1) -> None:
        with self._lock:
            self._running += count

    def on_accept(self, count: int = 1) -> None:
        with self._lock:
            self._require_running(count, "accept")
            self._running -= count
            self._accepted += count

    def on_reject(self, count: int = 1) -> None:
        """A finished rollout was rejected (filtered, failed): its slot is free again."""
        with self._lock:
            self._require_running(count, "reject")
            self._running -= count
            self._rejected += count

    def on_drop_accepted(self, count: int = 1) -> None:
        """Accepted rollouts were dropped before training (``on_stale: drop``): count them rejected."""
        with self._lock:
            if count > self._accepted:
                raise RuntimeError(f"cannot drop {count} accepted rollout(s): only {self._accepted} accepted")
            self._accepted -= count
            self._rejected += count

    def on_requeue_accepted(self, count: int = 1) -> None:
        """Accepted rollouts go back to generation (``on_stale: reissue``): in flight again, same slots."""
        with self._lock:
            if count > self._accepted:
                raise RuntimeError(f"cannot requeue {count} accepted rollout(s): only {self._accepted} accepted")
            self._accepted -= count
            self._running += count

    def recover(self, version: int) -> None:
        """Restore the counters after resuming from a checkpoint taken at ``version``.

        ``accepted = version * B``: the samples the trainer has consumed. Without this, a resumed
        run admits as if at version 0 and staleness silently exceeds η (the AReaL resume bug).
        In-flight rollouts of the crashed run are re-issued by the caller and counted again.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        with self._lock:
            self._accepted = version * self.batch_size
            self._running = 0
            self._rejected = 0

    def state_dict(self) -> dict[str, int]:
        with self._lock:
            return {"running": self._running, "accepted": self._accepted, "rejected": self._rejected}

    def _require_running(self, count: int, what: str) -> None:
        if count > self._running:
            raise RuntimeError(f"cannot {what} {count} rollout(s): only {self._running} in flight")
