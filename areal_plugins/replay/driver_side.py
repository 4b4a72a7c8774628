"""The trainer's side of a replay (``areal.replay.run_dir``): the recorded groups by step, the version barrier, and
the comparison as it goes (docs/replay.md).

- :class:`ReplaySampleBuffer` hands each step the groups the record says it trained, in the record's order, once
  they are generated; groups of prompts the recorded run never trained stay in it.
- :meth:`ReplayDriver.finish_version` holds the trainer, before the engines stop serving a version (colocated: at
  the end of sampling; separate: before the weight update), until every recorded request under that version has
  been generated.
- Each step's trajectories (tokens, behaviour log-probs, requests, versions, rewards) are compared with the record
  when taken, its learning metrics after the update: the first difference stops the replay, written to
  ``areal_replay.jsonl`` and named in the error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf

from areal_plugins.agent_loop.partial_outputs import PARTIALS_DIR
from areal_plugins.config.settings import areal_settings
from areal_plugins.core.buffer import BufferedGroup
from areal_plugins.core.trajectory_rows import REPLAY_OF
from areal_plugins.records.compare import METRIC_FIELDS, Divergence, read_metrics, read_samples, same, step_divergence
from areal_plugins.records.writer import RunRecorder
from areal_plugins.replay.conductor import start_conductor
from areal_plugins.replay.requests import ReplayError
from areal_plugins.replay.schedule import RecordedGroup, ReplaySchedule

logger = logging.getLogger(__name__)

REPLAY_RECORD = "areal_replay.jsonl"
#: How often the trainer looks whether the recorded requests of a version are all generated.
BARRIER_POLL_S = 0.05


class ReplayDivergedError(RuntimeError):
    """The replay left the record: the message names the step, the field and both values."""


def require_replayable(config: Any) -> None:
    """Refuse, at startup, a run whose engine cannot regenerate a request bit for bit."""
    rollout = config.actor_rollout_ref.rollout
    if str(rollout.name) != "areal_cpu":
        raise ReplayError(
            f"replay needs an engine whose output depends on the request alone; actor_rollout_ref.rollout.name="
            f"{rollout.name} batches requests with kernels whose results depend on the batch. vLLM's batch-invariant "
            "mode (VLLM_BATCH_INVARIANT=1, on the GPUs it supports) could promise it, but replay is not built or "
            "tested on it, so nothing is promised. Replay runs recorded with rollout.name=areal_cpu and "
            "engine_kwargs.areal_cpu.batch_invariant=true"
        )
    if OmegaConf.select(rollout, "engine_kwargs.areal_cpu.batch_invariant", default=False) is not True:
        raise ReplayError(
            "replay needs actor_rollout_ref.rollout.engine_kwargs.areal_cpu.batch_invariant=true (each request decoded "
            "alone, so its tokens do not depend on what else is in flight); record the run with it, and replay with it"
        )


def resumed_checkpoint(config: Any) -> Path | None:
    """The recorded run's checkpoint a replay starts from (``areal.replay.from_step``), or None (from the start).

    Refused unless colocated: there the checkpoint is taken with the engines asleep, every request cut where the
    record cut it, so what it keeps ends on a recorded request. With ``placement: separate`` the engines keep
    generating under the old weights while the checkpoint is taken, and that output cannot be made again."""
    settings = areal_settings(config)
    from_step = settings.replay.from_step
    if from_step == 0:
        return None
    if settings.placement != "colocated":
        raise ReplayError(
            "a replay from a checkpoint needs a run recorded with areal.placement=colocated: with separate engines the "
            "requests in flight at the checkpoint were generating under weights the checkpoint does not hold. Replay "
            "this run from its start (without --from-checkpoint)"
        )
    folder = Path(str(OmegaConf.select(config, "trainer.resume_from_path", default="")))
    if not (folder / PARTIALS_DIR).is_dir():
        raise ReplayError(
            f"{folder} keeps no {PARTIALS_DIR}/ (the requests in flight at the checkpoint): it was written by an "
            "earlier version; replay this run from its start"
        )
    return folder


class ReplaySampleBuffer:
    """The sample buffer of a replay (the ``SampleBuffer`` contract): step k takes the record's step-k groups."""

    over_stale_kept = 0

    def __init__(
        self,
        schedule: ReplaySchedule,
        recorded: dict[int, list[dict]],
        on_divergence: Callable[[Divergence], None],
        first_failure: Callable[[], tuple[str, str] | None] = lambda: None,
    ) -> None:
        self.schedule = schedule
        self.recorded = recorded
        self.on_divergence = on_divergence
        self.first_failure = first_failure  # (recorded trajectory, error) of a replayed request that failed
        self._mixed: tuple[str, list[str]] | None = None  # a group whose members followed other recorded groups
        self.steps_taken = schedule.first_step - 1
        self._carried = {uid for uid, group in schedule.carried.items() if group is not None}
        self._groups: dict[str, BufferedGroup] = {}  # by the recorded group its members follow
        self._free = 0  # groups of prompts the recorded run never trained
        self._ready = threading.Condition()

    def __len__(self) -> int:
        with self._ready:
            return len(self._groups) + self._free

    def put(self, group: BufferedGroup) -> None:
        followed = [str(info.get(REPLAY_OF)).split("/", 1)[0] for info in group.info if info.get(REPLAY_OF)]
        if not followed and group.group_id in self._carried:  # finished before the resumed checkpoint, kept by it
            followed = [group.group_id] * len(group.info)
        with self._ready:
            if not followed:
                self._free += 1
                return
            if len(set(followed)) > 1 or len(followed) != len(group.info) or followed[0] in self._groups:
                self._mixed = (group.group_id, followed)  # the take that waits for it reports it
            else:
                self._groups[followed[0]] = group
            self._ready.notify_all()

    def take(
        self, count: int, trainer_version: int, timeout: float | None = None
    ) -> tuple[list[BufferedGroup], list[BufferedGroup]]:
        step = self.steps_taken + 1
        wanted = self.schedule.groups_of_step(step)
        if count != len(wanted):
            raise ReplayError(f"step {step} asks for {count} groups where the record trained {len(wanted)}")
        failure = self.first_failure()
        if failure is not None:
            self.on_divergence(Divergence(step, "a replayed request failed", failure[0], failure[1]))
        with self._ready:
            if not self._ready.wait_for(lambda: all(g.group in self._groups for g in wanted), timeout):
                if self._mixed is not None:
                    group_id, followed = self._mixed
                    self.on_divergence(Divergence(step, f"group {group_id} followed recorded groups", None, followed))
                return [], []
            taken = [in_recorded_order(self._groups.pop(g.group), g) for g in wanted]
            self.steps_taken = step
        replayed = [info for group in taken for info in group.info]
        divergence = step_divergence(step, self.recorded[step], replayed, rtol=0.0)
        if divergence is not None:
            self.on_divergence(divergence)
        return taken, []


def in_recorded_order(group: BufferedGroup, recorded: RecordedGroup) -> BufferedGroup:
    """``group``'s trajectories in the order the recorded step consumed the ones they follow (where each follows
    one of ``recorded``'s; otherwise as they are, and the comparison names the difference)."""
    position = {t.name: index for index, t in enumerate(recorded.trajectories)}
    order = sorted(range(len(group.keys)), key=lambda i: position.get(str(group.info[i].get(REPLAY_OF)), len(position)))
    return BufferedGroup(
        group_id=group.group_id,
        head_versions=[group.head_versions[i] for i in order],
        keys=[group.keys[i] for i in order],
        tags=[group.tags[i] for i in order],
        info=[group.info[i] for i in order],
    )


class ReplayDriver:
    """The schedule source of a replay (``areal_plugins.driver.schedule_source``), built by the trainer when
    ``areal.replay.run_dir`` is set (inside the Ray job): the record's groups by step, a barrier at each version's end,
    the step's metrics compared with the record's."""

    #: The barrier at a version's end needs admission stopped before the update.
    pauses_admission_before_update = True

    def client_class(self) -> type:
        from areal_plugins.replay.agent_loop_side import ReplayingLLMClient

        return ReplayingLLMClient

    def sample_buffer(self, config: Any) -> Any:
        """The record says which groups each step trains: the hook's buffer is not asked (docs/replay.md)."""
        return self.buffer

    def __init__(self, config: Any, recorded_dir: Path, recorder: RunRecorder) -> None:
        require_replayable(config)
        self.recorded_dir = recorded_dir
        self.stuck_s = float(areal_settings(config).watchdog_s)
        self.recorder = recorder
        answers = int(OmegaConf.select(config, "actor_rollout_ref.rollout.n", default=1) or 1)
        self.schedule = ReplaySchedule.from_run(recorded_dir, answers, resumed_checkpoint(config))
        self.recorded_metrics = read_metrics(recorded_dir)
        self.conductor = start_conductor(self.schedule)
        self.buffer = ReplaySampleBuffer(
            self.schedule,
            read_samples(recorded_dir / "areal_samples.jsonl"),
            self.diverged,
            lambda: ray.get(self.conductor.first_failure.remote()),
        )
        logger.info(
            "areal: replaying %s: %d recorded steps, %d recorded requests",
            recorded_dir,
            len(self.schedule.steps),
            sum(self.schedule.chunks_per_version.values()),
        )

    def pending(self, version: int) -> int:
        """Recorded requests under versions up to ``version`` not generated yet."""
        return int(ray.get(self.conductor.pending.remote(version)))

    def served(self, version: int) -> None:
        """The engines serve ``version`` now: recorded requests under it may run."""
        ray.get(self.conductor.set_version.remote(version))

    def finish_version(self, version: int, check: Callable[[], None]) -> None:
        """Return once every recorded request under versions up to ``version`` has been generated; ``check``
        (the trainer's supervisor) raises when the run cannot go on. Stops the replay, saying what it waited for,
        when no such request has been generated for ``areal.watchdog_s`` (:attr:`stuck_s`)."""
        started = last_change = time.monotonic()
        last = None
        while (pending := self.pending(version)) > 0:
            check()
            now = time.monotonic()
            if pending != last:
                last, last_change = pending, now
            elif now - last_change > self.stuck_s:
                raise ReplayDivergedError(
                    f"areal: the replay waited {self.stuck_s:.0f} s (areal.watchdog_s) for {pending} recorded requests "
                    f"under weight versions up to {version} and none came: their prompts were not drawn when the "
                    "record drew them (another dataset or data order than the recorded run's?), so the record cannot "
                    "be followed"
                )
            time.sleep(BARRIER_POLL_S)
        self.recorder.write(REPLAY_RECORD, {"version": version, "barrier_s": time.monotonic() - started})

    def check_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Compare the step's learning metrics with the record's (exactly)."""
        recorded = self.recorded_metrics.get(step, {})
        for name in METRIC_FIELDS:
            if name not in recorded or name not in metrics:
                continue
            ours = as_number(metrics[name])
            if not same(recorded[name], ours, 0.0):
                self.diverged(Divergence(step, name, recorded[name], ours))
        self.recorder.write(REPLAY_RECORD, {"step": step, "matched": True})

    def diverged(self, divergence: Divergence) -> None:
        self.recorder.write(
            REPLAY_RECORD,
            {
                "step": divergence.step,
                "matched": False,
                "field": divergence.field,
                "recorded": divergence.first,
                "replayed": divergence.second,
                "trajectory": divergence.trajectory,
            },
        )
        raise ReplayDivergedError(f"areal: the replay left the record at {divergence} (recorded vs replayed)")


def as_number(value: Any) -> Any:
    """A metric as the file logger writes it (numpy and torch scalars become Python floats)."""
    if hasattr(value, "item"):
        value = value.item()
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
