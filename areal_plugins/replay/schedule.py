"""What a replay follows: the recorded run's trained groups by step, each trajectory's requests, the version sequence.

Built from the recorded run's ``areal_samples.jsonl`` (docs/reference/run_records.md). A replay hands each request
the members of its prompt's next recorded group, in the order the recorded run submitted them
(:meth:`ReplaySchedule.claim`), asks the engine for that trajectory's
requests under their recorded versions, and trains each step on the groups the record says, in its order.
Pure Python: the Ray side is :mod:`areal_plugins.replay.conductor`.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_plugins.records.compare import read_samples
from areal_plugins.records.writer import read_jsonl
from areal_plugins.replay.requests import ChunkRequest, ReplayError, chunk_requests


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
    """The recorded steps (groups in consumption order) and, per prompt, its recorded groups in submission order.

    Args:
        steps: per trained step from ``first_step`` on, in step order, its groups in the order the step consumed them.
        answers_per_prompt: requests per prompt group (``rollout.n``).
        submitted: per prompt (token digest), the groups the recorded run submitted, in order; None for a group it
            never trained (rejected, or in flight when it ended). Default: the trained groups in training order.
        first_step: the first step replayed; above 1, the replay resumed from the checkpoint of ``first_step - 1``.
        carried: with ``first_step`` above 1, the uids of the groups drawn before that checkpoint (in flight or
            finished at it: the resumed run keeps their uids), each with the group it was trained as, or None.
    """

    def __init__(
        self,
        steps: list[list[RecordedGroup]],
        answers_per_prompt: int,
        submitted: dict[str, list[RecordedGroup | None]] | None = None,
        first_step: int = 1,
        carried: dict[str, RecordedGroup | None] | None = None,
    ) -> None:
        self.steps = steps
        self.first_step = first_step
        self.carried = carried or {}
        self.answers = answers_per_prompt
        if submitted is None:
            submitted = {}
            for groups in steps:
                for group in groups:
                    submitted.setdefault(group.trajectories[0].prompt_digest, []).append(group)
        self._queues = {digest: deque(groups) for digest, groups in submitted.items()}
        self._current: dict[str, tuple[RecordedGroup | None, int]] = {}  # the group being handed out, members handed
        self._by_group: dict[str, RecordedGroup | None] = {}  # replayed group uid -> the recorded group it follows
        # What the replay generates: after a checkpoint of step S the engines serve S, and every request under an
        # earlier version was generated before it (its output is in TransferQueue or the checkpoint's partials).
        resumed_version = first_step - 1
        self.chunks_per_version = Counter(
            request.version
            for groups in steps
            for g in groups
            for t in g.trajectories
            for request in t.plan
            if request.version >= resumed_version
        )

    def groups_of_step(self, step: int) -> list[RecordedGroup]:
        """The groups the recorded run trained at ``step`` (from :attr:`first_step` on), in its order."""
        index = step - self.first_step
        if not 0 <= index < len(self.steps):
            last = self.first_step + len(self.steps) - 1
            raise ReplayError(f"the record ends at step {last}: replay with --until {last}")
        return self.steps[index]

    @classmethod
    def from_run(cls, run_dir: Path, answers_per_prompt: int, checkpoint: Path | None = None) -> ReplaySchedule:
        """The schedule of the run recorded in ``run_dir``, from its start or from ``checkpoint`` (its folder of step
        S: the replay then trains steps S+1 on); refuses a record a replay could not follow."""
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
                        f"{answers_per_prompt}: either an areal_accept_trajectory hook dropped some (the record then "
                        "does not say which request each kept answer was, so a replay cannot follow it), or the "
                        "replay's actor_rollout_ref.rollout.n differs from the recorded run's"
                    )
            steps.append([RecordedGroup(group, tuple(members)) for group, members in groups.items()])
        submissions = read_jsonl(run_dir / "areal_submissions.jsonl")
        if checkpoint is None:
            return cls(steps, answers_per_prompt, submission_order(steps, submissions) if submissions else None)
        resumed = int(checkpoint.name.rsplit("_", 1)[-1])
        drawn = json.loads((checkpoint / "areal_state.json").read_text())["submissions"]
        later = steps[resumed:]
        trained = {group.group: group for groups in later for group in groups}
        carried = {uid: trained.get(uid) for line in submissions[:drawn] for uid in line["uids"]}
        for line in read_jsonl(run_dir / "areal_reissued.jsonl"):
            again = [uid for uid in line["uids"] if uid in carried] if line["version"] >= resumed - 1 else []
            if again:
                raise ReplayError(
                    f"group {again[0]}, drawn before the checkpoint of step {resumed}, was generated again around or "
                    "after it (a failed group, or one past the staleness bound under on_stale: reissue): the "
                    "checkpoint holds its earlier attempt, the record its later one. Replay this run from its start"
                )
        return cls(later, answers_per_prompt, submission_order(later, submissions[drawn:]), resumed + 1, carried)

    def claim(
        self, prompt_digest: str, group_key: str | None = None, member: int | None = None
    ) -> RecordedTrajectory | None:
        """What a request of this prompt follows; None for a group the recorded run never trained (it generates
        freely, and no step trains it) or a prompt the record has no more groups of.

        With ``group_key`` (the replayed group's uid) and ``member`` (its answer's index), the group takes the
        prompt's next recorded group when its first answer asks, and each answer the member it names: two groups
        of one prompt in flight at once never mix. Without them, the prompt's requests take the members of its
        next recorded group in turn (a caller that cannot say which group a request belongs to)."""
        if group_key is not None and member is not None:
            if group_key in self.carried:  # drawn before the resumed checkpoint: the group it was trained as
                self._by_group[group_key] = self.carried[group_key]
            if group_key not in self._by_group:
                queue = self._queues.get(prompt_digest)
                self._by_group[group_key] = queue.popleft() if queue else None
            group = self._by_group[group_key]
            return None if group is None else answer_of(group, member)
        group, handed = self._current.get(prompt_digest, (None, self.answers))
        if handed == self.answers:
            queue = self._queues.get(prompt_digest)
            if not queue:
                return None
            group, handed = queue.popleft(), 0
        self._current[prompt_digest] = (group, handed + 1)
        return group.trajectories[handed] if group is not None else None


def answer_of(group: RecordedGroup, member: int) -> RecordedTrajectory | None:
    """The recorded answer of index ``member`` (verl's session id: keys are ``{uid}_{session}_{output}``). A group's
    answers are recorded in key order, where ``u_10_0`` sorts before ``u_1_0``: position is not the index. Records with
    other keys fall back to position."""
    for trajectory in group.trajectories:
        parts = trajectory.name.split("/", 1)[-1].rsplit("_", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            break
        if int(parts[1]) == member:
            return trajectory
    else:
        return None
    return group.trajectories[member] if member < len(group.trajectories) else None


def submission_order(
    steps: list[list[RecordedGroup]], submissions: list[dict[str, Any]]
) -> dict[str, list[RecordedGroup | None]]:
    """Per prompt (token digest), the recorded run's groups in the order it submitted them (``areal_submissions``:
    uids with the digests of their prompts' text); None for a submitted group no step trained."""
    trained = {group.group: group for groups in steps for group in groups}
    token_digest_of_text: dict[str, str] = {}
    for submission in submissions:
        for uid, text in zip(submission["uids"], submission["prompts"], strict=True):
            if uid in trained:
                token_digest_of_text[text] = trained[uid].trajectories[0].prompt_digest
    order: dict[str, list[RecordedGroup | None]] = {}
    for submission in submissions:
        for uid, text in zip(submission["uids"], submission["prompts"], strict=True):
            digest = token_digest_of_text.get(text)
            if digest is not None:  # a prompt no step trained: its requests find no queue and generate freely
                order.setdefault(digest, []).append(trained.get(uid))
    return order
