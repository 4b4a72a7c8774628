"""The rollout engines' activity: summed statistics of our servers, sampled for the timeline and per step.

verl's own engines keep no statistics, except ``vllm``, whose server is our subclass under ``areal_async``
(rollout/verl_vllm/server.py); for the others :meth:`EngineStats.read` returns None and the watchdog judges
progress by finished groups alone.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from areal_plugins.driver.replica_pool import ReplicaPool, RolloutServerDiedError, actor_id
from areal_plugins.driver.step_metrics import rollout_rates
from areal_plugins.records.writer import RunRecorder

logger = logging.getLogger(__name__)

#: How often the engines' activity is sampled for the timeline.
MONITOR_S = 0.5
#: A statistics call may take this many times the slowest one measured before it counts as timed out
#: (a loaded server answers late; one that answers ten times later than ever before is left for the next look).
SLOW_FACTOR = 10.0
#: Floor of that limit: one Ray round trip to a busy actor on a loaded node, not an engine's work.
MIN_LIMIT_S = 1.0


class EngineStats:
    """Reads our rollout servers' ``get_stats``, summed over the replicas of ``pool``.

    A server that died keeps its last counters in the sums (generated tokens and busy time stay monotonic, so
    the rates never go negative), its in-flight count drops to 0, and the pool is told. A server slower than
    :meth:`limit_s` keeps its last counters for this reading; the call is counted (``timeouts``), never fatal.
    """

    def __init__(self, backend: str, pool: ReplicaPool, recorder: RunRecorder, watchdog_s: float = 900.0) -> None:
        from areal_plugins.rollout.verl_registration import backends

        self.backend = backend
        self.kept = backend in backends() or backend == "vllm"  # verl's vllm: our server subclass counts
        self.pool = pool
        self._recorder = recorder
        self.errors = 0  # looks at the statistics that failed (areal/rollout_stats_errors)
        self.timeouts = 0  # statistics calls past limit_s() (areal/rollout_stats_timeouts)
        self.watchdog_s = watchdog_s
        self.slowest_s = 0.0  # the slowest statistics call answered so far
        self.last_reading: dict[str, Any] | None = None  # the latest sums, for the stall guard's cheap look
        self._slow_logged: set[str] = set()
        self._last: dict[str, Any] | None = None
        self._last_time = time.time()
        self._stop = threading.Event()
        self._per_server: dict[str, dict[str, Any]] = {}  # actor id -> its last statistics
        self._per_server_lock = threading.Lock()  # the trainer and the monitor thread both read

    def read(self) -> dict[str, Any] | None:
        """Summed statistics of every server; None for verl's own engines, which keep none."""
        if not self.kept:
            return None
        servers = self.pool.servers()
        started = time.monotonic()
        pending = [(rank, actor_id(server), server.get_stats.remote()) for rank, server in servers]
        dead = []
        for rank, key, ref in pending:
            limit = self.limit_s()
            try:
                stats = ray.get(ref, timeout=max(limit - (time.monotonic() - started), 0.0))
            except ray.exceptions.GetTimeoutError:
                self.timeouts += 1  # its last counters stand in for this reading
                if key not in self._slow_logged:
                    self._slow_logged.add(key)
                    logger.warning(
                        "areal: replica %s answered no statistics within %.1f s (%.0fx the slowest answer so far, "
                        "at most areal.watchdog_s); its last counters are used, the run goes on "
                        "(areal/rollout_stats_timeouts counts these)",
                        rank,
                        limit,
                        SLOW_FACTOR,
                    )
                continue
            except ray.exceptions.RayActorError as error:
                if not self.pool.survivable(key):
                    raise RolloutServerDiedError(
                        f"a rollout server of {self.backend} (replica {rank}) died and no other replica can take "
                        f"its requests: {str(error).splitlines()[0]}. Stopping the run; resume from the last "
                        "checkpoint (trainer.resume_mode=auto) once the cause (memory? a kill?) is fixed"
                    ) from error
                dead.append(key)
                continue
            self.slowest_s = max(self.slowest_s, time.monotonic() - started)
            with self._per_server_lock:
                self._per_server[key] = stats
        serving = {key for _, key, _ in pending} - set(dead)
        with self._per_server_lock:
            for key, stats in self._per_server.items():  # a dead or dropped server's work stays counted ...
                if key not in serving:
                    self._per_server[key] = dict(stats, in_flight=0)  # ... but nothing of it is in flight
            readings = list(self._per_server.values())
        total = {"replicas": len(servers) - len(dead), "busy_s": 0.0, "generated_tokens": 0, "in_flight": 0}
        total["restarts"] = 0
        for item in readings:
            for key in ("busy_s", "generated_tokens", "in_flight"):
                total[key] += item[key]
            total["restarts"] += item.get("restarts", 0)  # engines that can die and be replaced (vLLM)
        self.last_reading = total
        return total

    def limit_s(self) -> float:
        """How long one reading may wait for a server: :data:`SLOW_FACTOR` x the slowest answer measured (at
        least :data:`MIN_LIMIT_S`), at most ``areal.watchdog_s``; ``areal.watchdog_s`` until one is measured."""
        if self.slowest_s == 0.0:
            return self.watchdog_s
        return min(self.watchdog_s, max(MIN_LIMIT_S, SLOW_FACTOR * self.slowest_s))

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
