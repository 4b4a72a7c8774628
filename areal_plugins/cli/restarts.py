"""Automatic resume: when a run fails (not stopped by its user), start it again from its last checkpoint.

``areal-plugins train ... --max-restarts N`` (or ``areal.max_restarts``) restarts a failed run up to N times,
each after a back-off that doubles (``RESTART_BACKOFF_S``, capped), with ``trainer.resume_mode=auto`` so verl and
the async trainer resume from the last checkpoint. One log line per restart names the cause. The same error twice
in a row with no new checkpoint in between stops for good: restarting would only repeat it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Seconds before the first restart; doubled for each further one, at most ``MAX_BACKOFF_S``.
RESTART_BACKOFF_S = 10.0
MAX_BACKOFF_S = 300.0
RESUME_OVERRIDE = "trainer.resume_mode=auto"


@dataclass(frozen=True)
class Attempt:
    """How one start of verl's ``main_ppo`` ended."""

    code: int
    user_signal: int | None  # Ctrl-C or SIGTERM to the CLI: never restarted
    last_error: str | None
    checkpoint: int | None  # the last checkpointed step when it ended


def latest_checkpoint(checkpoints: Path) -> int | None:
    """The step of the last checkpoint verl wrote in ``checkpoints`` (its ``latest_checkpointed_iteration.txt``)."""
    marker = checkpoints / "latest_checkpointed_iteration.txt"
    try:
        return int(marker.read_text().strip())
    except (OSError, ValueError):
        return None


@dataclass
class RestartPolicy:
    max_restarts: int
    backoff_s: float = RESTART_BACKOFF_S
    restarts: int = 0
    previous: Attempt | None = None

    def next_restart(self, attempt: Attempt) -> tuple[float | None, str]:
        """``(seconds to wait, why)`` before restarting after ``attempt``, or ``(None, why not)``."""
        previous, self.previous = self.previous, attempt
        if attempt.code == 0:
            return None, "finished"
        if attempt.user_signal is not None:
            return None, "stopped by its user"
        if self.restarts >= self.max_restarts:
            return None, f"no restarts left (--max-restarts {self.max_restarts})"
        if (
            previous is not None
            and previous.last_error == attempt.last_error
            and (previous.checkpoint == attempt.checkpoint)
        ):
            return None, "the same error twice in a row with no new checkpoint in between: restarting would repeat it"
        self.restarts += 1
        return min(self.backoff_s * 2 ** (self.restarts - 1), MAX_BACKOFF_S), "restarting"


class SignalLatch:
    """Between two attempts (verl not running): remembers a Ctrl-C or SIGTERM, so that no restart follows it."""

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        import signal

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received = self.received or signum

    def wait(self, seconds: float) -> int | None:
        """Sleep ``seconds`` unless a signal comes (or came); return it, or None."""
        import time

        deadline = time.monotonic() + seconds
        while self.received is None and time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return self.received
