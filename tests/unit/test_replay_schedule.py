"""A replay's parts without Ray or verl: the schedule read from a record, the conductor's versions and counts, the
buffer's recorded order and comparison, and the client following a recorded trajectory request by request."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from verl.workers.rollout.replica import TokenOutput

from areal_plugins.agent_loop.episodes import CURRENT_EPISODE, EpisodeRecord
from areal_plugins.core.buffer import BufferedGroup
from areal_plugins.core.trajectory_rows import REPLAY_OF
from areal_plugins.replay import agent_loop_side as replay_client
from areal_plugins.replay.conductor import ReplayConductor
from areal_plugins.replay.driver_side import ReplaySampleBuffer
from areal_plugins.replay.requests import ReplayError
from areal_plugins.replay.schedule import ReplaySchedule


def sample(step: int, group: str, key: str, prompt: str, chunks: list[list], tokens: int = 6, **extra) -> dict:
    return {
        "step": step,
        "group": group,
        "key": key,
        "prompt_digest": prompt,
        "response_digest": f"r-{key}",
        "logprobs_digest": f"l-{key}",
        "response_tokens": tokens,
        "chunks": chunks,
        "head_version": chunks[0][1],
        "tail_version": chunks[-1][1],
        "reward": 1.0,
        **extra,
    }


# Two answers per prompt. Step 1 trains g1 (both answers one request under v0) and g2 (one answer cut after 2
# tokens, continued under v1); step 2 trains g3, the prompt of g1 asked again.
RECORD = [
    sample(1, "g1", "a", "P", [[0, 0, 11]]),
    sample(1, "g1", "b", "P", [[0, 0, 12]]),
    sample(1, "g2", "c", "Q", [[0, 0, 13], [2, 1, 14]]),
    sample(1, "g2", "d", "Q", [[0, 0, 15]]),
    sample(2, "g3", "e", "P", [[0, 1, 16]]),
    sample(2, "g3", "f", "P", [[0, 1, 17], [5, 2, 18]]),
]


def write_record(run_dir: Path, samples: list[dict]) -> Path:
    run_dir.mkdir(exist_ok=True)
    (run_dir / "areal_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run_dir


def test_the_schedule_lists_each_steps_groups_and_hands_out_a_prompts_trajectories_in_step_order(tmp_path):
    schedule = ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), answers_per_prompt=2)
    assert [[g.group for g in step] for step in schedule.steps] == [["g1", "g2"], ["g3"]]
    # Requests per version, counted by hand from RECORD: v0 a, b, c, d; v1 c's second, e, f; v2 f's second.
    assert dict(schedule.chunks_per_version) == {0: 4, 1: 3, 2: 1}
    claimed = [schedule.claim("P") for _ in range(4)]
    assert [t.name for t in claimed] == ["g1/a", "g1/b", "g3/e", "g3/f"]
    assert schedule.claim("P") is None and schedule.claim("unknown") is None
    c = schedule.claim("Q")
    assert [(r.start, r.max_tokens, r.version, r.seed) for r in c.plan] == [(0, 2, 0, 13), (2, 4, 1, 14)]


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        (RECORD[:5], "trained 1 of group g3's answers where rollout.n is 2"),
        ([sample(1, "g", "a", "P", [[0, 0, 1]], turns=2), sample(1, "g", "b", "P", [[0, 0, 2]])], "episode of 2 turns"),
        ([sample(2, "g", "a", "P", [[0, 0, 1]]), sample(2, "g", "b", "P", [[0, 0, 2]])], "a replay needs every step"),
        ([sample(1, "g", "a", "P", [[0, 0, None]]), sample(1, "g", "b", "P", [[0, 0, 2]])], "did not seed"),
    ],
)
def test_a_record_a_replay_could_not_follow_is_refused_saying_why(tmp_path, samples, message):
    with pytest.raises(ReplayError, match=message):
        ReplaySchedule.from_run(write_record(tmp_path / "run", samples), answers_per_prompt=2)


def test_the_conductor_holds_requests_until_their_version_and_counts_what_is_pending(tmp_path):
    conductor = ReplayConductor(ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), 2))

    async def go():
        await conductor.set_version(0)
        waiting = asyncio.create_task(conductor.serve(1))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # version 1 is not served yet
        assert await conductor.serve(0) is True
        for _ in range(3):
            await conductor.generated(0)
        assert conductor.pending(0) == 1 and conductor.pending(1) == 4 and conductor.pending(2) == 5
        await conductor.generated(0)
        assert conductor.pending(0) == 0
        await conductor.set_version(2)
        assert await waiting is False  # its version is past: the replay left the record
        assert await conductor.serve(2) is True

    asyncio.run(go())


def buffered(group_id: str, members: list[tuple[str, str]]) -> BufferedGroup:
    """A replayed group whose members followed the recorded ``(name, response digest)``s, in that order."""
    info = []
    for name, response in members:
        recorded = next(s for s in RECORD if f"{s['group']}/{s['key']}" == name)
        info.append({**recorded, "response_digest": response, REPLAY_OF: name})
    return BufferedGroup(group_id, [0] * len(members), [f"k-{n}" for n, _ in members], [{}] * len(members), info)


def recorded_by_step() -> dict[int, list[dict]]:
    return {1: RECORD[:4], 2: RECORD[4:]}


def test_the_buffer_hands_each_step_the_recorded_groups_in_the_recorded_order(tmp_path):
    schedule = ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), 2)
    divergences = []
    buffer = ReplaySampleBuffer(schedule, recorded_by_step(), divergences.append)
    buffer.put(buffered("u2", [("g2/d", "r-d"), ("g2/c", "r-c")]))  # finished first, members out of order
    assert buffer.take(2, 0, timeout=0.01) == ([], [])  # g1 is not generated yet
    buffer.put(BufferedGroup("free", [0], ["k-free"], [{}], [{"response_digest": "x"}]))  # never trained: stays
    buffer.put(buffered("u1", [("g1/a", "r-a"), ("g1/b", "r-b")]))
    taken, stale = buffer.take(2, 0, timeout=0.01)
    assert stale == [] and divergences == []
    assert [g.group_id for g in taken] == ["u1", "u2"]
    assert [k for g in taken for k in g.keys] == ["k-g1/a", "k-g1/b", "k-g2/c", "k-g2/d"]
    assert len(buffer) == 1  # the free group
    with pytest.raises(ReplayError, match="asks for 2 groups where the record trained 1"):
        buffer.take(2, 1, timeout=0.01)


def test_the_buffer_names_a_trajectory_whose_tokens_differ_from_the_record(tmp_path):
    schedule = ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), 2)
    divergences = []
    buffer = ReplaySampleBuffer(schedule, recorded_by_step(), divergences.append)
    buffer.put(buffered("u1", [("g1/a", "r-a"), ("g1/b", "r-b")]))
    buffer.put(buffered("u2", [("g2/c", "r-c"), ("g2/d", "other tokens")]))
    buffer.take(2, 0, timeout=0.01)
    (divergence,) = divergences
    assert (divergence.step, divergence.field) == (1, "trained (prompt, response) digests")
    assert (divergence.first, divergence.second) == (("Q", "r-d"), ("Q", "other tokens"))


class _Remote:
    """A Ray actor handle's ``.method.remote(...)`` on a local object (what the client awaits)."""

    def __init__(self, target) -> None:
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)

        async def call(*args):
            result = method(*args)
            return await result if asyncio.iscoroutine(result) else result

        return SimpleNamespace(remote=lambda *args: call(*args))


def follow(tmp_path, produce) -> tuple[object, list[dict], ReplayConductor]:
    """Follow recorded trajectory g3/f (v1 for 5 tokens, then v2) with ``produce(max_tokens)`` tokens per request."""
    conductor = ReplayConductor(ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), 2))
    replay_client._found["handle"] = _Remote(conductor)
    asked: list[dict] = []
    episode = EpisodeRecord()

    async def generate_once(request_id, *, prompt_ids, sampling_params):
        asked.append({"prompt": list(prompt_ids), **sampling_params, "version": conductor.version})
        n = produce(sampling_params["max_tokens"])
        versions = [conductor.version] * n
        extra = {"token_versions": versions, "areal_seed": sampling_params["seed"], "global_steps": conductor.version}
        return TokenOutput(token_ids=list(range(n)), log_probs=[-0.5] * n, stop_reason="length", extra_fields=extra)

    async def go():
        await conductor.set_version(1)
        recorded = await replay_client.claim_recorded([])  # the digest of no tokens: not in RECORD
        assert recorded is None
        schedule_claim = conductor.claim("P")
        for _ in range(2):  # g1's and g3's first answers go to other requests
            conductor.claim("P")
        recorded = conductor.claim("P")
        assert recorded["name"] == "g3/f"
        CURRENT_EPISODE.set(episode)  # the agent-loop worker's record of this episode
        task = asyncio.create_task(
            replay_client.follow_record(generate_once, "r", [7, 8], {"max_tokens": 99, "temperature": 0.7}, recorded)
        )
        await asyncio.sleep(0.01)
        assert task.done() or episode.seconds_outside_engine() == 0.0  # waiting for version 2 in the client
        await conductor.set_version(2)
        return schedule_claim, await task

    try:
        _, output = asyncio.run(go())
    finally:
        replay_client._found.clear()
    # The episode counts the wait for a version as time in the engine, and the turn as the normal path does.
    assert episode.turns == 1 and episode.chunks == output.extra_fields["areal_chunks"]
    return output, asked, conductor


def test_the_client_asks_for_each_recorded_request_under_its_version_seed_and_length(tmp_path):
    output, asked, conductor = follow(tmp_path, produce=lambda max_tokens: max_tokens)
    assert [(a["prompt"], a["max_tokens"], a["seed"], a["version"]) for a in asked] == [
        ([7, 8], 5, 17, 1),
        ([7, 8, 0, 1, 2, 3, 4], 1, 18, 2),
    ]
    assert all(a["temperature"] == 0.7 for a in asked)
    assert output.token_ids == [0, 1, 2, 3, 4, 0]
    assert output.extra_fields["token_versions"] == [1] * 5 + [2]
    assert output.extra_fields["areal_chunks"] == [[0, 1, 17], [5, 2, 18]]
    assert output.extra_fields[REPLAY_OF] == "g3/f" and output.extra_fields["num_interrupts"] == 1
    assert conductor.done == {1: 1, 2: 1}


def test_a_request_that_leaves_its_record_stops_and_still_counts_its_later_requests(tmp_path):
    output, asked, conductor = follow(tmp_path, produce=lambda max_tokens: max_tokens - 2)  # stops 2 tokens early
    assert len(asked) == 1 and output.token_ids == [0, 1, 2]
    assert conductor.done == {1: 1, 2: 1}  # nobody waits for the request it could not make


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"name": "vllm"}, "rollout.name=vllm batches requests"),
        ({"name": "areal_cpu"}, "needs actor_rollout_ref.rollout.engine_kwargs.areal_cpu.batch_invariant=true"),
        (
            {"name": "areal_cpu", "engine_kwargs": {"areal_cpu": {"batch_invariant": False}}},
            "batch_invariant=true",
        ),
    ],
)
def test_a_replay_on_an_engine_that_cannot_regenerate_a_request_is_refused(rollout, message):
    from omegaconf import OmegaConf

    from areal_plugins.replay.driver_side import require_replayable

    with pytest.raises(ReplayError, match=message):
        require_replayable(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}}))
    fine = {"name": "areal_cpu", "engine_kwargs": {"areal_cpu": {"batch_invariant": True}}}
    require_replayable(OmegaConf.create({"actor_rollout_ref": {"rollout": fine}}))


def trainer_stub(calls: list, hybrid: bool) -> SimpleNamespace:
    """What ``ArealAsyncTrainer``'s sampling end and weight update use; each call is written to ``calls``."""
    from contextlib import nullcontext

    def note(*what):
        return lambda *args, **kwargs: calls.append((*what, *args))

    return SimpleNamespace(
        schedule=SimpleNamespace(
            finish_version=lambda v, check: calls.append(("hold", v)),
            served=note("served"),
            pauses_admission_before_update=True,
        ),
        placement=SimpleNamespace(hybrid_replicas=hybrid, after_sampling=lambda trainer: calls.append(("sleep",))),
        supervisor=SimpleNamespace(waiting=lambda: None),
        rollout_manager=SimpleNamespace(pause=note("pause"), resume=note("resume")),
        replica_pool=SimpleNamespace(prune=lambda: None),
        replacer=SimpleNamespace(grow=lambda max_replicas: False, join=lambda: 0, serve=lambda version: None),
        areal=SimpleNamespace(max_rollout_replicas=None),
        weight_sync=SimpleNamespace(
            update_weights=note("update"), backend="naive", resume_generation_replicas=note("wake")
        ),
        recorder=SimpleNamespace(span=lambda *args, **kwargs: nullcontext(), run_dir=None),
        _phase_end=lambda phase, next_phase: None,  # phase boundaries: measured, and the stop request read
        timing_raw={},
        version=3,
        global_steps=4,
    )


@pytest.mark.parametrize("hybrid", [True, False])
def test_the_trainer_holds_each_version_until_its_recorded_requests_are_generated(hybrid):
    """Colocated engines stop serving a version when they sleep after sampling; separate ones at the update. The
    hold must come before either, and the new version is announced only once the engines hold it."""
    from areal_plugins.driver.async_trainer import ArealAsyncTrainer

    calls: list = []
    stub = trainer_stub(calls, hybrid)
    ArealAsyncTrainer.on_sample_end(stub)
    ArealAsyncTrainer.on_step_end(stub)
    at_sampling_end = [("hold", 3), ("sleep",)] if hybrid else [("sleep",)]
    assert calls == [*at_sampling_end, ("hold", 3), ("pause",), ("update", 4), ("served", 4), ("wake",), ("resume", 4)]


def submissions(*groups: tuple[str, str]) -> list[dict]:
    """``areal_submissions.jsonl`` lines, one per submitted (uid, prompt text digest)."""
    return [{"version": 0, "uids": [uid], "prompts": [text]} for uid, text in groups]


def test_requests_take_a_prompts_recorded_groups_in_the_order_the_recorded_run_submitted_them(tmp_path):
    """Prompt P was submitted three times: g3 first (trained at step 2), then a group never trained (rejected),
    then g1 (trained at step 1). The replay's first group of P follows g3, the second generates freely, the
    third follows g1: training order would have sent the first to g1, whose requests run under other versions."""
    run = write_record(tmp_path / "run", RECORD)
    lines = submissions(("g3", "text-P"), ("rejected", "text-P"), ("g2", "text-Q"), ("g1", "text-P"))
    (run / "areal_submissions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    schedule = ReplaySchedule.from_run(run, answers_per_prompt=2)
    claims = [schedule.claim("P") for _ in range(6)]
    assert [c.name if c else None for c in claims] == ["g3/e", "g3/f", None, None, "g1/a", "g1/b"]
    assert schedule.claim("P") is None  # no more groups of P in the record
    assert [c.name for c in (schedule.claim("Q"), schedule.claim("Q"))] == ["g2/c", "g2/d"]


def test_a_group_whose_answers_followed_another_recorded_group_or_a_failed_request_stops_the_replay(tmp_path):
    schedule = ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), 2)
    divergences: list = []

    def record(divergence):
        divergences.append(divergence)
        raise RuntimeError("stopped")

    buffer = ReplaySampleBuffer(schedule, recorded_by_step(), record)
    buffer.put(buffered("u1", [("g1/a", "r-a"), ("g3/e", "r-e")]))  # members of two recorded groups
    with pytest.raises(RuntimeError):
        buffer.take(2, 0, timeout=0.01)
    assert divergences[0].field == "group u1 followed recorded groups" and divergences[0].second == ["g1", "g3"]
    failing = ReplaySampleBuffer(schedule, recorded_by_step(), record, lambda: ("g2/c", "ActorDiedError: gone"))
    with pytest.raises(RuntimeError):
        failing.take(2, 0, timeout=0.01)
    assert (divergences[1].field, divergences[1].first) == ("a replayed request failed", "g2/c")


def test_a_failing_request_is_reported_and_counts_its_requests(tmp_path):
    conductor = ReplayConductor(ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), 2))
    replay_client._found["handle"] = _Remote(conductor)

    async def failing(request_id, **kwargs):
        raise ConnectionError("the server went away")

    async def go():
        await conductor.set_version(1)
        for _ in range(3):
            conductor.claim("P")
        recorded = conductor.claim("P")  # g3/f: requests under versions 1 and 2
        with pytest.raises(ConnectionError):
            await replay_client.follow_record(failing, "r", [7], {"max_tokens": 9}, recorded)

    try:
        asyncio.run(go())
    finally:
        replay_client._found.clear()
    assert conductor.first_failure() == ("g3/f", "ConnectionError: the server went away")
    assert conductor.done == {1: 1, 2: 1}  # no hold waits for the requests it will not make


def test_a_replay_refuses_to_change_what_decides_which_prompts_are_drawn_when():
    from areal_plugins.cli.replay import refused_overrides

    overrides = [
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "areal.max_staleness=1",
        "data.seed=3",
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.batch_invariant=true",
        "actor_rollout_ref.rollout.n=4",
        "areal.loss.eps_clip=0.3",
    ]
    assert refused_overrides(overrides) == overrides[1:5]


def test_a_hold_that_sees_no_recorded_request_come_stops_the_replay_saying_what_it_waited_for(monkeypatch):
    from areal_plugins.replay import driver_side as replay_driver

    monkeypatch.setattr(replay_driver, "BARRIER_POLL_S", 0.01)
    driver = object.__new__(replay_driver.ReplayDriver)
    driver.stuck_s = 0.2
    written: list = []
    driver.recorder = SimpleNamespace(write=lambda name, record: written.append(record))
    counts = iter([5, 4, 3])  # three requests arrive, then none
    driver.pending = lambda version: next(counts, 3)
    with pytest.raises(replay_driver.ReplayDivergedError, match="3 recorded requests under weight versions up to 2"):
        driver.finish_version(2, check=lambda: None)
    finishing = iter([2, 1, 0])
    driver.pending = lambda version: next(finishing)
    driver.finish_version(2, check=lambda: None)
    assert written[-1]["version"] == 2


def test_two_groups_of_one_prompt_in_flight_at_once_each_follow_one_recorded_group(tmp_path):
    """P's two groups ask in turn, answer by answer (x0, y0, y1, x1), as verl's agent-loop tasks of two groups of
    one prompt do when both are in flight: each group follows one recorded group (x the first asked, g1; y, g3),
    each answer the member of its index. Claimed by prompt alone, x would take g1/a and g3/f: a group of two."""
    schedule = ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), answers_per_prompt=2)
    claims = [schedule.claim("P", uid, member) for uid, member in (("x", 0), ("y", 0), ("y", 1), ("x", 1))]
    assert [c.name for c in claims] == ["g1/a", "g3/e", "g3/f", "g1/b"]
    assert schedule.claim("P", "z", 0) is None  # no third recorded group of P: z generates freely


def test_an_episode_claims_by_its_group_uid_and_answer_index(tmp_path):
    """The client passes the agent-loop episode's uid and answer index (verl's ``uid``, ``session_id``) with the
    prompt's digest: y's second answer asks first and gets g1's second member; x's first then gets g3's first."""
    prompt = [7, 8]
    digest = replay_client.prompt_digest(prompt)
    record = [{**s, "prompt_digest": digest} if s["prompt_digest"] == "P" else s for s in RECORD]
    conductor = ReplayConductor(ReplaySchedule.from_run(write_record(tmp_path / "run", record), 2))
    replay_client._found["handle"] = _Remote(conductor)

    async def episode(uid: str, member: int):
        CURRENT_EPISODE.set(EpisodeRecord(group_uid=uid, session=member))
        return await replay_client.claim_recorded(prompt)

    async def both():
        first = await episode("y", 1)
        return first, await episode("x", 0)

    try:
        claims = asyncio.run(both())
    finally:
        replay_client._found.clear()
    assert [c["name"] for c in claims] == ["g1/b", "g3/e"]


def checkpointed_run(tmp_path: Path, drawn_before: int) -> tuple[Path, Path]:
    """RECORD with its submissions (g1, g2; then g3; then x, never trained) and a checkpoint of step 1 taken after
    ``drawn_before`` of those submission lines."""
    run = write_record(tmp_path / "run", RECORD)
    lines = submissions(("g1", "text-P"), ("g2", "text-Q"), ("g3", "text-P"), ("x", "text-P"))
    lines = [{**lines[0], "uids": ["g1", "g2"], "prompts": ["text-P", "text-Q"]}, lines[2], lines[3]]
    (run / "areal_submissions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    checkpoint = run / "checkpoints" / "global_step_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "areal_state.json").write_text(json.dumps({"submissions": drawn_before}))
    return run, checkpoint


def test_from_a_checkpoint_the_schedule_starts_after_it_and_carried_groups_keep_their_recorded_group(tmp_path):
    """Resumed from step 1's checkpoint, with g1, g2 and g3 drawn before it: step 2 (g3) is what is left to train;
    the engines serve version 1, so the requests still to generate are those under versions 1 and up (counted by
    hand: g3's e and f under v1, f's second under v2); g3, re-issued under its uid, follows its own recorded group,
    g1 (trained before the checkpoint) nothing, and a group drawn after it the prompt's later groups (none here)."""
    run, checkpoint = checkpointed_run(tmp_path, drawn_before=2)
    schedule = ReplaySchedule.from_run(run, 2, checkpoint)
    assert schedule.first_step == 2 and [g.group for g in schedule.groups_of_step(2)] == ["g3"]
    with pytest.raises(ReplayError, match="the record ends at step 2"):
        schedule.groups_of_step(3)
    assert dict(schedule.chunks_per_version) == {1: 2, 2: 1}
    assert schedule.claim("P", "g3", 1).name == "g3/f"
    assert schedule.claim("P", "g1", 0) is None
    assert schedule.claim("P", "x", 0) is None

    divergences = []
    buffer = ReplaySampleBuffer(schedule, recorded_by_step(), divergences.append)
    restored = RECORD[4:]  # g3 finished before the checkpoint: restored from TransferQueue, it followed no record
    buffer.put(BufferedGroup("g3", [1, 1], ["k-e", "k-f"], [{}, {}], restored))
    taken, _ = buffer.take(1, 1, timeout=0.01)
    assert [g.group_id for g in taken] == ["g3"] and divergences == []


def test_a_group_drawn_after_the_checkpoint_takes_the_prompts_groups_submitted_after_it(tmp_path):
    run, checkpoint = checkpointed_run(tmp_path, drawn_before=1)  # only g1 and g2 drawn before: g3 comes later
    schedule = ReplaySchedule.from_run(run, 2, checkpoint)
    assert schedule.claim("P", "new-uid", 1).name == "g3/f"  # the prompt's first group drawn after the checkpoint
    assert schedule.claim("P", "g1", 0) is None


def test_a_request_resumed_from_the_checkpoint_asks_only_for_its_recorded_requests_after_it(tmp_path):
    """g3/f: 5 tokens under v1 (kept by the checkpoint: its first request), then 1 under v2: only that is asked."""
    from areal_plugins.agent_loop.partial_outputs import PartialOutput

    conductor = ReplayConductor(ReplaySchedule.from_run(write_record(tmp_path / "run", RECORD), 2))
    replay_client._found["handle"] = _Remote(conductor)
    asked: list[dict] = []

    async def generate_once(request_id, *, prompt_ids, sampling_params):
        asked.append({"prompt": list(prompt_ids), **sampling_params})
        n = sampling_params["max_tokens"]
        extra = {"token_versions": [2] * n, "areal_seed": sampling_params["seed"]}
        return TokenOutput(token_ids=[9] * n, log_probs=[-0.5] * n, stop_reason="length", extra_fields=extra)

    kept = PartialOutput("d", [1, 2, 3, 4, 5], [-0.1] * 5, [1] * 5, [[0, 1, 17]], interrupts=1)

    async def go():
        await conductor.set_version(2)
        for _ in range(3):  # g1's answers and g3's first go to other requests
            conductor.claim("P")
        recorded = conductor.claim("P")
        return await replay_client.follow_record(generate_once, "r", [7], {"max_tokens": 99}, recorded, kept)

    try:
        output = asyncio.run(go())
    finally:
        replay_client._found.clear()
    assert asked == [{"prompt": [7, 1, 2, 3, 4, 5], "max_tokens": 1, "seed": 18}]
    assert output.token_ids == [1, 2, 3, 4, 5, 9] and output.extra_fields["token_versions"] == [1] * 5 + [2]
    assert output.extra_fields["areal_chunks"] == [[0, 1, 17], [5, 2, 18]]


def test_a_replay_from_a_checkpoint_the_run_did_not_keep_or_of_a_separate_run_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from areal_plugins.cli.replay import resume_from
    from areal_plugins.replay.driver_side import resumed_checkpoint

    run, checkpoint = checkpointed_run(tmp_path, drawn_before=2)  # keeps global_step_1 only
    with pytest.raises(SystemExit, match=r"global_step_2 is not a checkpoint of this run \(it has \['global_step_1'\]"):
        resume_from(run, [], 2, 3)
    with pytest.raises(SystemExit, match="would train no step"):
        resume_from(run, [], 1, 1)
    assert resume_from(run, [], 1, 2) == [
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={checkpoint}",
        "areal.replay.from_step=1",
    ]

    def config(placement: str):
        return OmegaConf.create(
            {
                "areal": {"placement": placement, "replay": {"from_step": 1}},
                "trainer": {"resume_from_path": str(checkpoint)},
            }
        )

    with pytest.raises(ReplayError, match="keeps no areal_partials/"):
        resumed_checkpoint(config("colocated"))
    (checkpoint / "areal_partials").mkdir()
    assert resumed_checkpoint(config("colocated")) == checkpoint
    with pytest.raises(ReplayError, match=r"needs a run recorded with areal\.placement=colocated"):
        resumed_checkpoint(config("separate"))


def test_an_answer_follows_the_recorded_answer_of_its_index_not_of_its_position():
    """Keys sort as text ("_" after the digits): 12 answers are recorded _0_0, _10_0, _11_0, _1_0, _2_0, …"""
    from areal_plugins.replay.schedule import RecordedGroup, RecordedTrajectory, answer_of

    keys = sorted(f"u_{i}_0" for i in range(12))
    group = RecordedGroup("u", tuple(RecordedTrajectory(f"u/{key}", "P", "r", ()) for key in keys))
    assert [t.name for t in group.trajectories[:5]] == ["u/u_0_0", "u/u_10_0", "u/u_11_0", "u/u_1_0", "u/u_2_0"]
    assert answer_of(group, 1).name == "u/u_1_0" and answer_of(group, 10).name == "u/u_10_0"
    assert answer_of(group, 12) is None


def test_a_replay_from_a_checkpoint_refuses_a_group_drawn_before_it_and_generated_again_after(tmp_path):
    run, checkpoint = checkpointed_run(tmp_path, drawn_before=2)
    (run / "areal_reissued.jsonl").write_text(json.dumps({"time": 0, "version": 1, "uids": ["g3"]}) + "\n")
    with pytest.raises(ReplayError, match="group g3, drawn before the checkpoint of step 1, was generated again"):
        ReplaySchedule.from_run(run, 2, checkpoint)


def test_a_record_of_an_earlier_format_is_refused_before_anything_runs(tmp_path):
    from areal_plugins.cli.launch import write_run_args
    from areal_plugins.cli.replay import replay

    run = write_record(tmp_path / "run", RECORD)
    write_run_args(run, Path("recipes/grpo_cpu_async.yaml"), ["areal.max_staleness=2"], None)
    written = json.loads((run / "run_args.json").read_text())
    assert written["record_format"] == 2 and written["overrides"] == ["areal.max_staleness=2"]
    del written["record_format"]  # as written before 2026-12-03
    (run / "run_args.json").write_text(json.dumps(written))
    with pytest.raises(SystemExit, match=r"recorded by an earlier version \(record format 1"):
        replay(run, tmp_path / "out", None, [])
    assert not (tmp_path / "out").exists()


def test_a_changed_learning_rate_stops_the_replay_at_the_first_step_naming_the_setting():
    """The lr-changed replay of the full tier, at the comparison: step 1's recorded metrics (the file logger's floats)
    against the replayed update's (a numpy scalar, as verl hands them); the setting is compared before the loss."""
    import numpy as np

    from areal_plugins.replay import driver_side as replay_driver

    driver = object.__new__(replay_driver.ReplayDriver)
    written: list = []
    driver.recorder = SimpleNamespace(write=lambda name, record: written.append((name, record)))
    driver.recorded_metrics = {
        1: {"actor/lr": 2e-4, "actor/pg_loss": 0.125},
        2: {"actor/lr": 2e-4, "actor/pg_loss": 0.25},
    }
    driver.check_step(1, {"actor/lr": np.float64(2e-4), "actor/pg_loss": np.float32(0.125), "other": 3})
    assert written == [("areal_replay.jsonl", {"step": 1, "matched": True})]
    with pytest.raises(replay_driver.ReplayDivergedError, match=r"step 2, actor/lr: 0\.0002 vs 0\.001"):
        driver.check_step(2, {"actor/lr": np.float64(1e-3), "actor/pg_loss": np.float32(0.5)})
    name, record = written[-1]
    assert name == "areal_replay.jsonl"
    assert record == {
        "step": 2,
        "matched": False,
        "field": "actor/lr",
        "recorded": 2e-4,
        "replayed": 1e-3,
        "trajectory": None,
    }


LORA_RECORD = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


def test_a_lora_record_without_a_seeded_adapter_is_refused_from_the_start_and_replayed_from_a_checkpoint(tmp_path):
    """peft draws a LoRA run's first ``lora_A`` unseeded unless verl's ``full_determinism`` is on (docs/replay.md):
    a replay from the start could not match, one from a checkpoint (which loads the adapter) can."""
    from areal_plugins.cli.launch import write_run_args
    from areal_plugins.cli.replay import replay, unseeded_adapter

    recipe = Path("recipes/grpo_cpu_async.yaml")
    assert unseeded_adapter(recipe, []) is None  # no adapter
    assert unseeded_adapter(recipe, [*LORA_RECORD, "actor_rollout_ref.actor.fsdp_config.full_determinism=true"]) is None
    assert "full_determinism=true" in unseeded_adapter(recipe, LORA_RECORD)
    run = write_record(tmp_path / "run", RECORD)
    write_run_args(run, recipe, LORA_RECORD, None)
    with pytest.raises(SystemExit, match=r"LoRA adapter \(rank 8\) without .*--from-checkpoint STEP"):
        replay(run, tmp_path / "out", None, [])
    assert not (tmp_path / "out").exists()
    # From a checkpoint the adapter is loaded: this check passes, and the next one names the missing checkpoint.
    with pytest.raises(SystemExit, match=r"--from-checkpoint 1: .* is not a checkpoint of this run"):
        replay(run, tmp_path / "out", None, [], from_checkpoint=1)
