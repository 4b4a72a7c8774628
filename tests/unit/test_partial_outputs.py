"""Requests in flight kept across a checkpoint: what the client keeps, what a checkpoint saves, how a resumed request
continues it. Real Ray, verl's load balancer and our client; the server is a stand-in with scripted answers."""

from __future__ import annotations

import asyncio

import ray
from omegaconf import OmegaConf

from areal_plugins.agent_loop import partial_outputs
from areal_plugins.agent_loop.episodes import CURRENT_EPISODE, EpisodeRecord
from areal_plugins.agent_loop.partial_outputs import (
    IN_FLIGHT,
    KeptOutputs,
    PartialOutput,
    end_resume,
    forget_group,
    prepare_resume,
    snapshot_in_flight,
    write_partials,
)
from areal_plugins.core.trajectory_rows import token_digest
from areal_plugins.driver import kept_outputs
from areal_plugins.driver.kept_outputs import prepare_workers, resumed_counts, storage_report, write_shared_marker


@ray.remote
class ScriptedServer:
    """One scripted answer per call: ``(tokens, version, stop, seconds to wait first)``."""

    def __init__(self, script: list[tuple], routed: bool = False) -> None:
        self.script = list(script)
        self.calls: list[tuple[list[int], int]] = []
        self.routed = routed

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        import numpy as np
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append((list(prompt_ids), sampling_params["max_tokens"]))
        ids, version, stop, wait_s = self.script.pop(0)
        await asyncio.sleep(wait_s)
        # Router replay, as vLLM returns it: a row per position fed through the model (prompt + tokens - 1), here
        # 100 x version + position in the first of 1 layer's 2 slots, so a row's origin shows, and 1000 more in the
        # second (a top-k router names k distinct experts; the client refuses a row that repeats one).
        rows = len(prompt_ids) + len(ids) - 1
        routed = (100 * version + np.arange(rows))[:, None, None] + np.array([0, 1000], np.int32)[None, None, :]
        return TokenOutput(
            token_ids=ids,
            log_probs=[-0.25 * (i + 1) for i in range(len(ids))],
            routed_experts=routed if self.routed else None,
            stop_reason=stop,
            extra_fields={"global_steps": version, "token_versions": [version] * len(ids), "areal_seed": 7},
        )

    def seen(self) -> list[tuple[list[int], int]]:
        return self.calls


def client_of(server, save_freq: int = 1):
    from verl.workers.rollout.router import get_router_handle

    from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient

    config = OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"name": "areal_cpu", "response_length": 8}},
            "trainer": {"save_freq": save_freq},
        }
    )
    return InterruptibleLLMClient(config, get_router_handle(servers={"s": server}))


async def answer(client, uid: str, session: int, prompt: list[int], request_id: str):
    CURRENT_EPISODE.set(EpisodeRecord(group_uid=uid, session=session))
    return await client.generate(request_id, prompt_ids=prompt, sampling_params={"max_tokens": 8})


def test_a_checkpoint_sees_an_answers_output_so_far_then_its_finished_output_until_the_group_settles(local_ray):
    # Three tokens under v0, cut by a weight update; the continuation is under way (0.5 s) when the checkpoint looks.
    server = ScriptedServer.remote([([11, 12, 13], 0, "aborted", 0.0), ([14, 15, 16, 17, 18], 1, "length", 0.5)])
    client = client_of(server)

    async def go():
        task = asyncio.create_task(answer(client, "g1", 2, [1, 2], "r1"))
        while len(IN_FLIGHT.get("g1", {}).get(2, PartialOutput("")).tokens) < 3:
            await asyncio.sleep(0.01)
        seen = await snapshot_in_flight()
        output = await task
        finished = await snapshot_in_flight()
        forget_group("g1")  # the worker, once verl wrote the group's final status
        return seen, output, finished, await snapshot_in_flight()

    (saved,), output, (finished,), after = asyncio.run(go())
    assert (saved["uid"], saved["session"], saved["prompt_digest"]) == ("g1", 2, token_digest([1, 2]))
    assert saved["tokens"] == [11, 12, 13] and saved["versions"] == [0, 0, 0]
    assert saved["log_probs"] == [-0.25, -0.5, -0.75]
    assert saved["chunks"] == [[0, 0, 7]] and saved["interrupts"] == 1 and saved["stop_reason"] is None
    assert output.token_ids == [11, 12, 13, 14, 15, 16, 17, 18]
    # Finished, but its group has not settled: kept, whole, with its stop reason (verl re-issues the whole group).
    assert list(finished["tokens"]) == output.token_ids and finished["stop_reason"] == "length"
    assert list(finished["versions"]) == [0, 0, 0, 1, 1, 1, 1, 1] and finished["chunks"] == [[0, 0, 7], [3, 1, 7]]
    assert after == []


def saved_answer(uid: str, session: int, prompt: list[int], tokens: list[int], **fields) -> dict:
    return {
        "uid": uid,
        "session": session,
        "prompt_digest": token_digest(prompt),
        "tokens": tokens,
        "log_probs": [-0.25 * (i + 1) for i in range(len(tokens))],
        "versions": [0] * len(tokens),
        "chunks": [[0, 0, 7]],
        "interrupts": 1,
        "stop_reason": None,
    } | fields


def test_a_resumed_request_continues_its_saved_output_and_another_answer_starts_afresh(local_ray, tmp_path):
    write_partials(str(tmp_path), 0, [saved_answer("g1", 2, [1, 2], [11, 12, 13])])
    report = prepare_resume(None, str(tmp_path))  # this worker, told at startup which checkpoint was resumed
    server = ScriptedServer.remote([([21, 22, 23, 24, 25], 2, "length", 0.0), ([31, 32], 2, "stop", 0.0)])
    client = client_of(server)

    async def go():
        continued = await answer(client, "g1", 2, [1, 2], "r1")
        fresh = await answer(client, "g1", 0, [1, 2], "r2")  # another answer of the group: nothing saved for it
        return continued, fresh

    try:
        continued, fresh = asyncio.run(go())
    finally:
        counts = end_resume()
        forget_group("g1")
    # The engine was asked for the rest only: prompt + the 3 saved tokens, 8 - 3 = 5 more.
    assert ray.get(server.seen.remote()) == [([1, 2, 11, 12, 13], 5), ([1, 2], 8)]
    assert continued.token_ids == [11, 12, 13, 21, 22, 23, 24, 25]
    assert continued.extra_fields["token_versions"] == [0, 0, 0, 2, 2, 2, 2, 2]
    assert continued.log_probs[:3] == [-0.25, -0.5, -0.75]
    assert continued.extra_fields["num_interrupts"] == 2  # the update's cut, then the resume's
    assert continued.extra_fields["areal_chunks"] == [[0, 0, 7], [3, 2, 7]]
    assert fresh.token_ids == [31, 32] and fresh.extra_fields["num_interrupts"] == 0
    assert report["files"] == {"worker_0.jsonl": {"requests": 1, "tokens": 3}} and report["sees_marker"] is None
    assert counts == {"requests": 1, "tokens": 3}


def test_an_answer_that_had_finished_is_returned_as_it_was_without_asking_the_engine(local_ray, tmp_path):
    saved = saved_answer("g2", 0, [4], [41, 42], log_probs=[-1.0, -2.0], versions=[0, 1], stop_reason="stop")
    write_partials(str(tmp_path), 0, [saved | {"chunks": [[0, 0, 3], [1, 1, 4]]}])
    prepare_resume(None, str(tmp_path))
    server = ScriptedServer.remote([])  # any call would fail: nothing scripted
    try:
        output = asyncio.run(answer(client_of(server), "g2", 0, [4], "r1"))
    finally:
        end_resume()
        forget_group("g2")
    assert ray.get(server.seen.remote()) == []
    assert (output.token_ids, output.log_probs, output.stop_reason) == ([41, 42], [-1.0, -2.0], "stop")
    assert output.extra_fields["token_versions"] == [0, 1] and output.extra_fields["num_interrupts"] == 1
    assert output.extra_fields["areal_chunks"] == [[0, 0, 3], [1, 1, 4]]


def test_a_worker_whose_node_does_not_see_the_checkpoint_generates_anew(local_ray, tmp_path):
    write_partials(str(tmp_path / "on_another_node"), 0, [saved_answer("g3", 0, [5], [51])])
    report = prepare_resume(None, str(tmp_path / "as_seen_here"))  # the folder this node has: no areal_partials/
    server = ScriptedServer.remote([([61, 62], 1, "stop", 0.0)])
    try:
        output = asyncio.run(answer(client_of(server), "g3", 0, [5], "r1"))
    finally:
        end_resume()
        forget_group("g3")
    assert report["files"] == {} and output.token_ids == [61, 62]
    assert ray.get(server.seen.remote()) == [([5], 8)]


def test_a_run_without_checkpoints_keeps_nothing(local_ray):
    server = ScriptedServer.remote([([11, 12], 0, "stop", 0.0)])
    output = asyncio.run(answer(client_of(server, save_freq=-1), "g9", 0, [1], "r1"))
    assert output.token_ids == [11, 12] and asyncio.run(snapshot_in_flight()) == [] and "g9" not in IN_FLIGHT


def test_a_saved_output_is_taken_once_and_only_for_the_prompt_it_was_generated_for(tmp_path):
    write_partials(str(tmp_path), 0, [saved_answer("a", 0, [5], [1]), saved_answer("b", 1, [5], [2, 3])])
    kept = KeptOutputs(tmp_path)
    digest = token_digest([5])
    assert kept.take("a", 0, "another turn's prompt") is None  # a later turn: generated anew, and dropped
    assert kept.take("a", 0, digest) is None
    assert kept.take("b", 1, digest)["tokens"] == [2, 3]
    assert kept.take("b", 1, digest) is None and len(kept) == 0
    assert kept.continued == {"requests": 1, "tokens": 2}
    assert kept.files == {"worker_0.jsonl": {"requests": 2, "tokens": 3}}


def test_a_resume_reads_only_the_lines_of_the_answers_it_continues(tmp_path):
    # Before: one actor parsed every worker's file whole at startup (gigabytes at 41k requests x 2k tokens).
    write_partials(str(tmp_path), 0, [saved_answer("a", 0, [5], [1, 2]), saved_answer("b", 0, [5], [3, 4, 5])])
    write_partials(str(tmp_path), 1, [saved_answer("c", 0, [6], [7])])
    data = tmp_path / "areal_partials" / "worker_0.jsonl"
    first, second = data.read_bytes().splitlines(keepends=True)
    data.write_bytes(b"x" * (len(first) - 1) + b"\n" + second)  # answer a's line unreadable: nobody continues it
    kept = KeptOutputs(tmp_path)
    assert len(kept) == 3  # every answer indexed, none read
    assert kept.take("b", 0, token_digest([5]))["tokens"] == [3, 4, 5]
    assert kept.take("c", 0, token_digest([6]))["tokens"] == [7]
    assert kept.continued == {"requests": 2, "tokens": 4}


def test_a_checkpoint_written_before_the_indexes_is_read_a_line_at_a_time(tmp_path):
    write_partials(str(tmp_path), 0, [saved_answer("a", 0, [5], [1, 2]), saved_answer("b", 3, [5], [3])])
    (tmp_path / "areal_partials" / "worker_0.index").unlink()  # as an earlier version wrote it
    kept = KeptOutputs(tmp_path)
    assert kept.files == {"worker_0.jsonl": {"requests": 2, "tokens": 3}}
    assert kept.take("b", 3, token_digest([5]))["tokens"] == [3]
    assert kept.take("a", 0, token_digest([5]))["tokens"] == [1, 2]


def test_a_checkpoints_copy_lets_the_workers_requests_run_between_batches_and_shares_nothing():
    from array import array

    IN_FLIGHT.clear()
    for i in range(6):  # three batches of two
        partial = PartialOutput(f"d{i}", [i, i + 1], [-1.0, -2.0], [0, 0], [[0, 0, 1]])
        partial_outputs.keep(f"g{i}", 0, partial)
    partial_outputs.compact(IN_FLIGHT["g0"][0])  # a finished answer: packed arrays
    turns = []

    async def go():
        async def request_meanwhile():
            while True:
                turns.append(len(copied))
                await asyncio.sleep(0)

        copied: list = []
        other = asyncio.create_task(request_meanwhile())
        await asyncio.sleep(0)
        copied.extend(await snapshot_in_flight(batch=2))
        other.cancel()
        return copied

    try:
        copies = asyncio.run(go())
        IN_FLIGHT["g1"][0].tokens.append(99)  # the request goes on after the copy
        IN_FLIGHT["g0"][0].tokens[0] = 99
    finally:
        IN_FLIGHT.clear()
    assert len(copies) == 6 and len(turns) >= 3  # it ran before the copy and between its three batches
    assert copies[1]["tokens"] == [1, 2] and copies[0]["tokens"] == array("q", [0, 1])


def test_the_startup_says_whether_every_node_sees_the_checkpoint_folder():
    reports = [{"node": "n1", "sees_marker": True}, {"node": "n2", "sees_marker": True}]
    shared, record, line = storage_report("/ckpt", "n1", reports)
    assert shared and record["nodes_seeing"] == ["n1", "n2"] and record["nodes_not_seeing"] == []
    reports.append({"node": "n3", "sees_marker": False})
    shared, record, line = storage_report("/ckpt", "n1", reports)
    assert not shared and record["nodes_not_seeing"] == ["n3"] and record["shared"] is False
    assert "NOT shared" in line and "n3" in line and "--max-restarts" in line and "regenerates" in line


def test_each_workers_file_counts_once_however_many_workers_see_it():
    both = {"worker_0.jsonl": {"requests": 2, "tokens": 5}, "worker_1.jsonl": {"requests": 1, "tokens": 1}}
    reports = [{"files": both}, {"files": both}, {"files": {"worker_1.jsonl": {"requests": 1, "tokens": 1}}}]
    assert resumed_counts(reports) == {"requests": 3, "tokens": 6}


@ray.remote
class StandInWorker:
    """An agent-loop worker's two startup calls (episode_workers.py), in a process of its own."""

    def areal_prepare_resume(self, marker, folder):
        return prepare_resume(marker, folder)

    def areal_end_resume(self):
        return end_resume()


class Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def write(self, name: str, line: dict) -> None:
        self.lines.append((name, line))


def test_the_driver_checks_the_storage_and_tells_each_worker_what_to_continue(local_ray, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    resumed = checkpoints / "global_step_3"
    write_partials(str(resumed), 0, [saved_answer("a", 0, [5], [1, 2])])
    write_partials(str(resumed), 1, [saved_answer("b", 0, [5], [3])])
    workers, recorder = [StandInWorker.remote(), StandInWorker.remote()], Recorder()
    saved = prepare_workers(str(checkpoints), str(resumed), workers, recorder, checkpointing=True)
    assert saved == {"requests": 2, "tokens": 3}  # both workers see both files: each counted once
    ((name, record),) = recorder.lines
    assert name == "checkpoint_storage.jsonl" and record["shared"] and record["nodes_not_seeing"] == []
    assert not list(checkpoints.glob(".areal_shared_*"))  # the marker is removed
    assert kept_outputs.end_resumes(workers) == {"requests": 0, "tokens": 0}


def test_a_marker_is_seen_only_where_its_folder_is(tmp_path):
    marker = write_shared_marker(tmp_path / "checkpoints")
    try:
        assert prepare_resume(str(marker), None)["sees_marker"] is True
        assert prepare_resume(str(tmp_path / "elsewhere" / marker.name), None)["sees_marker"] is False
    finally:
        marker.unlink()


def test_outputs_kept_by_checkpoints_verl_rotated_away_are_removed_and_the_kept_ones_stay(tmp_path):
    # verl's rotation (max_actor_ckpt_to_keep) deleted step 1's actor/ folder and left the rest of the step.
    kept = saved_answer("a", 0, [5], [1, 2])
    for step, has_actor in ((1, False), (2, True), (3, True)):
        folder = tmp_path / f"global_step_{step}"
        partial_outputs.write_partials(str(folder), 0, [kept])
        if has_actor:
            (folder / "actor").mkdir()
    assert partial_outputs.remove_rotated_partials(tmp_path) == 1
    assert not (tmp_path / "global_step_1" / "areal_partials").exists() and (tmp_path / "global_step_1").exists()
    assert partial_outputs.read_partials(tmp_path / "global_step_2") == [kept]
    assert partial_outputs.read_partials(tmp_path / "global_step_3") == [kept]


def test_router_replays_experts_are_kept_by_a_checkpoint_and_continued_after_a_resume(local_ray, tmp_path):
    """Each position keeps the routing of the request that fed it: the kept rows travel through the checkpoint, and
    the resumed request adds its new tokens' rows only (by hand: row values are 100 x version + position)."""
    from areal_plugins.agent_loop.routed_experts import decode_experts

    script = [([11, 12, 13], 0, "aborted", 0.0), ([14, 15, 16, 17, 18], 1, "length", 0.5)]
    server = ScriptedServer.remote(script, routed=True)
    client = client_of(server)

    async def live():
        task = asyncio.create_task(answer(client, "g1", 2, [1, 2], "r1"))
        while len(IN_FLIGHT.get("g1", {}).get(2, PartialOutput("")).tokens) < 3:
            await asyncio.sleep(0.01)
        seen = await snapshot_in_flight()
        output = await task
        forget_group("g1")
        return seen, output

    (saved,), output = asyncio.run(live())
    # Prompt 2 + 3 tokens - 1 = 4 rows under version 0 at the checkpoint; the live answer then adds the 5 new
    # tokens' rows of the second request (positions 4-8 under version 1): 2 + 8 - 1 = 9 in all.
    assert decode_experts(saved["routed_experts"])[:, 0, 0].tolist() == [0, 1, 2, 3]
    assert output.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 3, 104, 105, 106, 107, 108]
    assert output.extra_fields["areal_routed_experts"][0] == 9

    # A resume from that checkpoint: the kept 4 rows, then the resumed request's 5 new ones under version 2.
    write_partials(str(tmp_path), 0, [saved])
    prepare_resume(None, str(tmp_path))
    server = ScriptedServer.remote([([21, 22, 23, 24, 25], 2, "length", 0.0)], routed=True)
    try:
        continued = asyncio.run(answer(client_of(server), "g1", 2, [1, 2], "r2"))
    finally:
        end_resume()
        forget_group("g1")
    assert continued.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 3, 204, 205, 206, 207, 208]
    assert continued.routed_experts.shape == (9, 1, 2)


def test_an_answer_that_had_finished_keeps_its_routed_experts_through_a_resume(local_ray, tmp_path):
    import numpy as np

    from areal_plugins.agent_loop.routed_experts import encode_experts

    routed = np.arange(6, dtype=np.int16).reshape(3, 1, 2)  # prompt 2 + 2 tokens - 1 rows
    saved = saved_answer("g2", 0, [4, 5], [41, 42], stop_reason="stop") | {"routed_experts": encode_experts(routed)}
    write_partials(str(tmp_path), 0, [saved])
    prepare_resume(None, str(tmp_path))
    try:
        output = asyncio.run(answer(client_of(ScriptedServer.remote([])), "g2", 0, [4, 5], "r1"))
    finally:
        end_resume()
        forget_group("g2")
    assert output.routed_experts.tolist() == routed.tolist()  # verl's batch needs every answer's, or none
    assert output.extra_fields["areal_routed_experts"][0] == 3
