"""The admission loop's bookkeeping against an in-memory key-value store shaped like TransferQueue.

The integration tests run it against verl's real TransferQueue; here the point is the accounting:
submitted = accepted + rejected + running at every poll, capacity respected, rejections free slots.
"""

from __future__ import annotations

import pytest
import torch

from areal_plugins.core.buffer import OldestFirstBuffer
from areal_plugins.core.staleness import StalenessController
from areal_plugins.core.trajectory_rows import MissingRolloutFieldError
from areal_plugins.driver.admission import AdmissionLoop, RolloutsFailingError
from areal_plugins.hooks.hookimpl import hookimpl
from areal_plugins.plugin_manager import call_hook
from areal_plugins.testing import InMemoryTransferQueue, plugin_registered
from tests.unit.conftest import wait_until


def accept_by_hook(trajectory) -> bool:
    return call_hook("areal_accept_trajectory", trajectory=trajectory) is not False


def make_loop(store: InMemoryTransferQueue, eta: int = 1, batch: int = 2):
    submitted: list[str] = []

    def submit(n: int) -> int:
        for _ in range(n):
            uid = f"p{len(submitted)}"
            submitted.append(uid)
            store.add_prompt(uid)
        return n

    controller = StalenessController(max_staleness=eta, batch_size=batch, max_concurrent=100)
    loop = AdmissionLoop(controller, OldestFirstBuffer(eta), submit, accept_by_hook, poll_interval=0.01, store=store)
    return loop, submitted


def check_accounting(loop: AdmissionLoop, submitted: list[str]) -> None:
    c = loop.staleness_controller
    assert len(submitted) == c.accepted + c.rejected + c.running


def test_admits_eta_plus_one_batches_then_waits_for_a_version():
    store = InMemoryTransferQueue()
    loop, submitted = make_loop(store, eta=1, batch=2)
    loop.poll_once()
    assert submitted == ["p0", "p1", "p2", "p3"]  # (η + 0 + 1) * B = 4 groups at version 0
    store.finish("p0", [1.0, 0.0], [[0, 0], [0]])
    loop.poll_once()
    assert len(submitted) == 4  # accepted + running still 4: no room until the version moves
    check_accounting(loop, submitted)
    loop.resume(version=1)
    loop.poll_once()
    assert len(submitted) == 6  # (1 + 1 + 1) * 2 - 4
    check_accounting(loop, submitted)
    taken, _ = loop.buffer.take(1, trainer_version=1)
    assert taken[0].group_id == "p0" and taken[0].head_versions == [0, 0]
    assert [info["reward"] for info in taken[0].info] == [1.0, 0.0]


class RejectWrongAnswers:
    @staticmethod
    @hookimpl
    def areal_accept_trajectory(trajectory):
        return trajectory.reward > 0.5


def test_rejected_and_failed_groups_free_their_slots():
    store = InMemoryTransferQueue()
    loop, submitted = make_loop(store, eta=0, batch=2)
    with plugin_registered(RejectWrongAnswers()):
        loop.poll_once()
        assert submitted == ["p0", "p1"]
        store.finish("p0", [0.0, 0.0], [[0], [0]])  # both members rejected: the group goes
        store.finish("p1", [], [], status="failure")  # the agent loop failed
        loop.poll_once()
    assert loop.staleness_controller.rejected == 2 and loop.staleness_controller.accepted == 0
    assert loop.rejected_trajectories == 2 and loop.failed_groups == 1
    assert submitted == ["p0", "p1", "p2", "p3"]  # both slots refilled at the same version
    assert "p0" not in store.tags and "p0_0_0" not in store.tags  # nothing left behind in the store
    check_accounting(loop, submitted)


def test_partly_rejected_group_keeps_its_other_members():
    store = InMemoryTransferQueue()
    loop, _ = make_loop(store, eta=0, batch=1)
    with plugin_registered(RejectWrongAnswers()):
        loop.poll_once()
        store.finish("p0", [1.0, 0.0, 1.0], [[0, 0], [0], [0, 1]])
        loop.poll_once()
    taken, _ = loop.buffer.take(1, trainer_version=0)
    assert taken[0].keys == ["p0_0_0", "p0_2_0"]
    assert [info["tail_version"] for info in taken[0].info] == [0, 1]
    assert loop.staleness_controller.accepted == 1 and loop.rejected_trajectories == 1


def test_paused_loop_collects_but_does_not_submit():
    store = InMemoryTransferQueue()
    loop, submitted = make_loop(store, eta=0, batch=1)
    loop.poll_once()
    store.finish("p0", [1.0], [[0]])
    loop.resume(version=1)  # capacity (0 + 1 + 1) * 1 - 1 = 1: there is room for one group...
    loop.pause()  # ...but a weight update is under way
    loop.poll_once()
    assert len(loop.buffer) == 1  # the finished group was still collected
    assert submitted == ["p0"]  # and nothing was submitted
    loop.resume(version=1)
    loop.poll_once()
    assert submitted == ["p0", "p1"]


def test_a_suspended_loop_does_not_look_at_the_store_until_resumed():
    import time

    store = InMemoryTransferQueue()
    looks = []
    listing = store.kv_list
    store.kv_list = lambda partition_id: looks.append(1) or listing(partition_id)  # type: ignore[method-assign]
    loop, submitted = make_loop(store, eta=0, batch=1)
    loop.start()
    try:
        wait_until(lambda: looks and submitted == ["p0"], what="the first poll")
        loop.suspend_polling()  # colocated engines asleep: nothing can finish
        with loop.quiesce():  # a poll already under way ends
            before = len(looks)
        store.finish("p0", [1.0], [[0]])
        time.sleep(0.2)  # 20 poll intervals: time to look, had it not been suspended
        assert len(looks) == before and len(loop.buffer) == 0
        loop.resume(version=1)
        wait_until(lambda: len(loop.buffer) == 1 and submitted == ["p0", "p1"], what="collecting after resume")
        assert len(looks) > before
    finally:
        loop.stop()


def test_a_trajectory_without_behaviour_logprobs_stops_the_loop_instead_of_inventing_them():
    store = InMemoryTransferQueue()
    loop, _ = make_loop(store, eta=0, batch=1)
    loop.poll_once()
    store.finish("p0", [1.0], [[0, 0]])
    del store.rows["p0_0_0"]["rollout_log_probs"]
    with pytest.raises(MissingRolloutFieldError, match="calculate_log_probs"):
        loop.poll_once()
    assert len(loop.buffer) == 0


def test_tensor_rows_reads_every_layout_transfer_queue_may_hand_out():
    from areal_plugins.core.trajectory_rows import tensor_rows

    rows = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    assert tensor_rows(torch.nested.as_nested_tensor(rows, layout=torch.jagged)) == [[1, 2, 3], [4], [5, 6]]
    assert tensor_rows(torch.nested.nested_tensor(rows)) == [[1, 2, 3], [4], [5, 6]]  # strided: no offsets
    assert tensor_rows(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert tensor_rows(torch.tensor([7.0, 8.0])) == [[7.0], [8.0]]  # one value per row


def test_masked_response_tokens_are_not_the_trajectorys_and_the_reward_is_the_rows_sum():
    store = InMemoryTransferQueue()
    loop, _ = make_loop(store, eta=0, batch=1)
    seen = []
    loop.accept = lambda trajectory: seen.append(trajectory) or True
    loop.poll_once()
    store.finish("p0", [1.0], [[0, 0, 0]])
    store.rows["p0_0_0"]["responses"] = torch.tensor([11, 12, 13])
    store.rows["p0_0_0"]["response_mask"] = torch.tensor([1, 0, 1])  # a tool's output inside the response
    store.rows["p0_0_0"]["rollout_log_probs"] = torch.tensor([-0.25, -9.0, -0.5])
    store.rows["p0_0_0"]["rm_scores"] = torch.tensor([0.0, 0.5, 0.25])
    loop.poll_once()
    (trajectory,) = seen
    assert trajectory.prompt_ids == [1, 2, 3] and trajectory.response_ids == [11, 13]
    assert trajectory.behav_logprobs == [-0.25, -0.5] and trajectory.reward == 0.75


def test_a_trajectory_without_per_token_versions_is_refused():
    store = InMemoryTransferQueue()
    loop, _ = make_loop(store, eta=0, batch=1)
    loop.poll_once()
    store.finish("p0", [1.0], [[0, 0]])
    store.rows["p0_0_0"]["extra_fields"] = {}
    with pytest.raises(MissingRolloutFieldError, match="2 response tokens carries 0 token versions"):
        loop.poll_once()


def test_failed_groups_in_a_row_stop_the_loop_instead_of_resubmitting_forever():
    store = InMemoryTransferQueue()
    loop, submitted = make_loop(store, eta=0, batch=2)
    loop.failure_limit = 3
    loop.poll_once()
    progress = loop.last_progress
    store.finish("p0", [], [], status="failure")
    store.finish("p1", [1.0], [[0]])  # one success resets the count
    loop.poll_once()
    store.finish("p2", [], [], status="failure")  # p2, p3: refills of the freed slots
    loop.poll_once()
    assert loop.last_progress > progress  # p1 finished
    progress = loop.last_progress
    store.finish("p3", [], [], status="failure")
    loop.poll_once()
    assert loop.last_progress == progress  # failures are not progress (the watchdog keeps counting)
    failing = submitted[-1]
    store.finish(failing, [], [], status="failure")
    with pytest.raises(RolloutsFailingError, match="3 rollout groups in a row failed"):
        loop.poll_once()


def test_failures_a_resumed_run_finds_in_its_checkpoint_are_reissued_without_stopping_it():
    """A checkpoint taken after groups failed on an engine that then died keeps their "failure" tags. On resume the
    first look finds them all at once: they are re-issued, and do not count as the new engines failing."""
    store = InMemoryTransferQueue()
    inherited = [f"old{i}" for i in range(4)]
    for uid in inherited:  # restored from the checkpoint, as verl's TransferQueue load leaves them
        store.add_prompt(uid)
        store.finish(uid, [], [], status="failure")
    loop, _, reissued = make_reissuing_loop(store, eta=0, batch=2)
    loop.failure_limit = 3
    loop.poll_once()
    assert sorted(reissued[0]) == inherited and loop.failed_groups == 4
    for uid in ["old0", "old1", "old2"]:  # failing again now counts
        store.finish(uid, [], [], status="failure")
    with pytest.raises(RolloutsFailingError, match="3 rollout groups in a row failed"):
        loop.poll_once()


def make_reissuing_loop(store: InMemoryTransferQueue, eta: int = 0, batch: int = 2):
    loop, submitted = make_loop(store, eta=eta, batch=batch)
    reissued: list[list[str]] = []

    def reissue(uids: list[str]) -> None:  # what verl's agent loop does with a re-sent prompt
        reissued.append(list(uids))
        for uid in uids:
            store.add_prompt(uid)

    loop.reissue = reissue
    return loop, submitted, reissued


def test_a_failed_group_is_reissued_with_its_prompt_kept_not_rejected():
    store = InMemoryTransferQueue()
    loop, submitted, reissued = make_reissuing_loop(store, eta=0, batch=2)
    loop.poll_once()
    store.finish("p0", [1.0], [[0]])
    store.finish("p1", [1.0], [[0]], status="failure")  # one member came back, the group failed
    loop.poll_once()
    assert reissued == [["p1"]]
    assert "p1" in store.tags and "p1_0_0" not in store.tags  # prompt kept for a checkpoint; partial member gone
    c = loop.staleness_controller
    assert (c.accepted, c.rejected, c.running) == (1, 0, 1)  # its slot stays taken: still owed work
    assert submitted == ["p0", "p1"]  # no fresh prompt drawn in its place
    store.finish("p1", [0.0, 1.0], [[0], [0]])
    loop.poll_once()
    assert (c.accepted, c.rejected, c.running) == (2, 0, 0)
    assert loop.failed_groups == 1 and loop.reissued_groups == 1
    check_accounting(loop, submitted)


def test_a_group_that_keeps_failing_is_rejected_after_its_attempts():
    store = InMemoryTransferQueue()
    loop, submitted, reissued = make_reissuing_loop(store, eta=0, batch=1)
    loop.attempts_per_group = 2
    loop.poll_once()
    store.finish("p0", [], [], status="failure")
    loop.poll_once()
    assert reissued == [["p0"]] and loop.staleness_controller.rejected == 0
    store.finish("p0", [], [], status="failure")  # second attempt fails too: given up
    loop.poll_once()
    assert reissued == [["p0"]]
    assert loop.staleness_controller.rejected == 1 and "p0" not in store.tags
    assert submitted == ["p0", "p1"]  # the slot went to a new prompt
    check_accounting(loop, submitted)


def test_reissuing_into_a_dead_engine_still_stops_the_loop():
    store = InMemoryTransferQueue()
    loop, submitted, reissued = make_reissuing_loop(store, eta=0, batch=2)
    loop.failure_limit = 4
    loop.poll_once()
    with pytest.raises(RolloutsFailingError, match="4 rollout groups in a row failed"):
        for _ in range(10):
            for uid in submitted:
                store.finish(uid, [], [], status="failure")
            loop.poll_once()
    assert len(reissued) == 1 and submitted == ["p0", "p1"]  # one round of re-issues, then the stop


def test_a_group_past_eta_at_consumption_is_generated_again_not_trained_or_dropped():
    store = InMemoryTransferQueue()
    loop, submitted, reissued = make_reissuing_loop(store, eta=1, batch=1)
    loop.buffer = OldestFirstBuffer(max_staleness=1, on_stale="reissue")
    loop.poll_once()  # (η + 0 + 1) * 1 = 2 groups: p0, p1
    store.finish("p0", [1.0, 0.0], [[0, 0], [0, 1, 2]])  # head version 0
    loop.poll_once()
    taken, stale = loop.buffer.take(1, trainer_version=2, timeout=0.1)  # 2 - 0 > η = 1
    assert taken == [] and [g.group_id for g in stale] == ["p0"]
    loop.reissue_stale(stale)
    c = loop.staleness_controller
    assert (c.accepted, c.rejected, c.running) == (0, 0, 2)  # back in flight, same slot, nothing rejected
    assert reissued == [["p0"]] and "p0" in store.tags and "p0_0_0" not in store.tags
    store.finish("p0", [1.0], [[2, 2]])  # generated again under version 2
    loop.poll_once()  # settled again (not skipped as already handled)
    taken, stale = loop.buffer.take(1, trainer_version=2, timeout=0.1)
    assert [g.group_id for g in taken] == ["p0"] and taken[0].head_versions == [2] and stale == []
    assert loop.reissued_stale_groups == 1
    check_accounting(loop, submitted)


def test_startup_is_refused_unless_verl_fetches_prompts_one_at_a_time():
    """Admission submits any count; verl 0.9.1 fetches in gen_batch_size chunks and forces 1 outside sync mode."""
    from omegaconf import OmegaConf

    from areal_plugins.driver.admission import require_single_prompt_fetches

    require_single_prompt_fetches(OmegaConf.create({"gen_batch_size": 1}))
    for fetch in (None, 16):
        with pytest.raises(RuntimeError, match=rf"data.gen_batch_size={fetch}.*not supported"):
            require_single_prompt_fetches(OmegaConf.create({"gen_batch_size": fetch}))


def test_each_trajectorys_schedule_keeps_the_requests_that_produced_kept_tokens():
    """``chunks`` as the record a replay follows: a request whose tokens verl cut off (it started past the kept
    response) is not part of the trajectory; values TransferQueue hands back as numpy scalars are written as ints;
    the digests tell two token sequences apart and repeat for the same one."""
    import numpy as np

    from areal_plugins.core.trajectory import Trajectory
    from areal_plugins.core.trajectory_rows import schedule_fields

    chunks = [[np.int64(0), np.int64(0), np.int64(7)], [np.int64(2), np.int64(1), None], [4, 2, 9]]
    trajectory = Trajectory([1, 2], [10, 11, 12, 13], [-1.0] * 4, [0, 0, 1, 1], extra={"areal_chunks": chunks})
    fields = schedule_fields(trajectory)
    assert fields["chunks"] == [[0, 0, 7], [2, 1, None]]
    assert all(type(value) is int for chunk in fields["chunks"] for value in chunk if value is not None)
    same = Trajectory([1, 2], [10, 11, 12, 13], [-2.0] * 4, [0, 0, 0, 0])
    other = Trajectory([1, 2], [10, 11, 12, 14], [-1.0] * 4, [0, 0, 0, 0])
    assert schedule_fields(same)["response_digest"] == fields["response_digest"]
    assert schedule_fields(other)["response_digest"] != fields["response_digest"]
    assert schedule_fields(same)["chunks"] == []  # a trajectory from a client that records none
    assert len(fields["prompt_digest"]) == 16 and fields["prompt_digest"] != fields["response_digest"]


class CountingStore(InMemoryTransferQueue):
    """Counts whole listings of the partition."""

    def __init__(self) -> None:
        super().__init__()
        self.listed = 0

    def kv_list(self, partition_id: str):
        self.listed += 1
        return super().kv_list(partition_id)


def test_with_reports_a_poll_reads_only_the_reported_groups_and_a_listing_finds_an_unreported_one():
    store = CountingStore()
    reports: list[tuple[str, list[str]]] = []

    def drain():
        drained = list(reports)
        reports.clear()
        return drained

    loop, submitted = make_loop(store, eta=0, batch=3)
    loop.settled_reports, loop.reconcile_s = drain, 3600.0
    loop.poll_once()  # the first poll lists (a resumed run's groups settled before its checkpoint are found)
    assert submitted == ["p0", "p1", "p2"] and store.listed == 1
    store.finish("p0", [1.0, 0.0], [[0, 0], [0]])
    store.finish("p1", [0.5], [[0]])
    reports.append(("p0", ["p0_0_0", "p0_1_0"]))  # p1's worker died before its report
    loop.poll_once()
    assert store.listed == 1  # no listing: p0 was read by its keys
    assert len(loop.buffer) == 1 and loop.staleness_controller.accepted == 1
    loop.poll_once()  # nothing reported: nothing read
    assert store.listed == 1 and len(loop.buffer) == 1
    loop.reports.next_listing = 0.0  # the reconciliation is due
    loop.poll_once()
    assert store.listed == 2 and len(loop.buffer) == 2  # p1 found by the listing
    taken, _ = loop.buffer.take(2, trainer_version=0)
    assert [g.group_id for g in taken] == ["p0", "p1"] and [g.keys for g in taken] == [["p0_0_0", "p0_1_0"], ["p1_0_0"]]
    reports.append(("p1", ["p1_0_0"]))  # its late report: already settled, not counted twice
    loop.poll_once()
    assert loop.staleness_controller.accepted == 2 and store.listed == 2
    check_accounting(loop, submitted)


def test_a_reported_key_that_is_gone_makes_the_poll_list_the_partition():
    store = CountingStore()
    reports = [("p0", ["p0_0_0", "p0_9_0"])]  # p0_9_0 was never written

    loop, _ = make_loop(store, eta=0, batch=1)
    loop.poll_once()
    loop.settled_reports, loop.reconcile_s = lambda: [reports.pop()] if reports else [], 3600.0
    store.finish("p0", [1.0], [[0]])
    loop.poll_once()
    assert store.listed == 2 and len(loop.buffer) == 1  # listed instead, and p0 settled with the key it has


def test_a_token_digest_is_the_sha256_of_the_ids_as_little_endian_64_bit_integers():
    import hashlib
    import struct

    from areal_plugins.core.trajectory_rows import token_digest

    expected = hashlib.sha256(struct.pack("<3q", 1, 2, 300000)).hexdigest()[:16]  # packed by hand
    assert token_digest([1, 2, 300000]) == expected
    assert token_digest([]) == hashlib.sha256(b"").hexdigest()[:16]


class RowCountingStore(CountingStore):
    """Counts listings and reads of trajectory rows."""

    def __init__(self) -> None:
        super().__init__()
        self.rows_read = 0

    def kv_batch_get(self, keys, partition_id, select_fields):
        self.rows_read += len(keys)
        return super().kv_batch_get(keys, partition_id, select_fields)


def reported_summary(response_tokens: int, reward: float) -> dict:
    return {"head_version": 0, "tail_version": 0, "num_interrupts": 0, "response_tokens": response_tokens,
            "reward": reward, "by": "the worker"}  # fmt: skip


def test_with_no_accept_hook_a_reported_group_is_settled_from_its_summaries_without_reading_a_row():
    store = RowCountingStore()
    reports: list = []
    loop, submitted = make_loop(store, eta=0, batch=2)
    loop.accept = None  # what the default rollout manager passes when no plugin implements the hook
    loop.settled_reports = lambda: [reports.pop(0) for _ in range(len(reports))]
    loop.reconcile_s = 3600.0
    loop.poll_once()
    store.finish("p0", [1.0, 0.0], [[0, 0], [0]])
    store.finish("p1", [0.5], [[0]])
    reports.append(("p0", ["p0_0_0", "p0_1_0"], [reported_summary(2, 1.0), reported_summary(1, 0.0)]))
    reports.append(("p1", ["p1_0_0"], None))  # its worker could not summarize it: rows are read
    loop.poll_once()
    assert store.rows_read == 1  # p1's one trajectory; none of p0's
    assert (loop.settled_from_reports, loop.settled_from_rows) == (1, 1)
    taken, _ = loop.buffer.take(2, trainer_version=0, timeout=0.1)
    by_uid = {group.group_id: group for group in taken}
    assert [info["by"] for info in by_uid["p0"].info] == ["the worker", "the worker"]
    assert by_uid["p0"].keys == ["p0_0_0", "p0_1_0"] and by_uid["p0"].head_versions == [0, 0]
    assert by_uid["p1"].info[0]["response_tokens"] == 1 and "by" not in by_uid["p1"].info[0]  # read from its row
    check_accounting(loop, submitted)


def test_with_an_accept_hook_the_rows_are_read_even_when_summaries_came():
    store = RowCountingStore()
    reports = [("p0", ["p0_0_0"], [reported_summary(2, 1.0)])]
    loop, _ = make_loop(store, eta=0, batch=1)  # accept_by_hook: the hook must see each trajectory
    loop.poll_once()
    loop.settled_reports, loop.reconcile_s = lambda: [reports.pop()] if reports else [], 3600.0
    store.finish("p0", [1.0], [[0, 0]])
    loop.poll_once()
    assert store.rows_read == 1 and loop.settled_from_rows == 1 and loop.settled_from_reports == 0


def test_a_late_report_of_a_failed_attempt_found_by_a_listing_does_not_settle_the_reissued_one():
    store = RowCountingStore()
    reports: list = []
    reissued: list[str] = []
    loop, submitted = make_loop(store, eta=0, batch=1)
    loop.accept = None
    loop.reissue = lambda uids: (reissued.extend(uids), [store.add_prompt(uid) for uid in uids])
    loop.settled_reports = lambda: [reports.pop(0) for _ in range(len(reports))]
    loop.poll_once()
    store.finish("p0", [], [], status="failure")  # attempt 1 failed; its report is late
    loop.reports.next_listing = 0.0
    loop.poll_once()  # the listing finds the failure and re-issues p0
    assert reissued == ["p0"]
    store.finish("p0", [1.0], [[0]])  # attempt 2 finished (key p0_0_0) ...
    reports.append(("p0", [], None))  # ... and attempt 1's report arrives only now, then attempt 2's
    loop.poll_once()
    assert len(loop.buffer) == 0  # attempt 1's report settled nothing
    reports.append(("p0", ["p0_0_0"], [reported_summary(1, 1.0)]))
    loop.poll_once()
    taken, _ = loop.buffer.take(1, trainer_version=0, timeout=0.1)
    assert [group.keys for group in taken] == [["p0_0_0"]] and reissued == ["p0"]
    group = taken[0]
    assert group.keys == ["p0_0_0"] and group.info[0]["by"] == "the worker"
    check_accounting(loop, submitted)


def test_a_workers_summary_is_what_the_admission_loop_would_read_back_from_the_rows_verl_writes():
    """The summary a worker reports is :func:`trajectory_info` of the trajectory the loop would read from
    TransferQueue: reward and log-probs as float32, masked tokens left out (values derived by hand below)."""
    import hashlib
    import struct

    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from areal_plugins.core.trajectory_rows import (
        CHUNKS_FIELD,
        ROUTED_EXPERTS_FIELD,
        group_trajectories,
        output_summary,
        trajectory_info,
    )
    from areal_plugins.driver.admission import TRAJECTORY_FIELDS

    extra = {"token_versions": [0, 1, 1], "num_interrupts": 1, CHUNKS_FIELD: [[0, 0, 7], [1, 1, 8]],
             "reward_extra_info": {"areal_reward_latency_s": 0.5, "acc": 1.0},
             ROUTED_EXPERTS_FIELD: [6, "0123456789abcdef"]}  # fmt: skip
    output = AgentLoopOutput(
        prompt_ids=[5, 6, 7], response_ids=[11, 12, 13, 14], response_mask=[1, 1, 0, 1],
        response_logprobs=[-0.1, -0.2, 0.0, -0.3], reward_score=0.1, metrics=AgentLoopMetrics(), extra_fields=extra,
    )  # fmt: skip
    summary = output_summary("u", output)
    written = output.as_dict()  # the row verl's agent loop puts into TransferQueue
    store = InMemoryTransferQueue()
    store.rows["u_0_0"] = {name: written[name] for name in TRAJECTORY_FIELDS}
    (read_back,) = group_trajectories(store.kv_batch_get(["u_0_0"], "train", TRAJECTORY_FIELDS), "u")
    assert summary == trajectory_info(read_back)
    float32 = struct.unpack("<f", struct.pack("<f", 0.1))[0]
    assert summary["reward"] == float32 != 0.1
    assert summary["response_tokens"] == 3 and summary["head_version"] == 0 and summary["tail_version"] == 1
    assert summary["response_digest"] == hashlib.sha256(struct.pack("<3q", 11, 12, 14)).hexdigest()[:16]
    assert summary["logprobs_digest"] == hashlib.sha256(struct.pack("<3f", -0.1, -0.2, -0.3)).hexdigest()[:16]
    assert summary["chunks"] == [[0, 0, 7], [1, 1, 8]] and summary["num_interrupts"] == 1
    assert summary["reward_report"] == {"areal_reward_latency_s": 0.5}
    assert summary["prompt_tokens"] == 3
    assert (summary["routed_experts_rows"], summary["routed_experts_digest"]) == (6, "0123456789abcdef")
    # What the loop must name itself (it reads the rows and raises): no summary.
    assert output_summary("u", output.model_copy(update={"response_logprobs": None})) is None
    assert output_summary("u", output.model_copy(update={"extra_fields": {"token_versions": [0]}})) is None


def test_the_default_rollout_manager_asks_about_trajectories_only_when_a_plugin_answers():
    from areal_plugins.plugin_manager import hook_implemented

    assert not hook_implemented("areal_accept_trajectory")  # none of the built-in plugins does
    with plugin_registered(RejectWrongAnswers()):
        assert hook_implemented("areal_accept_trajectory")
    assert not hook_implemented("areal_accept_trajectory")
