"""A vision-language model trained asynchronously through verl (recipes/grpo_cpu_async_vlm.yaml): the tiny Qwen2-VL
on pictures of squares, η = 2, colocated, on ``areal_cpu``.

Made to interrupt by construction: under each version only the first groups finish and the others wait after a token
for the next update (testing/holds.py), so requests are cut and continued. A continued request whose pictures were
lost would stop the run (the engine refuses image placeholders that come without their images), so a run that
finishes with interrupted trajectories continued them with their pictures.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import REPO, assert_within_staleness_bound, read_jsonl, run_cli, train_tiny

pytestmark = pytest.mark.integration

VISION_DIR = REPO / ".areal" / "tiny_vision"
ETA = 2  # the recipe's
STEPS = 3
BATCH = 16  # prompt groups per step (the recipes' data.train_batch_size)
GROUP = 8  # rollout.n


@pytest.fixture(scope="module")
def vision_dir():
    run_cli("build-tiny", "--workload", "vision", "--out", str(VISION_DIR))
    return VISION_DIR


@pytest.fixture(scope="module")
def vlm_run(vision_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vlm_run")
    metrics = train_tiny(
        "grpo_cpu_async_vlm.yaml",
        run_dir,
        vision_dir,
        STEPS,
        f"+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.finish_groups_per_version={BATCH}",
    )
    return run_dir, metrics


def model_tensor_names(model_dir) -> list[str]:
    """The tensors of the model folder's checkpoint (an independent count of what an update must carry)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as checkpoint:
        return list(checkpoint.keys())


def test_interrupted_requests_continue_with_their_pictures(vlm_run):
    run_dir, _ = vlm_run
    samples = read_jsonl(run_dir / "areal_samples.jsonl")
    assert len(samples) == STEPS * BATCH * GROUP
    spanning = [s for s in samples if s["tail_version"] > s["head_version"]]
    assert spanning, "no trajectory was interrupted by a weight update and continued"
    assert all(s["num_interrupts"] >= 1 and len(s["chunks"]) >= 2 for s in spanning)
    assert_within_staleness_bound(samples, read_jsonl(run_dir / "areal_steps.jsonl"), ETA)


def test_every_update_carries_and_checks_the_vision_tower(vlm_run, vision_dir):
    run_dir, _ = vlm_run
    names = model_tensor_names(vision_dir / "model")
    vision = [name for name in names if ".visual." in f".{name}"]
    assert vision and any("merger" in name for name in vision), names  # the tower and its projector
    updates = [e for e in read_jsonl(run_dir / "replica_events.jsonl") if e["event"] == "update"]
    assert [e["version"] for e in updates] == list(range(STEPS + 1)), updates
    # Every checkpoint tensor arrived, and the engine's checksum of what it serves after loading covers them: the
    # trainer compares it with its own of what it sent and stops the run on a difference (verify_weights). The
    # checkpoint stores the tied output projection once (as the embedding); the trainer sends it under both names.
    tied = json.loads((vision_dir / "model" / "config.json").read_text())["tie_word_embeddings"]
    assert all(e["tensors"] == len(names) + int(tied) for e in updates), (updates, len(names))


def test_the_trainer_computes_the_engines_log_probs_with_the_same_pictures(vlm_run):
    """Step 1 trains on version-0 samples with the trainer at version 0: the trainer's probability of each token
    (the pictures through its vision tower) equals the engine's to float32 rounding (verl's own metric)."""
    _, metrics = vlm_run
    assert metrics[0]["training/rollout_probs_diff_max"] < 1e-5, metrics[0]
    assert metrics[0]["training/rollout_probs_diff_valid"] == 1.0


def test_micro_batches_count_each_pictures_tokens(vlm_run, vision_dir):
    """The token budget counts a picture's placeholder tokens (4 here) with the text's: step 1's partition holds
    exactly the prompts as the model's processor expands them plus the responses, within 512 tokens a micro-batch."""
    from transformers import AutoProcessor

    from areal_plugins.tiny.vision_model import picture_messages
    from areal_plugins.tiny.vision_task import draw, make_picture_problems

    run_dir, _ = vlm_run
    processor = AutoProcessor.from_pretrained(vision_dir / "model", trust_remote_code=True)
    problem = make_picture_problems(1, seed=0)[0]
    text = processor.apply_chat_template(picture_messages(problem.question), add_generation_prompt=True, tokenize=False)
    expanded = processor(text=[text], images=[draw(problem)], return_tensors="pt")["input_ids"][0].tolist()
    assert expanded.count(processor.image_token_id) == 4
    step1 = [s for s in read_jsonl(run_dir / "areal_samples.jsonl") if s["step"] == 1]
    assert {s["prompt_tokens"] for s in step1} == {len(expanded)}  # every question's added number is one token
    partition = read_jsonl(run_dir / "micro_batches.jsonl")[0]  # step 1's log-prob pass
    assert partition["sequences"] == len(step1)
    assert sum(partition["tokens"]) == sum(s["prompt_tokens"] + s["response_tokens"] for s in step1)
    assert max(partition["padded_tokens"]) <= 512


SEPARATE = (
    "areal.placement=separate",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=areal_gloo",
    "++actor_rollout_ref.rollout.engine_kwargs.areal_cpu.num_threads=1",
    "ray_kwargs.ray_init.num_gpus=2",
)


@pytest.mark.full  # its own verl start
def test_a_vlm_trains_with_its_engines_in_their_own_pool(vision_dir, tmp_path_factory):
    """The engines in a pool of their own: every update crosses our gloo checkpoint engine, whose in-band check
    compares each tensor, the vision tower's included, on arrival; requests held across updates continue with
    their pictures."""
    run_dir = tmp_path_factory.mktemp("vlm_separate")
    metrics = train_tiny(
        "grpo_cpu_async_vlm.yaml",
        run_dir,
        vision_dir,
        STEPS,
        *SEPARATE,
        f"+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.finish_groups_per_version={BATCH}",
    )
    assert [m["training/global_step"] for m in metrics] == list(range(1, STEPS + 1))
    samples = read_jsonl(run_dir / "areal_samples.jsonl")
    assert any(s["tail_version"] > s["head_version"] for s in samples), "no request was continued after an update"
    names = model_tensor_names(vision_dir / "model")
    updates = [e for e in read_jsonl(run_dir / "replica_events.jsonl") if e["event"] == "update"]
    assert updates and all(e["tensors"] == len(names) + 1 for e in updates), updates  # + the tied output projection


@pytest.mark.full  # two verl starts
def test_a_vlm_run_replays_bit_for_bit(vision_dir, tmp_path_factory):
    """Recorded with each request decoded alone (batch-invariant): the replay trains the same tokens and log-probs,
    pictures and all, with the same losses."""
    import json

    run_dir = tmp_path_factory.mktemp("vlm_replay") / "recorded"
    train_tiny(
        "grpo_cpu_async_vlm.yaml",
        run_dir,
        vision_dir,
        2,
        f"+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.finish_groups_per_version={BATCH}",
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.batch_invariant=true",
    )

    def trained(run):
        rows = read_jsonl(run / "areal_samples.jsonl")
        return sorted(
            (s["step"], s["prompt_digest"], s["response_digest"], s["logprobs_digest"], repr(s["chunks"])) for s in rows
        )

    def learned(run):
        lines = [json.loads(line)["data"] for line in (run / "metrics.jsonl").read_text().splitlines() if line]
        return [(m["actor/pg_loss"], m["actor/grad_norm"]) for m in lines if "actor/pg_loss" in m]

    assert any(chunks.count("],") >= 1 for *_, chunks in trained(run_dir)), "no request was cut"
    out = run_dir.parent / "replayed"
    result = run_cli("replay", str(run_dir), "--out", str(out))
    assert "matched the record over 2 steps" in result.stdout, result.stdout
    assert trained(out) == trained(run_dir)
    assert learned(out) == learned(run_dir)


@pytest.mark.full  # two verl starts
def test_requests_in_flight_at_a_checkpoint_continue_with_their_pictures_after_a_crash(vision_dir, tmp_path_factory):
    """SIGKILL every process after the step-1 checkpoint, with requests held mid-answer; the resumed run continues
    the kept ones (their saved requests first, then more), each found by its prompt and pictures' digest."""
    import time

    from areal_plugins.agent_loop.partial_outputs import read_partials
    from tests.integration.conftest import cli_output, kill_tree, start_cli, train_args

    run_dir = tmp_path_factory.mktemp("vlm_resume") / "run"
    args = train_args(
        "grpo_cpu_async_vlm.yaml",
        run_dir,
        vision_dir,
        STEPS,
        "trainer.save_freq=1",
        # Long answers (past the end-of-answer token) decoded a few at a time: sampling for step 1 ends with
        # requests mid-answer, which the checkpoint keeps.
        "actor_rollout_ref.rollout.ignore_eos=true",
        "data.max_response_length=24",
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.max_batch_size=8",
    )
    marker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    process = start_cli(*args)
    deadline = time.monotonic() + 900
    try:
        while not (marker.exists() and marker.read_text().strip() == "1"):
            assert process.poll() is None, f"ended before the step-1 checkpoint:\n{cli_output(process)}"
            assert time.monotonic() < deadline, "no checkpoint within 15 minutes"
            time.sleep(0.5)
    finally:
        kill_tree(process)
    partials = read_partials(run_dir / "checkpoints" / "global_step_1")
    assert partials and any(p["stop_reason"] is None for p in partials), "no request was in flight at the checkpoint"
    (run_dir / "areal_samples.jsonl").rename(run_dir / "killed.areal_samples.jsonl")
    run_cli(*args)
    saved = {(p["uid"], p["session"]): p for p in partials}
    continued = []
    for sample in read_jsonl(run_dir / "areal_samples.jsonl"):
        uid, session, _ = sample["key"].rsplit("_", 2)
        partial = saved.get((uid, int(session)))
        if partial is not None and partial["stop_reason"] is None:
            assert sample["chunks"][: len(partial["chunks"])] == partial["chunks"], (sample, partial)
            assert len(sample["chunks"]) > len(partial["chunks"])  # and went on after the resume
            continued.append(partial)
    assert continued, "no trained answer continued a request the checkpoint kept"
