"""Which prompt groups have settled since the admission loop last looked: reported by the agent-loop workers.

Listing TransferQueue's whole partition on every poll costs time in proportion to everything held in it (prompts and
trajectories of every group in flight or buffered): at the paper's scale, 43k entries, 113 ms of CPU per poll
(docs/results/control_plane.md). Instead each worker reports a group once verl has written its final status, with
the trajectory keys it wrote, to one Ray actor; the admission loop drains the reports and reads the tags of just those
keys. A poll then costs in proportion to what settled since the last one. The loop still lists the whole partition
now and then (``AdmissionLoop.reconcile_s``), so a report that never came (a worker that died between its status and
its report, or a run resumed with groups settled before the checkpoint) delays a group, never loses it.

A report also carries, per trajectory, what the admission loop records of it (``admission.trajectory_info``:
versions, request chunks, token and log-prob digests, reward), computed by the worker from the output it wrote. With
no ``areal_accept_trajectory`` hook to ask, the admission loop then reads no trajectory rows at all: the driver's
work per group does not grow with its tokens (docs/results/control_plane.md).
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

#: ``(uid, trajectory keys, one summary per key or None)``: a group settled, as its worker reports it.
SettledReport = tuple[str, list[str], list[dict[str, Any]] | None]


class SettledGroupsInbox:
    """Ray actor: reports of settled groups (:data:`SettledReport`), in arrival order until drained."""

    def __init__(self) -> None:
        self.reports: list[SettledReport] = []

    def report(self, uid: str, keys: list[str], summaries: list[dict[str, Any]] | None = None) -> None:
        self.reports.append((uid, keys, summaries))

    def drain(self) -> list[SettledReport]:
        reports, self.reports = self.reports, []
        return reports


def start_inbox() -> Any:
    """The run's inbox (created once, in verl's driver, before the first prompt is submitted)."""
    import ray

    actor = ray.remote(SettledGroupsInbox).options(name=INBOX_NAME, num_cpus=0, get_if_exists=True)
    return actor.remote()


def drain_reports(inbox: Any) -> list[SettledReport]:
    """What the admission loop calls on each poll."""
    import ray

    return ray.get(inbox.drain.remote(), timeout=DRAIN_TIMEOUT_S)


async def report_settled(uid: str, keys: list[str], summaries: list[dict[str, Any]] | None = None) -> None:
    """A worker's report that group ``uid`` has its final status in TransferQueue, with ``keys`` written for it
    and, when every one of them could be summarized, their ``summaries``.

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
        await found.report.remote(uid, keys, summaries)


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
