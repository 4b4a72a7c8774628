"""The driver's half of the requests kept across a checkpoint (agent_loop/partial_outputs.py is the workers' half).

At a checkpoint the driver asks every agent-loop worker to write its kept outputs (:func:`save_partials`); at the
start of ``fit`` it checks that the checkpoint folder is shared by every node and, on a resume, tells each worker
which checkpoint to continue from (:func:`prepare_workers`); after the first step it asks what they continued
(:func:`end_resumes`). Nothing of the outputs passes through the driver: only counts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from areal_plugins.agent_loop.partial_outputs import PARTIALS_DIR, SHARED_MARKER_PREFIX, node_name

logger = logging.getLogger(__name__)


def total(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Answers and tokens of several workers' (or files') counts, added up."""
    counts = list(counts)
    return {key: sum(count[key] for count in counts) for key in ("requests", "tokens")}


def save_partials(folder: str, workers: list[Any]) -> dict[str, int]:
    """Every agent-loop worker writes its kept outputs into ``folder``; how many answers and tokens in all."""
    import ray

    counts = ray.get([worker.areal_save_partials.remote(folder, index) for index, worker in enumerate(workers)])
    return total(counts)


def write_shared_marker(checkpoints: str | Path) -> Path:
    """The driver's marker in the checkpoint folder, named for this start (a folder copied between nodes by hand
    holds an earlier start's, not this one)."""
    folder = Path(checkpoints)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"{SHARED_MARKER_PREFIX}{os.getpid()}_{os.urandom(4).hex()}"
    marker.write_text(f"{node_name()}\n")
    return marker


def storage_report(checkpoints: str, driver_node: str, reports: list[dict[str, Any]]) -> tuple[bool, dict, str]:
    """Whether the checkpoint folder is shared by every node, from each agent-loop worker's look for the driver's
    marker: ``(shared, record, log line)``."""
    seen = sorted({r["node"] for r in reports if r["sees_marker"]})
    unseen = sorted({r["node"] for r in reports if not r["sees_marker"]} - set(seen))
    shared = not unseen
    record = {"folder": checkpoints, "shared": shared, "driver_node": driver_node, "nodes_seeing": seen}
    record["nodes_not_seeing"] = unseen
    if shared:
        line = (
            f"areal: the checkpoint folder {checkpoints} is shared by every node the agent-loop workers run on "
            f"({len(seen)}): a resume continues the requests in flight at its checkpoint"
        )
    else:
        line = (
            f"areal: the checkpoint folder {checkpoints} is NOT shared: the agent-loop workers on node(s) "
            f"{', '.join(node[:12] for node in unseen)} do not see the file the driver wrote there. A resume "
            "(--max-restarts, trainer.resume_mode=auto) regenerates the requests in flight that a worker on "
            "another node kept, and verl needs its own checkpoint files on the driver's node; put "
            "trainer.default_local_dir on storage every node mounts (NFS, a mounted bucket)"
        )
    return shared, record, line


def resumed_counts(reports: list[dict[str, Any]]) -> dict[str, int]:
    """What the resumed checkpoint kept, as the workers found it: each worker file once, whoever saw it."""
    files: dict[str, dict[str, int]] = {}
    for report in reports:
        files.update(report["files"])
    return total(files.values())


#: The record of the startup's storage check (the run directory): whether the checkpoint folder is shared.
STORAGE_RECORD = "checkpoint_storage.jsonl"


def prepare_workers(
    checkpoints: str, resume_from: str | None, workers: list[Any], recorder: Any, checkpointing: bool
) -> dict[str, int] | None:
    """At the start of ``fit`` (before verl re-issues the prompts in flight): with checkpoints on, find out whether
    the checkpoint folder is shared by every node (:func:`storage_report`: logged once and recorded), and on a
    resume from ``resume_from`` tell every agent-loop worker to continue the kept outputs it can see. Returns what
    the resumed checkpoint kept (None: no resume)."""
    import time

    import ray

    if not checkpointing and resume_from is None:
        return None
    marker = write_shared_marker(checkpoints) if checkpointing else None
    try:
        shown = None if marker is None else str(marker)
        reports = ray.get([worker.areal_prepare_resume.remote(shown, resume_from) for worker in workers])
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
    if marker is not None:
        shared, record, line = storage_report(checkpoints, node_name(), reports)
        recorder.write(STORAGE_RECORD, {"time": time.time(), **record})
        (logger.info if shared else logger.warning)(line)
    if resume_from is None:
        return None
    saved = resumed_counts(reports)
    logger.info(
        "areal: answers in flight at the checkpoint continue from their kept output (%d requests, %d tokens; %s)",
        saved["requests"],
        saved["tokens"],
        Path(resume_from) / PARTIALS_DIR,
    )
    return saved


def end_resumes(workers: list[Any]) -> dict[str, int]:
    """After the first step: every agent-loop worker drops its view of the kept outputs; what they continued."""
    import ray

    counts = ray.get([worker.areal_end_resume.remote() for worker in workers])
    return total(counts)
