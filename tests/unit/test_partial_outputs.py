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
    RESUMED_NAME,
    PartialOutput,
    ResumedPartials,
    forget_group,
    snapshot_in_flight,
    start_resumed,
    write_partials,
)
from areal_plugins.core.trajectory_rows import token_digest


@ray.remote
class ScriptedServer:
    """One scripted answer per call: ``(tokens, version, stop, seconds to wait first)``."""

    def __init__(self, script: list[tuple]) -> None:
        self.script = list(script)
        self.calls: list[tuple[list[int], int]] = []

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append((list(prompt_ids), sampling_params["max_tokens"]))
        ids, version, stop, wait_s = self.script.pop(0)
        await asyncio.sleep(wait_s)
        return TokenOutput(
            token_ids=ids,
            log_probs=[-0.25 * (i + 1) for i in range(len(ids))],
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
        seen = snapshot_in_flight()
        output = await task
        finished = snapshot_in_flight()
        forget_group("g1")  # the worker, once verl wrote the group's final status
        return seen, output, finished, snapshot_in_flight()

    (saved,), output, (finished,), after = asyncio.run(go())
    assert (saved["uid"], saved["session"], saved["prompt_digest"]) == ("g1", 2, token_digest([1, 2]))
    assert saved["tokens"] == [11, 12, 13] and saved["versions"] == [0, 0, 0]
    assert saved["log_probs"] == [-0.25, -0.5, -0.75]
    assert saved["chunks"] == [[0, 0, 7]] and saved["interrupts"] == 1 and saved["stop_reason"] is None
    assert output.token_ids == [11, 12, 13, 14, 15, 16, 17, 18]
    # Finished, but its group has not settled: kept, whole, with its stop reason (verl re-issues the whole group).
    assert finished["tokens"] == output.token_ids and finished["stop_reason"] == "length"
    assert finished["versions"] == [0, 0, 0, 1, 1, 1, 1, 1] and finished["chunks"] == [[0, 0, 7], [3, 1, 7]]
    assert after == []


def test_a_resumed_request_continues_its_saved_output_and_another_answer_starts_afresh(local_ray, tmp_path):
    saved = {
        "uid": "g1",
        "session": 2,
        "prompt_digest": token_digest([1, 2]),
        "tokens": [11, 12, 13],
        "log_probs": [-0.25, -0.5, -0.75],
        "versions": [0, 0, 0],
        "chunks": [[0, 0, 7]],
        "interrupts": 1,
    }
    write_partials(str(tmp_path), 0, [saved])
    actor = start_resumed(str(tmp_path))
    partial_outputs._resumed.clear()  # a fresh worker process: it looks the actor up once
    server = ScriptedServer.remote([([21, 22, 23, 24, 25], 2, "length", 0.0), ([31, 32], 2, "stop", 0.0)])
    client = client_of(server)

    async def go():
        continued = await answer(client, "g1", 2, [1, 2], "r1")
        fresh = await answer(client, "g1", 0, [1, 2], "r2")  # another answer of the group: nothing saved for it
        return continued, fresh

    try:
        continued, fresh = asyncio.run(go())
        counts = ray.get(actor.counts.remote())
    finally:
        ray.kill(actor)
        partial_outputs._resumed.clear()
        forget_group("g1")
    # The engine was asked for the rest only: prompt + the 3 saved tokens, 8 - 3 = 5 more.
    assert ray.get(server.seen.remote()) == [([1, 2, 11, 12, 13], 5), ([1, 2], 8)]
    assert continued.token_ids == [11, 12, 13, 21, 22, 23, 24, 25]
    assert continued.extra_fields["token_versions"] == [0, 0, 0, 2, 2, 2, 2, 2]
    assert continued.log_probs[:3] == [-0.25, -0.5, -0.75]
    assert continued.extra_fields["num_interrupts"] == 2  # the update's cut, then the resume's
    assert continued.extra_fields["areal_chunks"] == [[0, 0, 7], [3, 2, 7]]
    assert fresh.token_ids == [31, 32] and fresh.extra_fields["num_interrupts"] == 0
    assert counts == {"saved": {"requests": 1, "tokens": 3}, "continued": {"requests": 1, "tokens": 3}}


def test_an_answer_that_had_finished_is_returned_as_it_was_without_asking_the_engine(local_ray, tmp_path):
    saved = {
        "uid": "g2",
        "session": 0,
        "prompt_digest": token_digest([4]),
        "tokens": [41, 42],
        "log_probs": [-1.0, -2.0],
        "versions": [0, 1],
        "chunks": [[0, 0, 3], [1, 1, 4]],
        "interrupts": 1,
        "stop_reason": "stop",
    }
    write_partials(str(tmp_path), 0, [saved])
    actor = start_resumed(str(tmp_path))
    partial_outputs._resumed.clear()
    server = ScriptedServer.remote([])  # any call would fail: nothing scripted
    try:
        output = asyncio.run(answer(client_of(server), "g2", 0, [4], "r1"))
    finally:
        ray.kill(actor)
        partial_outputs._resumed.clear()
        forget_group("g2")
    assert ray.get(server.seen.remote()) == []
    assert (output.token_ids, output.log_probs, output.stop_reason) == ([41, 42], [-1.0, -2.0], "stop")
    assert output.extra_fields["token_versions"] == [0, 1] and output.extra_fields["num_interrupts"] == 1
    assert output.extra_fields["areal_chunks"] == [[0, 0, 3], [1, 1, 4]]


def test_a_run_without_checkpoints_keeps_nothing(local_ray):
    server = ScriptedServer.remote([([11, 12], 0, "stop", 0.0)])
    output = asyncio.run(answer(client_of(server, save_freq=-1), "g9", 0, [1], "r1"))
    assert output.token_ids == [11, 12] and snapshot_in_flight() == [] and "g9" not in IN_FLIGHT


def test_a_saved_output_is_taken_once_and_only_for_the_prompt_it_was_generated_for():
    digest = token_digest([5])
    resumed = ResumedPartials(
        [
            {"uid": "a", "session": 0, "prompt_digest": digest, "tokens": [1]},
            {"uid": "b", "session": 1, "prompt_digest": digest, "tokens": [2, 3]},
        ]
    )
    assert resumed.take("a", 0, "another turn's prompt") is None  # a later turn: generated anew, and dropped
    assert resumed.take("a", 0, digest) is None
    assert resumed.take("b", 1, digest)["tokens"] == [2, 3]
    assert resumed.take("b", 1, digest) == {"empty": True}  # none left: the clients stop asking
    assert resumed.counts() == {"saved": {"requests": 2, "tokens": 3}, "continued": {"requests": 1, "tokens": 2}}


def test_no_saved_outputs_no_actor(tmp_path):
    assert start_resumed(str(tmp_path)) is None
    assert RESUMED_NAME == "areal_resumed_partials"


def test_outputs_kept_by_checkpoints_verl_rotated_away_are_removed_and_the_kept_ones_stay(tmp_path):
    # verl's rotation (max_actor_ckpt_to_keep) deleted step 1's actor/ folder and left the rest of the step.
    for step, has_actor in ((1, False), (2, True), (3, True)):
        folder = tmp_path / f"global_step_{step}"
        partial_outputs.write_partials(str(folder), 0, [{"tokens": [1, 2]}])
        if has_actor:
            (folder / "actor").mkdir()
    assert partial_outputs.remove_rotated_partials(tmp_path) == 1
    assert not (tmp_path / "global_step_1" / "areal_partials").exists() and (tmp_path / "global_step_1").exists()
    assert partial_outputs.read_partials(tmp_path / "global_step_2") == [{"tokens": [1, 2]}]
    assert partial_outputs.read_partials(tmp_path / "global_step_3") == [{"tokens": [1, 2]}]
