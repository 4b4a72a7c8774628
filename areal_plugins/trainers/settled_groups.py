"""Which prompt groups have settled since the admission loop last looked: reported by the agent-loop workers.

Listing TransferQueue's whole partition on every poll costs time in proportion to everything held in it (prompts and
trajectories of every group in flight or buffered): at the paper's scale, 43k entries, 113 ms of CPU per poll
(docs/results/control_plane.md). Instead each worker reports a group once verl has written its final status, with
the trajectory keys it wrote, to one Ray actor; the admission loop drains the reports and reads the tags of just those
keys. A poll then costs in proportion to what settled since the last one. The loop still lists the whole partition
now and then (``AdmissionLoop.reconcile_s``), so a report that never came (a worker that died between its status and
its report, or a run resumed with groups settled before the checkpoint) delays a group, never loses it.
"""

from __future__ import annotations

import time
from typing import Any

INBOX_NAME = "areal_settled_groups"
#: Seconds between a worker's looks for the inbox while it has none.
LOOKUP_AGAIN_S = 5.0
#: Longest wait for the inbox's answer: an inbox on a lost node stops the admission loop instead of hanging it.
DRAIN_TIMEOUT_S = 60.0

_found: dict[str, Any] = {}


class SettledGroupsInbox:
    """Ray actor: reports of settled groups, ``(uid, trajectory keys)``, in arrival order until drained."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, list[str]]] = []

    def report(self, uid: str, keys: list[str]) -> None:
        self.reports.append((uid, keys))

    def drain(self) -> list[tuple[str, list[str]]]:
        reports, self.reports = self.reports, []
        return reports


def start_inbox() -> Any:
    """The run's inbox (created once, in verl's driver, before the first prompt is submitted)."""
    import ray

    actor = ray.remote(SettledGroupsInbox).options(name=INBOX_NAME, num_cpus=0, get_if_exists=True)
    return actor.remote()


def drain_reports(inbox: Any) -> list[tuple[str, list[str]]]:
    """What the admission loop calls on each poll."""
    import ray

    return ray.get(inbox.drain.remote(), timeout=DRAIN_TIMEOUT_S)


async def report_settled(uid: str, keys: list[str]) -> None:
    """A worker's report that group ``uid`` has its final status in TransferQueue, with ``keys`` written for it.

    Without the inbox (a rollout manager that does not drain one, or a resume, where verl re-issues the groups in
    flight before the trainer builds its manager) there is no one to tell: the admission loop's listing finds the
    group instead. The worker looks again at most every :data:`LOOKUP_AGAIN_S`, so an inbox started later is found."""
    import ray

    found = _found.get("inbox")
    if found is None and time.monotonic() >= _found.get("next_lookup", 0.0):
        try:
            found = _found["inbox"] = ray.get_actor(INBOX_NAME)
        except ValueError:
            _found["next_lookup"] = time.monotonic() + LOOKUP_AGAIN_S
    if found is not None:
        await found.report.remote(uid, keys)


def read_tags(store: Any, partition_id: str, keys: list[str]) -> dict[str, dict[str, Any]] | None:
    """The tags of ``keys`` in TransferQueue, read by key (not by listing); None when one of them is gone.

    ``store`` is TransferQueue's module or a stand-in with ``kv_tags`` (testing/memory_transfer_queue.py)."""
    if hasattr(store, "kv_tags"):
        return store.kv_tags(keys=keys, partition_id=partition_id)
    meta = store.get_client().kv_retrieve_meta(keys=keys, partition_id=partition_id)
    found = list(meta.custom_meta)
    if len(found) != len(keys):  # TransferQueue leaves out keys it does not hold: the caller lists instead
        return None
    return dict(zip(keys, found, strict=True))
