"""``areal-plugins replay``: an asynchronous run, run again by its record, through verl's real trainer.

A colocated η = 2 run of the main recipe on areal_cpu with ``batch_invariant`` is recorded (the engine finishes only
a batch of groups per version, testing/holds.py, so the others are in flight when sampling ends: they are cut
and continue under newer weights). Its model is the tiny mixture of experts (Qwen2-MoE: 4 experts, 2 per token, a
shared expert) with router replay on, so this CI run is also the MoE representative of docs/support.md: a MoE
model trains asynchronously, its expert weights reach the engine on every update, and its answers, cut and
continued under newer weights, replay to the last bit. The recorded run is then replayed: the replay must
train the same tokens with the same behaviour log-probs, and compute the same losses and gradient norms, to the
last bit. A replay with another learning rate must report the first step it changes, naming the field and both
values. A replay from the step-1 checkpoint must train steps 2-3 as the record did.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_plugins.agent_loop.partial_outputs import read_partials
from tests.integration.conftest import read_jsonl, run_cli, train_tiny

pytestmark = pytest.mark.integration

ETA = 2
STEPS = 3
BATCH = 16  # prompt groups per step (the recipes' data.train_batch_size)


@pytest.fixture(scope="module")
def recorded_run(moe_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("replay") / "recorded"
    train_tiny(
        "grpo_cpu_async.yaml",
        run_dir,
        moe_dir,
        STEPS,
        f"areal.max_staleness={ETA}",
        "++actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        # Cuts by construction, on a fast machine or a slow one: under each version only the first 16 groups (the
        # batch, data.train_batch_size) finish; the others stop after a token until the update cuts them (and the
        # step-1 checkpoint keeps them in flight). Timing alone cut none on a fast machine (2026-12-04).
        f"+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.finish_groups_per_version={BATCH}",
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.batch_invariant=true",
        "trainer.save_freq=1",  # a checkpoint per step: a replay can start from one
    )
    return run_dir


def trained(run_dir: Path) -> list[tuple]:
    """What each step trained, in order: (step, prompt, response and log-prob digests, routing digest, requests)."""
    return [
        # s.get: the MoE run's routing digest, position by position (absent without router replay)
        (
            s["step"],
            s["prompt_digest"],
            s["response_digest"],
            s["logprobs_digest"],
            s.get("routed_experts_digest"),
            s["chunks"],
        )
        for s in read_jsonl(run_dir / "areal_samples.jsonl")
    ]


def learned(run_dir: Path) -> dict[int, tuple]:
    lines = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    fields = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean")
    return {int(m["training/global_step"]): tuple(m[f] for f in fields) for m in lines if "actor/pg_loss" in m}


def test_a_moe_model_trains_asynchronously_with_every_update_reaching_the_engine(recorded_run, moe_dir):
    config = json.loads((moe_dir / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["num_experts"] == 4, config
    steps = [json.loads(line)["data"] for line in (recorded_run / "metrics.jsonl").read_text().splitlines() if line]
    assert [s["training/global_step"] for s in steps] == list(range(1, STEPS + 1))
    assert max(s["areal/staleness_max"] for s in steps) <= ETA
    # Every version reached the engine and was checked there (that the check covers the expert tensors is
    # tests/unit/test_tiny_moe.py's).
    updates = [e for e in read_jsonl(recorded_run / "weight_syncs.jsonl") if e["event"] == "update"]
    assert sorted({e["version"] for e in updates}) == list(range(STEPS + 1)), updates
    # Router replay: every trained trajectory carries the experts that routed each of its positions, merged across
    # its requests, prompt + response - 1 of them (the last token is never fed through the model), interrupted ones
    # included (docs/reference/run_records.md).
    samples = read_jsonl(recorded_run / "areal_samples.jsonl")
    assert len(samples) == STEPS * BATCH * 8  # 8 answers per prompt (the recipe's rollout.n)
    assert all(s["routed_experts_rows"] == s["prompt_tokens"] + s["response_tokens"] - 1 for s in samples)
    # ... and the trainer replays them (R3, patches/fsdp_router_replay.py): each step's update routed its tokens as
    # the engine did, at least one route for every trained position of every layer (2 layers).
    for step in steps:
        assert step["actor/areal/router_replay_routes"] > 0, step
        assert 0.0 <= step["actor/areal/router_replay_changed_fraction"] <= 1.0, step
    # What the replays must reproduce: trajectories cut by an update and continued under the next version, and a
    # step that learned something.
    interrupted = [chunks for *_, chunks in trained(recorded_run) if len(chunks) > 1]
    assert interrupted, "no recorded trajectory was interrupted: the replay would not exercise a cut"
    assert any(len({version for _, version, _ in chunks}) > 1 for chunks in interrupted)
    assert any(grad_norm > 0 for _, grad_norm, _ in learned(recorded_run).values())


@pytest.mark.full  # its own verl start; CI replays the same record from its step-1 checkpoint (below)
def test_a_replay_trains_the_same_tokens_and_losses_bit_for_bit(recorded_run):
    samples = trained(recorded_run)
    out = recorded_run.parent / "replayed"
    result = run_cli("replay", str(recorded_run), "--out", str(out))
    assert "matched the record over 3 steps" in result.stdout, result.stdout
    # Independently of the replay's own comparison: the two runs' records, field by field.
    assert trained(out) == samples
    assert learned(out) == learned(recorded_run)
    assert sorted(learned(out)) == [1, 2, 3]


@pytest.mark.full  # its own verl start (95 s in CI); the comparison is unit-tested (tests/unit/test_replay_schedule.py)
def test_a_replay_with_another_learning_rate_names_the_first_step_it_changes(recorded_run):
    out = recorded_run.parent / "replayed_lr"
    result = run_cli(
        "replay",
        str(recorded_run),
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "--out",
        str(out),
        "--until",
        "1",
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    report = [line for line in read_jsonl(out / "areal_replay.jsonl") if line.get("matched") is False]
    assert report[0]["step"] == 1 and report[0]["field"] == "actor/lr", report
    assert (report[0]["recorded"], report[0]["replayed"]) == (2e-4, 1e-3)
    assert "step 1, actor/lr: 0.0002 (recorded) vs 0.001 (replayed)" in result.stdout


def test_a_replay_from_a_mid_run_checkpoint_matches_the_remaining_steps(recorded_run):
    """From the step-1 checkpoint: verl's weights, dataloader and TransferQueue, our counters, and the output so far
    of the requests in flight, which the replay continues from where the checkpoint kept them."""
    checkpoint = recorded_run / "checkpoints" / "global_step_1"
    kept = read_partials(checkpoint)
    assert kept, "the checkpoint kept no request in flight: the replay would not continue one"
    out = recorded_run.parent / "replayed_from_1"
    result = run_cli("replay", str(recorded_run), "--from-checkpoint", "1", "--out", str(out))
    assert f"matched the record over {STEPS - 1} steps" in result.stdout, result.stdout
    assert trained(out) == [sample for sample in trained(recorded_run) if sample[0] > 1]
    assert learned(out) == {step: values for step, values in learned(recorded_run).items() if step > 1}
    # A trajectory trained after the checkpoint began before it: its first requests are the ones the checkpoint kept.
    kept_chunks = [partial["chunks"] for partial in kept]
    assert any(chunks[: len(k)] == k for *_, chunks in trained(out) for k in kept_chunks)


@pytest.mark.full
def test_a_separate_placement_run_replays_bit_for_bit(tiny_dir, long_response_model, tmp_path_factory):
    """Engines in their own pool generate while the trainer trains; the replay holds each version until the
    weight update instead of until the end of sampling. The random-weights model answers at length, so updates
    find requests mid-generation (the tiny model's short answers finish first in this placement)."""
    run_dir = tmp_path_factory.mktemp("replay_separate") / "recorded"
    train_tiny(
        "grpo_cpu_async_separate.yaml",
        run_dir,
        tiny_dir,
        STEPS,
        f"areal.max_staleness={ETA}",
        f"actor_rollout_ref.model.path={long_response_model}",
        "data.max_response_length=24",
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.max_batch_size=24",
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.batch_invariant=true",
    )
    assert any(len({version for _, version, _ in chunks}) > 1 for *_, chunks in trained(run_dir))
    out = run_dir.parent / "replayed"
    result = run_cli("replay", str(run_dir), "--out", str(out))
    assert f"matched the record over {STEPS} steps" in result.stdout, result.stdout
    assert trained(out) == trained(run_dir)
    assert learned(out) == learned(run_dir)


@pytest.mark.full  # two verl starts (about 3 min here); the replay machinery is the same as the CI runs above
def test_a_lora_run_replays_bit_for_bit(tiny_dir, tmp_path_factory):
    """LoRA (rank 8, colocated): the adapter starts from values verl draws with ``full_determinism`` seeded, every
    update reaches the engine as the adapter alone, and answers cut by an update continue under the next one; the
    replay trains the same tokens and log-probs to the last bit, with the same losses and gradient norms."""
    run_dir = tmp_path_factory.mktemp("replay_lora") / "recorded"
    train_tiny(
        "grpo_cpu_async.yaml",
        run_dir,
        tiny_dir,
        2,
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "++actor_rollout_ref.actor.fsdp_config.full_determinism=true",
        f"areal.max_staleness={ETA}",
        f"+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.finish_groups_per_version={BATCH}",
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.batch_invariant=true",
    )
    samples = trained(run_dir)
    assert any(s[-1] and len(s[-1]) > 1 for s in samples), "no trajectory was cut: the replay would continue none"
    out = run_dir.parent / "replayed"
    result = run_cli("replay", str(run_dir), "--out", str(out))
    assert "matched the record over 2 steps" in result.stdout, result.stdout
    assert sorted(trained(out), key=repr) == sorted(samples, key=repr)  # by hand: the records, field by field
    assert learned(out) == learned(run_dir) and sorted(learned(out)) == [1, 2]
