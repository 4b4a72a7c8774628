"""The replay's one shared state, a Ray actor: which recorded trajectory each request follows, which weight version
the engines serve, and which recorded requests are still to come under each version.

verl's agent-loop workers (our rollout client) claim trajectories and wait for versions; the trainer says when the
engines serve a new version and waits, before the engines stop serving a version, until every recorded request
under it has been generated (docs/replay.md). Timing then decides nothing: each request runs under the weights the
record says, and is cut where the record says.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from areal_plugins.replay.schedule import ReplaySchedule

CONDUCTOR_NAME = "areal_replay_conductor"


class ReplayConductor:
    """Ray actor (async methods run on one event loop: no locks needed)."""

    def __init__(self, schedule: ReplaySchedule) -> None:
        self.schedule = schedule
        self.version = -1  # none served yet
        self.done: Counter[int] = Counter()  # recorded requests generated, by version
        self._changed = asyncio.Condition()
        self.failures: list[tuple[str, str]] = []  # (recorded trajectory, error) of requests that failed

    def claim(
        self, prompt_digest: str, group_key: str | None = None, member: int | None = None
    ) -> dict[str, Any] | None:
        trajectory = self.schedule.claim(prompt_digest, group_key, member)
        if trajectory is None:
            return None
        plan = [[r.start, r.max_tokens, r.version, r.seed] for r in trajectory.plan]
        return {"name": trajectory.name, "plan": plan}

    async def serve(self, version: int) -> bool:
        """Return once the engines serve ``version``: True, or False when they already serve a later one (the
        replay left the record: the request can no longer run under the weights it ran under)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.version >= version)
            return self.version == version

    async def generated(self, version: int) -> None:
        """One recorded request under ``version`` was generated (or given up)."""
        async with self._changed:
            self.done[version] += 1
            self._changed.notify_all()

    async def set_version(self, version: int) -> None:
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    def failed(self, name: str, error: str) -> None:
        """A request following recorded trajectory ``name`` failed: the replay cannot follow it."""
        self.failures.append((name, error))

    def first_failure(self) -> tuple[str, str] | None:
        return self.failures[0] if self.failures else None

    def pending(self, version: int) -> int:
        """Recorded requests under versions up to ``version`` not generated yet."""
        expected = self.schedule.chunks_per_version
        return sum(expected[v] - self.done[v] for v in expected if v <= version)


def start_conductor(schedule: ReplaySchedule) -> Any:
    import ray

    actor = ray.remote(ReplayConductor).options(name=CONDUCTOR_NAME, num_cpus=0, max_concurrency=10_000)
    return actor.remote(schedule)


def find_conductor() -> Any | None:
    """The replay's conductor, or None when this run is not a replay."""
    import ray

    try:
        return ray.get_actor(CONDUCTOR_NAME)
    except ValueError:
        return None
