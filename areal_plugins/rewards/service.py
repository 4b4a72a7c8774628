"""Rewards in worker processes with a time limit: a hung, raising or crashing verifier costs one reward.

math-verify bounds its own time with ``signal.alarm``, which only works in a process's main thread
(docs/design.md, Rewards); verl calls reward functions from threads and async actors. So each call runs in the
main thread of a worker process, the caller waits at most ``timeout_s`` (from when the worker is ready: its
start is not the function's time), and:

- the function raises -> reward 0, counted in ``failures``, logged;
- it does not answer in time -> the worker is killed and replaced, the call retried up to ``retries``
  times, then reward 0, counted in ``timeouts``;
- the worker dies -> replaced, the call retried the same way, counted in ``crashes``.

Nothing is lost: every call returns a float. Pure Python (multiprocessing), no Ray or verl.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal_plugins.rewards.sizing import reward_limit_s

logger = logging.getLogger(__name__)


#: Most seconds a new worker process may take to start (fork from the fork server, import the reward function's
#: module) before it counts as crashed; not part of ``timeout_s``, which bounds the reward function alone.
STARTUP_S = 120.0
READY = ("ready", None)
#: How the log says what happened to a worker, by its counter's name.
_WHAT = {"timeouts": "timed out", "crashes": "crashed"}


def _serve(connection: Any, fn: Callable[..., float]) -> None:
    """Worker process: say it is ready (the function is unpickled, its module imported), then score requests
    until the pipe closes."""
    connection.send(READY)
    while True:
        try:
            args = connection.recv()
        except EOFError:
            return
        try:
            connection.send(("ok", float(fn(*args))))
        except BaseException as error:  # math-verify timeouts derive from BaseException; the caller counts it
            connection.send(("error", f"{type(error).__name__}: {error}"))


class _Worker:
    def __init__(self, context: Any, fn: Callable[..., float]) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, fn), daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> bool:
        """Wait (up to :data:`STARTUP_S`) for the worker to start; False if it died or never said so."""
        if not self.ready:
            try:
                self.ready = self.connection.poll(STARTUP_S) and self.connection.recv() == READY
            except (EOFError, OSError):
                return False
        return self.ready

    def stop(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.connection.close()


@dataclass
class ScoreReport:
    """One :meth:`RewardService.score_with_report`: the reward and what it cost.

    ``failed``: the reward is 0 because the function raised or every attempt timed out or crashed.
    """

    score: float = 0.0
    latency_s: float = 0.0
    failed: bool = False
    timeouts: int = 0
    crashes: int = 0

    def as_extra_info(self) -> dict[str, float]:
        """verl ``reward_extra_info`` fields (numbers, so verl can aggregate them)."""
        return {
            "areal_reward_latency_s": self.latency_s,
            "areal_reward_failed": float(self.failed),
            "areal_reward_timeouts": float(self.timeouts),
            "areal_reward_crashes": float(self.crashes),
        }


class RewardService:
    """A pool of reward worker processes; :meth:`score` never raises and never hangs.

    Args:
        fn: the reward function ``(data_source, solution_str, ground_truth, extra_info) -> float``;
            module-level (it is sent to the workers by reference).
        num_workers: worker processes (calls beyond that wait for a free worker).
        timeout_s: most seconds one attempt may take (for an answer of up to ``timeout_chars`` characters).
        retries: further attempts after a timeout or a crash.
        timeout_chars: the answer length ``timeout_s`` is for; a longer answer (the second argument) gets
            ``timeout_s x length / timeout_chars``. None: ``timeout_s`` for any length.
        warn_timeout_share: warn once the rewards lost to timeouts pass this share of the calls.
    """

    def __init__(
        self,
        fn: Callable[..., float],
        num_workers: int = 2,
        timeout_s: float = 10.0,
        retries: int = 1,
        timeout_chars: int | None = None,
        warn_timeout_share: float = 0.01,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.fn = fn
        self.timeout_s = timeout_s
        self.timeout_chars = timeout_chars
        self.retries = retries
        self.warn_timeout_share = warn_timeout_share
        self.timed_out = 0  # rewards that are 0 because every attempt timed out
        self._warned = False
        # Not fork: verl's reward workers are threaded Ray actors. The fork server imports the caller's main module
        # once (a Ray worker's is Ray itself, 7.5 s of CPU on the 2-core box); spawn paid that in every process. The
        # reward's own module is still imported in each process, inside STARTUP_S, so one that hangs on import
        # costs that process, not the caller.
        self._context = mp.get_context("forkserver")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(_Worker(self._context, fn))
        self._lock = threading.Lock()
        self.counts = {"calls": 0, "failures": 0, "timeouts": 0, "crashes": 0}
        self.latency_s_total = 0.0
        self.latency_s_max = 0.0

    def score(self, *args: Any) -> float:
        """The reward for ``args``, or 0.0 after a counted failure, timeout or crash."""
        return self.score_with_report(*args).score

    def score_with_report(self, *args: Any) -> ScoreReport:
        """The reward for ``args`` and what it took (never raises, never hangs past the retries)."""
        started = time.monotonic()
        report = ScoreReport()
        limit = self.limit_s(args)
        worker = self._idle.get()
        try:
            for attempt in range(self.retries + 1):
                worker.connection.send(args)
                outcome = self._wait(worker, limit)
                if outcome[0] == "ok":
                    report.score = float(outcome[1])
                    return report
                if outcome[0] == "error":
                    self._count("failures")
                    report.failed = True
                    logger.warning("reward function raised (reward 0): %s", outcome[1])
                    return report
                self._count(outcome[0])
                setattr(report, outcome[0], getattr(report, outcome[0]) + 1)
                logger.warning("reward worker %s on attempt %d; replacing it", _WHAT[outcome[0]], attempt + 1)
                worker.stop()
                worker = _Worker(self._context, self.fn)
            report.failed = True
            if report.timeouts:
                self._lost_to_timeout()
            return report
        finally:
            self._idle.put(worker)
            elapsed = time.monotonic() - started
            report.latency_s = elapsed
            with self._lock:
                self.counts["calls"] += 1
                self.latency_s_total += elapsed
                self.latency_s_max = max(self.latency_s_max, elapsed)

    def limit_s(self, args: tuple) -> float:
        """The time limit of one attempt at ``args`` (``data_source, solution_str, ...``): it scales with the
        answer's length past ``timeout_chars`` (a verifier's parse grows with the text it reads)."""
        if len(args) < 2:
            return self.timeout_s
        return reward_limit_s(self.timeout_s, self.timeout_chars, len(str(args[1])))

    def _lost_to_timeout(self) -> None:
        with self._lock:
            self.timed_out += 1
            calls = self.counts["calls"] + 1  # this call is counted when it returns
            share = self.timed_out / calls
            # Judged once the share can be told apart from a single timeout: 1/share calls at least.
            due = not self._warned and calls * self.warn_timeout_share >= 1 and share > self.warn_timeout_share
            self._warned = self._warned or due
        if due:
            logger.warning(
                "areal: %d of %d rewards were 0 because scoring timed out (%.1f%%, past areal.reward."
                "warn_timeout_share = %.1f%%): the advantages are biased against long answers; raise "
                "areal.reward.timeout_s or areal.reward.timeout_chars, or use a faster verifier",
                self.timed_out,
                calls,
                100 * share,
                100 * self.warn_timeout_share,
            )

    def _wait(self, worker: _Worker, limit_s: float) -> tuple[str, Any]:
        if not worker.wait_ready():  # starting a worker on a busy machine is not the reward timing out
            return ("crashes", None)
        try:
            if worker.connection.poll(limit_s):
                return worker.connection.recv()
        except (EOFError, OSError):
            return ("crashes", None)
        return ("timeouts", None) if worker.process.is_alive() else ("crashes", None)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def stats(self) -> dict[str, float]:
        """Counters and latency, namespaced for metrics (``areal/reward_*``)."""
        with self._lock:
            calls = max(self.counts["calls"], 1)
            stats = {f"areal/reward_{key}": float(value) for key, value in self.counts.items()}
            stats["areal/reward_latency_s_mean"] = self.latency_s_total / calls
            stats["areal/reward_latency_s_max"] = self.latency_s_max
            return stats

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().stop()
