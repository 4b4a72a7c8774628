"""Staleness-bounded admission of rollouts, running beside verl's trainer loop (docs/design.md, Admission).

A thread in verl's driver process. Every ``poll_interval`` seconds it reads the rollout state in
verl's TransferQueue, turns every newly finished group into :class:`Trajectory` objects, asks the
``areal_accept_trajectory`` hook about each (with no such hook it reads no rows: the worker that wrote them
reported what the record needs), moves kept groups into the :class:`SampleBuffer`,
frees the slots of rejected ones, re-issues failed ones (their prompt is work still owed, not a
rejection: a checkpoint taken meanwhile keeps it), and submits as many new prompts as
``StalenessController.capacity(version)`` allows. It never blocks the trainer: the trainer only
waits on the buffer.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from areal_plugins._moved import renamed_keywords
from areal_plugins.actors.settled_groups import SettledReport, read_tags
from areal_plugins.core.buffer import BufferedGroup
from areal_plugins.core.staleness import StalenessController
from areal_plugins.core.trajectory import Trajectory
from areal_plugins.core.trajectory_rows import group_trajectories, trajectory_info
from areal_plugins.hooks.contracts import SampleBuffer

logger = logging.getLogger(__name__)

PARTITION = "train"
#: Trajectory fields read from TransferQueue to build the objects the accept hook sees.
TRAJECTORY_FIELDS = ["prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores", "extra_fields"]


class RolloutsFailingError(RuntimeError):
    """Every recent rollout group failed: the engines or agent-loop workers are broken, not one request."""


class SettledReports:
    """Which groups settled since the last poll: their workers' reports (actors/settled_groups.py), reconciled with a
    listing of the whole partition every ``reconcile_s`` seconds, so a group whose report never came (its worker
    died between its status and its report) is found by the next listing.

    Args:
        drain: returns the groups reported settled since the last call, ``(uid, trajectory keys, their summaries or
            None)``; None lists the whole partition on every poll.
        reconcile_s: seconds between two listings of the whole partition, with ``drain``.
    """

    def __init__(self, drain: Callable[[], list[SettledReport]] | None, reconcile_s: float) -> None:
        self.drain = drain
        self.reconcile_s = reconcile_s
        self.next_listing = 0.0  # monotonic time of the next whole listing: the first poll lists
        self.listings = 0  # whole listings of the partition
        self.summaries: dict[str, dict[str, Any]] = {}  # this poll's reported summaries, by trajectory key
        self._reported: set[str] = set()  # uids whose report this poll drained
        self._owed: set[str] = set()  # settled before their report came: that report is stale

    def read(self, store: Any, handled: set[str]) -> dict[str, dict[str, Any]]:
        """Tags by key: of the groups reported settled since the last poll, or of the whole partition (no reports,
        a listing due, or a reported key gone). Reports are drained before the listing: a group reported before
        the drain has its final status in TransferQueue already, so the listing cannot miss it. ``handled``: the
        groups settled already, whose reports are passed over."""
        reports = self.drain() if self.drain is not None else None
        self.summaries, self._reported = {}, set()
        keys: list[str] = []
        for uid, written, *summaries in reports or ():
            if uid in self._owed:  # the report of an attempt settled (and maybe re-issued) without it
                self._owed.discard(uid)
                continue
            if uid in handled:
                continue
            self._reported.add(uid)
            keys.extend((uid, *written))
            if summaries and summaries[0] is not None:
                self.summaries.update(zip(written, summaries[0], strict=True))
        if reports is not None and time.monotonic() < self.next_listing:
            if not keys:
                return {}
            tags = read_tags(store, PARTITION, keys)
            if tags is not None:
                return tags
        self.next_listing = time.monotonic() + self.reconcile_s
        self.listings += 1
        return (store.kv_list(partition_id=PARTITION) or {}).get(PARTITION, {})

    def settled(self, uid: str) -> None:
        """``uid`` is settled now: if a listing found it, its report, when it comes, is spent."""
        if self.drain is not None and uid not in self._reported:
            self._owed.add(uid)


class AdmissionLoop:
    """Keeps the rollout engines fed within the staleness bound, and the buffer filled.

    Args:
        staleness_controller: the staleness bound's counts (units: prompt groups); ``controller=``, its name before
            0.1.0, is still taken, with a ``DeprecationWarning``.
        buffer: where accepted groups wait for the trainer.
        submit: submits ``n`` new prompts for generation (verl's ``_add_prompts_to_generate``).
        accept: False drops a finished trajectory (the ``areal_accept_trajectory`` hooks); None keeps every one,
            and a group whose worker reported its trajectories' summaries is then settled without reading its rows.
        poll_interval: seconds between looks at TransferQueue.
        store: TransferQueue's module (``kv_list``, ``kv_batch_get``, ``kv_clear``).
        failure_limit: this many failed groups in a row, none finished since, stop the loop with
            :class:`RolloutsFailingError` (resubmitting into a dead engine would spin forever).
        reissue: sends failed prompt groups (by uid) for generation again; None settles a failed group
            as rejected at once (its prompt is then lost to the run).
        attempts_per_group: a group that failed this many times is rejected for good (a prompt that
            always breaks the agent loop must not hold its slot forever).
        settled_reports: returns the groups reported settled since the last call, ``(uid, trajectory keys,
            their summaries or None)`` (actors/settled_groups.py); a poll then reads only their tags. None lists
            the whole partition on every poll.
        reconcile_s: with ``settled_reports``, seconds between two listings of the whole partition (a group whose
            report never came is found by the next one).
    """

    @renamed_keywords(controller="staleness_controller")
    def __init__(
        self,
        staleness_controller: StalenessController,
        buffer: SampleBuffer,
        submit: Callable[[int], int],
        accept: Callable[[Trajectory], bool] | None,
        poll_interval: float,
        store: Any,
        failure_limit: int = 32,
        reissue: Callable[[list[str]], None] | None = None,
        attempts_per_group: int = 3,
        settled_reports: Callable[[], list[SettledReport]] | None = None,
        reconcile_s: float = 30.0,
    ) -> None:
        self.staleness_controller = staleness_controller
        self.buffer = buffer
        self.submit = submit
        self.accept = accept
        self.poll_interval = poll_interval
        self.store = store
        self.version = 0
        self.rejected_trajectories = 0
        self.failed_groups = 0
        self.reissued_groups = 0
        self.reissued_stale_groups = 0
        self.dropped_stale_groups = 0
        self.failure_limit = failure_limit
        self.reissue = reissue
        self.attempts_per_group = attempts_per_group
        self.reports = SettledReports(settled_reports, reconcile_s)
        self.polls = 0
        self.settled_from_reports = 0  # groups settled from their worker's summaries, rows not read
        self.settled_from_rows = 0  # groups whose rows were read (an accept hook, or no summaries)
        self._failed_attempts: dict[str, int] = {}
        self._failures_in_a_row = 0
        self._handled: set[str] = set()
        self._admitting = threading.Event()
        self._admitting.set()
        self._polling = threading.Event()  # cleared while the engines sleep: nothing can finish then
        self._polling.set()
        self._stop = threading.Event()
        self._poll_lock = threading.Lock()  # held for one poll: quiesce() waits for it
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()

    @property
    def settled_reports(self) -> Callable[[], list[SettledReport]] | None:
        """The drain of settled-group reports (:class:`SettledReports`); None: every poll lists the partition."""
        return self.reports.drain

    @settled_reports.setter
    def settled_reports(self, drain: Callable[[], list[SettledReport]] | None) -> None:
        self.reports.drain = drain

    @property
    def reconcile_s(self) -> float:
        """Seconds between two listings of the whole partition, with reports."""
        return self.reports.reconcile_s

    @reconcile_s.setter
    def reconcile_s(self, seconds: float) -> None:
        self.reports.reconcile_s = seconds

    @property
    def listings(self) -> int:
        """Of the polls, whole listings of the partition."""
        return self.reports.listings

    @property
    def controller(self) -> StalenessController:
        """Deprecated: :attr:`staleness_controller` (this name until 0.1.0), with a ``DeprecationWarning``."""
        _warn_controller_renamed()
        return self.staleness_controller

    @controller.setter
    def controller(self, staleness_controller: StalenessController) -> None:
        _warn_controller_renamed()
        self.staleness_controller = staleness_controller

    # ------------------------------------------------------------------ control (trainer thread)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="areal-admission", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def pause(self) -> None:
        """Stop submitting (a weight update is under way); finished groups are still collected."""
        self._admitting.clear()

    def resume(self, version: int) -> None:
        self.version = version
        self._admitting.set()
        self._polling.set()

    def suspend_polling(self) -> None:
        """Stop looking at TransferQueue until :meth:`resume` (colocated engines asleep while the trainer trains).

        Each look costs CPU; on shared devices that work would be taken from training. Groups that finish
        meanwhile are collected by the first poll after the resume.
        """
        self.pause()
        self._polling.clear()

    @contextmanager
    def quiesce(self) -> Iterator[None]:
        """Hold the loop between two polls: nothing is drawn, submitted or settled inside the block.

        A checkpoint is taken inside it, so the dataloader position, TransferQueue and our counters
        describe the same moment (a prompt drawn but not yet registered would be lost or doubled).
        """
        with self._poll_lock:
            yield

    def reissue_stale(self, groups: list[BufferedGroup]) -> None:
        """Generate accepted groups again that are past η at consumption (``areal.on_stale: reissue``).

        Their trajectories go; their prompts stay registered and are sent again, so they come back
        generated under the current weights and are settled like any group.
        """
        if self.reissue is None:
            raise RuntimeError("areal.on_stale=reissue needs a rollout manager given reissue_prompts")
        with self._poll_lock:
            keys = [key for group in groups for key in group.keys]
            if keys:
                self.store.kv_clear(keys=keys, partition_id=PARTITION)
            uids = [group.group_id for group in groups]
            self.staleness_controller.on_requeue_accepted(len(uids))
            self.reissue(uids)
            self._handled.difference_update(uids)
            self.reissued_stale_groups += len(uids)

    def drop_stale(self, groups: list[BufferedGroup]) -> None:
        """Reject accepted groups that are past η at consumption (``areal.on_stale: drop``): their prompt and
        trajectories leave TransferQueue and their slots are freed, counted in ``dropped_stale_groups``."""
        with self._poll_lock:
            # First: the controller refuses to drop more groups than were accepted.
            self.staleness_controller.on_drop_accepted(len(groups))
            keys = [key for group in groups for key in (group.group_id, *group.keys)]
            if keys:
                self.store.kv_clear(keys=keys, partition_id=PARTITION)
            self.dropped_stale_groups += len(groups)

    def check_alive(self) -> None:
        """Raise the admission thread's error in the trainer thread, where verl reports it."""
        if self.error is not None:
            raise RuntimeError(f"the areal admission loop failed: {self.error!r}") from self.error

    # ------------------------------------------------------------------ the loop (admission thread)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._polling.is_set():
                    self._polling.wait(self.poll_interval)
                    continue
                self.poll_once()
                self._stop.wait(self.poll_interval)
        except BaseException as error:  # surfaced to the trainer by check_alive()
            logger.exception("areal admission loop failed")
            self.error = error

    def poll_once(self) -> None:
        with self._poll_lock:
            self.polls += 1
            self._poll_locked()

    def _poll_locked(self) -> None:
        listing = self.reports.read(self.store, self._handled)
        trajectory_keys: dict[str, list[str]] = {}
        for key in listing:
            if not listing[key].get("is_prompt", False):
                trajectory_keys.setdefault(key.split("_")[0], []).append(key)
        to_reissue: list[str] = []
        for uid, tag in listing.items():
            if not tag.get("is_prompt", False) or uid in self._handled:
                continue
            if tag.get("status") in ("finished", "failure"):
                self._handled.add(uid)
                self.reports.settled(uid)
                keys = sorted(trajectory_keys.get(uid, []))
                inherited = self.polls == 1  # the first look: groups that ended before this start (a resume)
                settled = self._settle(uid, tag["status"], keys, [listing[k] for k in keys], inherited)
                if settled == "progress":
                    self.last_progress = time.monotonic()  # a failed group is not progress
                elif settled == "reissue":
                    to_reissue.append(uid)
        if to_reissue:
            assert self.reissue is not None
            self.reissue(to_reissue)
            self.reissued_groups += len(to_reissue)
            self._handled.difference_update(to_reissue)  # settled again when the new attempt ends
        if self._admitting.is_set():
            room = self.staleness_controller.capacity(self.version)
            if room > 0:
                self.staleness_controller.on_submit(room)
                try:
                    self.submit(room)
                except BaseException:
                    self.staleness_controller.on_reject(room)
                    raise

    def _settle(
        self, uid: str, status: str, keys: list[str], tags: list[dict[str, Any]], inherited: bool = False
    ) -> str:
        """Account for one finished group: "progress", or for a failed one "reissue" or "rejected".

        ``inherited``: the group ended before this start (a checkpoint keeps a group that failed after the last
        poll, e.g. on an engine that then died); its failure says nothing of the engines running now."""
        if status == "failure" or not keys:
            self.failed_groups += 1
            self._failures_in_a_row += 0 if inherited else 1
            attempts = self._failed_attempts[uid] = self._failed_attempts.get(uid, 0) + 1
            if self._failures_in_a_row >= self.failure_limit:
                raise RolloutsFailingError(
                    f"{self._failures_in_a_row} rollout groups in a row failed and none finished since: the rollout "
                    "engines or verl's agent-loop workers are failing (train.log has their error; a rollout server "
                    "that died is the usual cause). Stopping instead of resubmitting; fix the cause and resume from "
                    "the last checkpoint (trainer.resume_mode=auto)"
                )
            if self.reissue is not None and attempts < self.attempts_per_group:
                # The prompt stays registered (a checkpoint keeps it); its partial members go, as verl's
                # own re-issue on resume does.
                logger.warning("rollout group %s failed (attempt %d); re-issuing its prompt", uid, attempts)
                if keys:
                    self.store.kv_clear(keys=keys, partition_id=PARTITION)
                return "reissue"
            logger.warning("rollout group %s failed %d time(s); its prompt is dropped, its slot freed", uid, attempts)
            self.store.kv_clear(keys=[uid, *keys], partition_id=PARTITION)
            self._failed_attempts.pop(uid, None)
            self.staleness_controller.on_reject()
            return "rejected"
        self._failures_in_a_row = 0
        self._failed_attempts.pop(uid, None)
        summaries = [self.reports.summaries.get(key) for key in keys]
        dropped: list[str]
        if self.accept is None and all(summary is not None for summary in summaries):
            self.settled_from_reports += 1
            kept_keys, kept_tags, dropped = keys, tags, []
            info = [summary for summary in summaries if summary is not None]
        else:
            self.settled_from_rows += 1
            data = self.store.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=TRAJECTORY_FIELDS)
            kept_keys, kept_tags, dropped, info = [], [], [], []
            for key, tag, trajectory in zip(keys, tags, group_trajectories(data, uid), strict=True):
                if self.accept is not None and not self.accept(trajectory):
                    dropped.append(key)
                    continue
                kept_keys.append(key)
                kept_tags.append(tag)
                info.append(trajectory_info(trajectory))
        self.rejected_trajectories += len(dropped)
        if dropped:
            self.store.kv_clear(keys=dropped, partition_id=PARTITION)
        if not kept_keys:
            self.store.kv_clear(keys=[uid], partition_id=PARTITION)
            self.staleness_controller.on_reject()
            return "progress"
        self.staleness_controller.on_accept()
        heads = [item["head_version"] for item in info]
        self.buffer.put(BufferedGroup(group_id=uid, head_versions=heads, keys=kept_keys, tags=kept_tags, info=info))
        return "progress"


def _warn_controller_renamed() -> None:
    warnings.warn(
        "AdmissionLoop.controller is deprecated: use AdmissionLoop.staleness_controller; the old name will be removed "
        "in a later release",
        DeprecationWarning,
        stacklevel=3,  # the line that read or set it: here <- the property <- that line
    )


def require_single_prompt_fetches(data_config: Any) -> None:
    """Refuse to start unless verl fetches prompts one at a time (``data.gen_batch_size == 1``).

    The admission loop submits whatever room the staleness bound leaves (any count); verl 0.9.1 fetches
    prompts in ``gen_batch_size`` chunks and raises on a count that is not a multiple. Its
    ``_init_dataloader`` forces 1 outside sync mode; a verl that stopped doing so would fail mid-run.
    """
    fetch = data_config.get("gen_batch_size", None)
    if fetch != 1:
        raise RuntimeError(
            f"areal_async submits prompts one at a time, but verl set data.gen_batch_size={fetch} "
            "(verl 0.9.1 forces 1 outside its sync mode): this verl version is not supported by areal_async"
        )
