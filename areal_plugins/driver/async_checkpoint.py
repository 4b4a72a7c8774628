"""The async trainer's part of a checkpoint: ``areal_state.json`` beside verl's files, and the resume from it.

verl's checkpoint holds the weights, the dataloader position and TransferQueue (the accepted groups and the
prompts in flight). Ours holds the counters a resume restores, and the output so far of the requests in flight
(agent_loop/partial_outputs.py); the admission counts restart as
``accepted = v·B`` plus the restored groups, counted as running and settled once each (docs/design.md,
Admission).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transfer_queue as tq

from areal_plugins.records.writer import RunRecorder

logger = logging.getLogger(__name__)

#: Our part of a checkpoint, next to verl's files in ``global_step_N/``.
ASYNC_STATE_FILE = "areal_state.json"
#: Its key for the staleness controller's counts; files written before 0.1.0 have them under ``"controller"``.
STALENESS_CONTROLLER_KEY = "staleness_controller"


@dataclass
class DrawCounts:
    """What the trainer counted of the run so far: restored on resume, so the records continue."""

    consumed_groups: int = 0
    #: prompt batches drawn from the dataloader (``areal_submissions.jsonl`` lines)
    submissions: int = 0


def checkpoint_folder(trainer_config: Any, step: int) -> str:
    """The folder verl saves step ``step`` to (always under ``default_local_dir``)."""
    return os.path.join(trainer_config.default_local_dir, f"global_step_{step}")


def resume_folder(trainer_config: Any, version: int) -> str:
    """The folder verl resumed ``version`` from: ``resume_from_path`` under ``resume_mode: resume_path``."""
    if trainer_config.resume_mode == "resume_path" and trainer_config.resume_from_path:
        return str(trainer_config.resume_from_path)
    return checkpoint_folder(trainer_config, version)


def save_async_state(
    folder: str, version: int, counts: DrawCounts, staleness_controller: Any, partials: dict[str, int] | None = None
) -> None:
    """Write ``areal_state.json`` into verl's checkpoint folder (called while admission is quiesced);
    ``partials``: how many requests in flight, and tokens, the checkpoint kept (``areal_partials/``)."""
    state = {
        "version": version,
        "consumed_groups": counts.consumed_groups,
        "submissions": counts.submissions,
        STALENESS_CONTROLLER_KEY: staleness_controller.state_dict(),
        "partials": partials or {"requests": 0, "tokens": 0},
    }
    with open(os.path.join(folder, ASYNC_STATE_FILE), "w") as handle:
        json.dump(state, handle)


def restore_async_state(folder: str, version: int, staleness_controller: Any, recorder: RunRecorder) -> DrawCounts:
    """Counters after a resume at ``version``: accepted = v·B, then the restored groups, counted as running.

    verl restored TransferQueue (finished groups) and re-issued the prompts that were in flight; the
    admission loop settles each exactly once and the staleness bound holds from the first new submission.
    """
    path = os.path.join(folder, ASYNC_STATE_FILE)
    if not os.path.exists(path):
        raise RuntimeError(
            f"resuming an areal_async run at step {version} needs {path}, which this checkpoint lacks "
            "(it was written by another trainer mode); resume it with that mode or set trainer.resume_mode=disable"
        )
    with open(path) as handle:
        saved = json.load(handle)
    if "controller" in saved and STALENESS_CONTROLLER_KEY not in saved:  # written before 0.1.0: the old key
        saved[STALENESS_CONTROLLER_KEY] = saved.pop("controller")
    if saved["version"] != version:
        raise RuntimeError(f"{path} is for version {saved['version']}, the weights are version {version}")
    listing = (tq.kv_list(partition_id="train") or {}).get("train", {})
    restored = sorted(uid for uid, tag in listing.items() if tag.get("is_prompt", False))
    staleness_controller.recover(version)
    if restored:
        staleness_controller.on_submit(len(restored))
    recorder.write("areal_restored.jsonl", {"version": version, "uids": restored, "saved": saved})
    logger.info(
        "areal_async: resumed at version %d with %d restored prompt groups (finished or re-issued)",
        version,
        len(restored),
    )
    return DrawCounts(consumed_groups=saved["consumed_groups"], submissions=saved["submissions"])


def checkpoint_before_stopping(trainer_config: Any, done: int, save_step: Callable[[int], None]) -> str:
    """Checkpoint finished step ``done`` before a requested stop, unless checkpoints are off or it is saved;
    return what was done, for the stop message."""
    latest = Path(trainer_config.default_local_dir) / "latest_checkpointed_iteration.txt"
    if latest.exists() and latest.read_text().strip() == str(done):
        return f"; step {done} was already checkpointed"
    if trainer_config.save_freq > 0 and done > 0:
        save_step(done)
        return f"; a checkpoint of step {done} was saved"
    return ""
