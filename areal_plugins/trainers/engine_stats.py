"""The rollout engines' activity: summed statistics of our servers, sampled for the timeline and per step.

verl's own engines keep no statistics, except ``vllm``, whose server is our subclass under ``areal_async``
(rollout/verl_vllm/server.py); for the others :meth:`EngineStats.read` returns None and the watchdog judges
progress by finished groups alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from areal_plugins.run.records import RunRecorder
from areal_plugins.trainers.step_metrics import rollout_rates

logger = logging.getLogger(__name__)

#: How often the engines' activity is sampled for the timeline.
MONITOR_S = 0.5


class RolloutServerDiedError(RuntimeError):
    """A rollout server actor is gone and nothing replaces it."""


class EngineStats:
    """Reads our rollout servers' ``get_stats``; ``servers()`` returns the replicas generating now."""

    def __init__(self, backend: str, servers: Callable[[], Any], recorder: RunRecorder) -> None:
        from areal_plugins.rollout.verl_registration import BACKENDS

        self.backend = backend
        self.kept = backend in BACKENDS or backend == "vllm"  # verl's vllm: our server subclass counts
        self._servers = servers
        self._recorder = recorder
        self.errors = 0  # looks at the statistics that failed (areal/rollout_stats_errors)
        self._last: dict[str, Any] | None = None
        self._last_time = time.time()
        self._stop = threading.Event()

    def read(self) -> dict[str, Any] | None:
        """Summed statistics of every server; None for verl's own engines, which keep none."""
        if not self.kept:
            return None
        servers = [(replica.replica_rank, s) for replica in self._servers().get_replicas() for s in replica.servers]
        try:
            stats: list[dict[str, Any]] = ray.get([server.get_stats.remote() for _, server in servers], timeout=60)
        except ray.exceptions.RayActorError as error:
            raise RolloutServerDiedError(
                f"a rollout server of {self.backend} (replicas {[rank for rank, _ in servers]}) died and this "
                f"backend does not restart it: {str(error).splitlines()[0]}. Stopping the run; resume from the "
                "last checkpoint (trainer.resume_mode=auto) once the cause (memory? a kill?) is fixed"
            ) from error
        total = {"replicas": len(stats), "busy_s": 0.0, "generated_tokens": 0, "in_flight": 0, "restarts": 0}
        for item in stats:
            for key in ("busy_s", "generated_tokens", "in_flight"):
                total[key] += item[key]
            total["restarts"] += item.get("restarts", 0)  # engines that can die and be replaced (vLLM)
        return total

    def start(self) -> None:
        """Take the first reading (the rates' baseline) and sample for the timeline from now on."""
        self._last, self._last_time = self.read(), time.time()
        threading.Thread(target=self._monitor, name="areal-rollout-monitor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def step_rates(self, now: float) -> dict[str, float]:
        """Generation rates since the last call (``areal/gen_tokens_per_s``, idle ratio, restarts)."""
        try:
            stats = self.read()
        except Exception:
            self.errors += 1
            raise
        rates = rollout_rates(self._last, stats, now - self._last_time)
        self._last, self._last_time = stats, now
        return rates

    def _monitor(self) -> None:
        """Sample the engines' activity for the timeline picture (own thread, every MONITOR_S)."""
        last_error = ""
        while not self._stop.wait(MONITOR_S):
            try:
                stats = self.read()
            except Exception as error:  # a dead or hung server: the trainer's own calls report it
                self.errors += 1
                if repr(error) != last_error:  # once per distinct error, not twice a second
                    logger.warning("rollout statistics unavailable (%r); the timeline has a gap", error)
                    last_error = repr(error)
                continue
            if stats is None:
                return
            self._recorder.write(
                "timeline.jsonl",
                {"who": "rollout", "time": time.time(), "in_flight": stats["in_flight"], "busy_s": stats["busy_s"]},
            )
