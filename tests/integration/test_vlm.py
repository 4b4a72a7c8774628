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
