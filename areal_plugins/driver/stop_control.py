"""The CLI's stop protocol on the trainer's side (cli/control.py is the other side).

Ctrl-C or SIGTERM to ``areal-plugins run`` writes ``areal_stop_request`` into the run folder; the trainer reads it
at its phase boundaries and in its batch wait (:func:`stop_requested`), checkpoints the last trained step and stops
(:func:`stop_on_request`), so that the same command with ``trainer.resume_mode=auto`` goes on from there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from areal_plugins.driver.async_checkpoint import checkpoint_before_stopping
from areal_plugins.records.control_files import STOP_REQUEST_FILE, RunStoppedOnRequestError
from areal_plugins.records.writer import record_exists


def stop_requested(recorder: Any) -> bool:
    """Whether the CLI asked this run to stop (never, for a run that records nothing)."""
    return recorder.run_dir is not None and record_exists(STOP_REQUEST_FILE, recorder.run_dir)


def stop_on_request(trainer_config: Any, done: int, save_checkpoint_of: Callable[[int], None]) -> NoReturn:
    """Checkpoint finished step ``done`` (if the recipe checkpoints: ``trainer.save_freq``), then stop the run."""
    saved = checkpoint_before_stopping(trainer_config, done, save_checkpoint_of)
    raise RunStoppedOnRequestError(
        f"areal: stopped on request (Ctrl-C or SIGTERM) after step {done}{saved}; "
        "the same command with trainer.resume_mode=auto resumes"
    )
