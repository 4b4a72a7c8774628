"""The sample buffer: finished, accepted rollout groups waiting for the trainer (docs/design.md, Admission).

Groups leave oldest head version first (ties: the one that finished first), so staleness stays as
low as admission allows. Admission bounds staleness by count, not per sample: a group that takes
long (interrupted several times) keeps its oldest token's version, and may be past η when the trainer
asks for it. ``on_stale`` decides: ``wait`` keeps it and trains on it (counted), ``drop`` and
``reissue`` hand it back to the caller (to be rejected, or generated again). Pure Python,
thread-safe, no Ray or verl.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

ON_STALE = ("wait", "drop", "reissue")


@dataclass
class BufferedGroup:
    """One accepted GRPO group (or single trajectory) and what the trainer needs to know of it.

    Attributes:
        group_id: the prompt's uid.
        head_versions: per trajectory, the smallest version among its generated tokens.
        keys: the trajectories' keys in verl's TransferQueue.
        tags: the trajectories' TransferQueue tags, in the order of ``keys``.
        info: per-trajectory facts for metrics (tokens, versions spanned, reward).
    """

    group_id: str
    head_versions: list[int]
    keys: list[str] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    info: list[dict[str, Any]] = field(default_factory=list)

    @property
    def head_version(self) -> int:
        return min(self.head_versions)

    def staleness(self, trainer_version: int) -> int:
        return trainer_version - self.head_version


class OldestFirstBuffer:
    """Accepted groups, handed out oldest head version first.

    Args:
        max_staleness: η; a group consumed at trainer version ``v`` should satisfy ``v - head <= η``.
        on_stale: ``wait``, ``drop`` or ``reissue``: what to do with a group beyond η at consumption time
            (``drop`` and ``reissue`` both hand it back; the caller acts).
    """

    def __init__(self, max_staleness: int, on_stale: str = "wait") -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if on_stale not in ON_STALE:
            raise ValueError(f"on_stale must be one of {ON_STALE}, got {on_stale!r}")
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self._groups: list[tuple[int, int, BufferedGroup]] = []  # (head version, arrival, group)
        self._arrivals = 0
        self._ready = threading.Condition()
        self.over_stale_kept = 0

    def __len__(self) -> int:
        with self._ready:
            return len(self._groups)

    def put(self, group: BufferedGroup) -> None:
        with self._ready:
            self._groups.append((group.head_version, self._arrivals, group))
            self._arrivals += 1
            self._groups.sort(key=lambda entry: entry[:2])
            self._ready.notify_all()

    def take(
        self, count: int, trainer_version: int, timeout: float | None = None
    ) -> tuple[list[BufferedGroup], list[BufferedGroup]]:
        """Wait up to ``timeout`` s for ``count`` usable groups; return (taken, dropped as stale).

        ``taken`` is empty when the timeout passed first (nothing is removed then, except groups
        dropped as stale, which are always returned so their slots can be freed).
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        dropped: list[BufferedGroup] = []
        with self._ready:
            while True:
                if self.on_stale != "wait":
                    keep = [e for e in self._groups if e[2].staleness(trainer_version) <= self.max_staleness]
                    dropped += [e[2] for e in self._groups if e[2].staleness(trainer_version) > self.max_staleness]
                    self._groups = keep
                if len(self._groups) >= count:
                    taken = [entry[2] for entry in self._groups[:count]]
                    self._groups = self._groups[count:]
                    self.over_stale_kept += sum(g.staleness(trainer_version) > self.max_staleness for g in taken)
                    return taken, dropped
                if dropped or not self._ready.wait(timeout):
                    return [], dropped

    def snapshot(self) -> list[BufferedGroup]:
        """The groups waiting now, in the order they would be handed out."""
        with self._ready:
            return [entry[2] for entry in self._groups]


def __getattr__(name: str) -> Any:
    # The default buffer was called SampleBuffer, the contract's name (hooks/contracts.py) too: the old name still
    # imports, with a warning naming the new one, for at least one release (CHANGELOG).
    if name == "SampleBuffer":
        warnings.warn(
            "areal_plugins.core.buffer.SampleBuffer is deprecated: the default buffer is OldestFirstBuffer "
            "(areal_plugins.core.buffer); SampleBuffer names the contract (areal_plugins.SampleBuffer)",
            DeprecationWarning,
            stacklevel=2,
        )
        return OldestFirstBuffer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
