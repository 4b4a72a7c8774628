"""What a replay follows: the recorded run's trained groups by step, each trajectory's requests, the version sequence.

Built from the recorded run's ``areal_samples.jsonl`` (docs/reference/run_records.md). A replay hands each request
the next recorded trajectory of its prompt (:meth:`ReplaySchedule.claim`), asks the engine for that trajectory's
requests under their recorded versions, and trains each step on the groups the record says, in its order.
Pure Python: the Ray side is :mod:`areal_plugins.run.replay_conductor`.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from areal_plugins.run.compare import read_samples
from areal_plugins.run.replay_requests import ChunkRequest, ReplayError, chunk_requests

#: The sample field naming the recorded trajectory a replayed one follows (``group/key``).
REPLAY_OF = "replay_of"


@dataclass(frozen=True)
class RecordedTrajectory:
    name: str  # "<recorded group>/<recorded key>": unique in the record
    prompt_digest: str
    response_digest: str
    plan: tuple[ChunkRequest, ...]


@dataclass(frozen=True)
class RecordedGroup:
    group: str
    trajectories: tuple[RecordedTrajectory, ...]


class ReplaySchedule:
    """The recorded steps (groups in consumption order) and the queue of recorded trajectories per prompt.

    Args:
        steps: per trained step, in step order, its groups in the order the step consumed them.
    """

    def __init__(self, steps: list[list[RecordedGroup]]) -> None:
        self.steps = steps
        self._unclaimed: dict[str, deque[RecordedTrajectory]] = {}
        for groups in steps:  # a prompt trained in several steps is claimed in step order
            for group in groups:
                for trajectory in group.trajectories:
                    self._unclaimed.setdefault(trajectory.prompt_digest, deque()).append(trajectory)
        self.chunks_per_version = Counter(
            request.version for groups in steps for g in groups for t in g.trajectories for request in t.plan
        )

    @classmethod
    def from_run(cls, run_dir: Path, answers_per_prompt: int) -> ReplaySchedule:
        """The schedule of the run recorded in ``run_dir``; refuses a record a replay could not follow."""
        path = run_dir / "areal_samples.jsonl"
        if not path.is_file():
            raise ReplayError(
                f"{path} is missing: areal.replay.run_dir must be a run directory written by areal-plugins train "
                "with areal.enable: true"
            )
        by_step = read_samples(path)
        if not by_step:
            raise ReplayError(f"{path} records no trained step: the recorded run trained nothing to replay")
        if sorted(by_step) != list(range(1, len(by_step) + 1)):
            raise ReplayError(f"{path} records steps {sorted(by_step)}: a replay needs every step from 1")
        steps = []
        for step in sorted(by_step):
            groups: dict[str, list[RecordedTrajectory]] = {}
            for sample in by_step[step]:
                if sample.get("turns", 1) > 1:
                    raise ReplayError(
                        f"step {step} trained an episode of {sample['turns']} turns: replay follows single-turn "
                        "requests only (a tool's answer between turns is not in the record)"
                    )
                name = f"{sample['group']}/{sample['key']}"
                plan = tuple(chunk_requests(sample["chunks"], int(sample["response_tokens"])))
                groups.setdefault(sample["group"], []).append(
                    RecordedTrajectory(name, sample["prompt_digest"], sample["response_digest"], plan)
                )
            for group, members in groups.items():
                if len(members) != answers_per_prompt:
                    raise ReplayError(
                        f"step {step} trained {len(members)} of group {group}'s answers where rollout.n is "
                        f"{answers_per_prompt}: the record does not say which request each trained answer was "
                        "(an areal_accept_trajectory hook dropped some), so a replay cannot follow it"
                    )
            steps.append([RecordedGroup(group, tuple(members)) for group, members in groups.items()])
        return cls(steps)

    def claim(self, prompt_digest: str) -> RecordedTrajectory | None:
        """The next recorded trajectory of this prompt not handed out yet; None when the record has none left (a
        prompt the recorded run generated but never trained)."""
        queue = self._unclaimed.get(prompt_digest)
        return queue.popleft() if queue else None
