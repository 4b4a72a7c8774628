"""What keeps an async run from hanging silently (docs/faults.md): three detectors, one exit.

- While the trainer waits for samples: the admission loop's error, a dead Ray actor, and the watchdog
  (no rollout progress for ``areal.watchdog_s``) each stop the run with a message that names the cause.
- While the trainer computes: the stall guard (a thread) stops a step that takes far longer than any before.
- Between two steps: a stop requested by the CLI (Ctrl-C, SIGTERM) is honoured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from areal_plugins.run.control import STOP_REQUEST_FILE
from areal_plugins.run.records import RunRecorder, record_exists
from areal_plugins.trainers.actor_liveness import ActorLiveness
from areal_plugins.trainers.engine_stats import EngineStats
from areal_plugins.trainers.watchdog import StallGuard, Watchdog, stall_limit


class Supervisor:
    """The detectors of one run. ``trainer`` gives the state they report on: ``manager``, ``sample_buffer``,
    ``version``, ``global_steps``, ``config``; ``stop_on_request`` is called when the CLI asked to stop."""

    def __init__(
        self,
        trainer: Any,
        watchdog_s: float,
        engine_stats: EngineStats,
        recorder: RunRecorder,
        stop_on_request: Callable[[], None],
    ) -> None:
        self.trainer = trainer
        self.watchdog_s = watchdog_s
        self.engine_stats = engine_stats
        self.recorder = recorder
        self.stop_on_request = stop_on_request
        self.liveness = ActorLiveness(survivable=engine_stats.pool.survivable)
        self.stall_guard: StallGuard | None = None

    def start(self) -> None:
        """Start the stall guard: from now on a step that stalls stops the run."""
        self.stall_guard = StallGuard(stall_limit(self.watchdog_s), self._stall_report, probe=self.liveness.dead_actor)
        self.stall_guard.start()

    def close(self) -> None:
        if self.stall_guard is not None:
            self.stall_guard.close()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stall guard off for the block (validation: its generation is judged by nothing else)."""
        if self.stall_guard is None:
            yield
            return
        with self.stall_guard.paused():
            yield

    def explain(self) -> None:
        """Raise an error naming the dead actor (and its node) behind a failure, if there is one."""
        self.liveness.explain()

    def waiting(self) -> Callable[[], None]:
        """A check to call in each round of waiting for samples; raises when the run must stop."""
        watchdog = Watchdog(self.watchdog_s)

        def check() -> None:
            if self.stall_guard is not None:
                self.stall_guard.beat()
            if self.recorder.run_dir is not None and record_exists(STOP_REQUEST_FILE, self.recorder.run_dir):
                self.stop_on_request()
            try:
                self.trainer.manager.check_alive()
            except RuntimeError:
                self.liveness.explain()  # raises RunActorDiedError when a dead actor is behind it
                raise
            self.liveness.check()
            if self.engine_stats.pool.has_suspects:  # a replica died: drop it here, between weight syncs
                self.engine_stats.pool.prune()
            watchdog.check(self._progress_marker, self._stuck_report)

        return check

    def _progress_marker(self) -> tuple:
        """Changes whenever rollout work moves: groups settled, tokens generated."""
        stats = self.engine_stats.read() or {}
        return (self.trainer.manager.last_progress, stats.get("generated_tokens"))

    def _stuck_report(self, waited: float) -> str:
        trainer = self.trainer
        controller = trainer.manager.controller
        stats = self.engine_stats.read()
        engines = (
            f"engines: {stats['in_flight']} requests in flight, {stats['generated_tokens']} tokens generated in total"
            if stats
            else "engines: no activity statistics (verl's own engines keep none)"
        )
        return (
            f"areal watchdog: the trainer waited {waited:.0f} s (areal.watchdog_s) for "
            f"{trainer.config.data.train_batch_size} groups at version {trainer.version} and no rollout progressed. "
            f"Admission: {controller.running} groups in flight, {controller.accepted} accepted, "
            f"{controller.rejected} rejected, {len(trainer.sample_buffer)} buffered; "
            f"{engines}. Likely stuck: "
            + (
                "the rollout engines or agent-loop workers (requests in flight, no tokens)"
                if controller.running
                else "admission (nothing in flight: is areal.max_concurrent_rollouts or the staleness bound too tight?)"
            )
        )

    def _stall_report(self, idle: float) -> str:
        guard_span = self.stall_guard.longest_span_s if self.stall_guard is not None else 0.0
        return (
            f"areal watchdog: the trainer has been computing step {self.trainer.global_steps} for {idle:.0f} s "
            f"without finishing it (limit: areal.watchdog_s = {self.watchdog_s:.0f} with time left to stop within "
            f"it, or 3x the longest step computed so far, {guard_span:.0f} s): a trainer worker (old log-probs, "
            "update, weight sync) is stuck. Stopping the run; resume from the last checkpoint "
            "(trainer.resume_mode=auto), and raise areal.watchdog_s if one step legitimately takes this long"
        )
