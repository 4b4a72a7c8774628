"""verl's own vLLM rollout (``rollout.name=vllm``) under ``areal_async``, end to end on CPU, with no waiver.

It runs in ``.venv-verl-vllm`` (verl's environment plus vLLM's CPU build, made by tools/setup.sh): verl's replica,
server and weight transport, with our subclasses (rollout/verl_vllm/) adding each worker's checksum of the
weights it received and the generated-token counts.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import (
    REPO,
    SYNC_STEPS,
    assert_float32_losses_match,
    assert_same_samples_each_step,
    assert_schedule_is_consistent,
    read_jsonl,
    run_cli_process,
    train_args,
)

pytestmark = pytest.mark.integration

VERL_VLLM_PYTHON = REPO / ".venv-verl-vllm" / "bin" / "python"


def train_with_verl_vllm(
    run_dir: Path, tiny_dir: Path, steps: int, *overrides: str, recipe: str = "grpo_cpu_async.yaml"
) -> subprocess.CompletedProcess:
    if not VERL_VLLM_PYTHON.exists():
        pytest.fail(f"{VERL_VLLM_PYTHON} is missing: run bash tools/setup.sh (it builds .venv-verl-vllm)")
    args = train_args(recipe, run_dir, tiny_dir, steps, "actor_rollout_ref.rollout.name=vllm", *overrides)
    return run_cli_process(str(VERL_VLLM_PYTHON), *args, timeout=1200)


#: The tiny model's 8 linear weights (4 per layer, 2 layers), as vLLM fuses them.
LINEAR_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def assert_loaded_check_covers_the_tiny_model(checksum: dict) -> None:
    """After loading, each of the tiny model's 17 vLLM parameters is compared with what was received, or counted
    as not compared. Always compared: the embedding, the lm_head tied to it, each layer's qkv bias and 2 norms,
    the final norm (9). The 8 linear weights depend on the CPU: where vLLM's CPU build repacks them into its
    kernels' own state (oneDNN or the sgl kernels, e.g. on AVX-512 machines), they are not readable and are counted
    as not compared; where it keeps the plain weight (seen on an AVX2-only machine), they are compared too."""
    compared, not_compared = checksum["loaded_compared"], checksum["loaded_not_compared"]
    assert compared + not_compared == 17 and compared >= 9, checksum
    examples = checksum["loaded_not_compared_examples"]
    assert len(examples) == min(not_compared, 12), checksum
    # Under LoRA the base arrives under peft's names (``...down_proj.base_layer.weight``), reported as sent.
    names = [name.replace(".base_layer.", ".") for name in examples]
    assert all(name.endswith(".weight") and name.split(".")[-2] in LINEAR_WEIGHTS for name in names), examples


def test_verls_vllm_trains_checks_every_update_and_stops_on_a_weight_corrupted_in_transit(
    tiny_dir, long_response_model, tmp_path
):
    """Temperature 0.7, η = 2, colocated, a model that rarely ends its answers and an engine that decodes 48
    requests at a time, started a few per step (so the end of sampling finds requests mid-generation). The first
    three updates (the start, after steps 1-2) arrive intact and are checked on the vLLM worker; from the fourth on
    (after step 3, before its metrics are written), the worker changes one received value of ``model.norm.weight``
    (fault injection on the receiving side), and the run must stop naming the replica, the worker and the tensor."""
    run_dir = tmp_path / "run"
    result = train_with_verl_vllm(
        run_dir,
        tiny_dir,
        5,
        "actor_rollout_ref.rollout.temperature=0.7",
        f"actor_rollout_ref.model.path={long_response_model}",
        "data.max_response_length=24",
        # vLLM decodes at most 48 requests at a time and prefills at most 96 - 48 prompt tokens (~3 prompts of 17)
        # a step: requests start a few per step, so they finish a few per step and, when sampling ends, most of the
        # 48 running are mid-answer. (With all 48 starting together, all 48 finish together: the abort then finds
        # the next 48 only as far as one step got, and on a fast CPU it found none with output.)
        "actor_rollout_ref.rollout.max_num_seqs=48",
        "actor_rollout_ref.rollout.max_num_batched_tokens=96",
        # And by construction, on any machine: under each version only the first 16 prompt groups (the trainer's
        # batch) finish; the others stop after 4 tokens and wait for the abort that ends sampling (our server, for
        # tests). A fast engine had finished all 48 groups of version 0 before the trainer took its batch.
        "++actor_rollout_ref.rollout.custom.areal_finish_groups_per_version=16",
        "++actor_rollout_ref.rollout.custom.areal_hold_others_at_token=4",
        "++ray_kwargs.ray_init.runtime_env.env_vars.AREAL_CORRUPT_RECEIVED_WEIGHT='model.norm.weight@4'",
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert (
        "rollout replica 0, vLLM worker rank 0: tensor model.norm.weight arrived different from what the trainer sent"
        in output
    ), output[-3000:]

    # Before the fault: three updates, each compared tensor by tensor on the worker.
    checked = [r for r in read_jsonl(run_dir / "weight_syncs.jsonl") if r["event"] == "update_checked"]
    assert [r["version"] for r in checked] == [0, 1, 2], checked
    assert all(r["checksum"]["workers"] == [0] and r["checksum"]["tensors"] >= 20 for r in checked)
    for record in checked:
        assert_loaded_check_covers_the_tiny_model(record["checksum"])
    steps = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [s["training/global_step"] for s in steps] == [1, 2]
    # Behaviour log-probs after temperature (verl asks vLLM for processed log-probs): at step 1 nothing is stale,
    # so they equal the trainer's recomputation up to kernel differences (measured 0.009; vLLM's raw log-probs: 0.18).
    assert steps[0]["areal/staleness_max"] == 0
    assert steps[0]["training/rollout_probs_diff_max"] < 0.05, steps[0]["training/rollout_probs_diff_max"]
    # Progress by tokens: our server subclass counts what verl's server generated.
    assert sum(s["areal/gen_tokens_per_s"] for s in steps) > 0
    # The staleness bound holds on verl's engine too.
    assert max(s["areal/staleness_max"] for s in steps) <= 2
    # verl's engine aborts in-flight requests when sampling ends (colocated: before the engines sleep); our client
    # continues each as prompt + partial output under the next version, and stamps each part with the version its
    # server ran: a trajectory's versions change only where it was interrupted, one version per weight update.
    samples = read_jsonl(run_dir / "areal_samples.jsonl")
    spanning = [s for s in samples if s["tail_version"] > s["head_version"]]
    assert spanning, "no trajectory was interrupted by a weight update and continued"
    # The first abort (end of step 1) finds ~48 running, ~3 started per step over 24-token answers: most are
    # mid-answer (measured 44 of them continued under version 1; 0 when all 48 started together, in CI).
    assert sum(1 for s in spanning if s["head_version"] == 0) >= 16, len(spanning)
    assert all(1 <= s["tail_version"] - s["head_version"] <= s["num_interrupts"] for s in samples if s in spanning)
    assert all(s["tail_version"] <= s["trainer_version"] for s in samples)
    # The schedule a replay follows: each sample's requests; vLLM unseeded (no areal_seeded_sampling) says no seed.
    for sample in samples:
        assert_schedule_is_consistent(sample, seeded=False)
    assert all(len(s["chunks"]) >= 2 for s in spanning)


def test_verls_vllm_in_its_own_pool_gets_every_update_checked_and_stops_on_a_bad_load(tiny_dir, tmp_path):
    """``placement: separate``: verl's standalone vLLM replica in a pool of its own, weights broadcast by our
    ``areal_gloo`` checkpoint engine to verl's checkpoint-engine worker, whose adapter (ours) checks what each vLLM
    worker received against what it passed on, and what the worker holds after loading against what it received.
    Each update is staged in the worker while the engine generates, its broadcast leg compared with what the
    trainer sent, then loaded. Temperature 0.7, η = 2. The transfer bucket (1 MB, verl's smallest) is smaller than
    the embedding and lm_head (8.4 MB each), so those two cross verl's bucketed transfer in pieces and are joined
    before the check and the load (the path a 7B run's 2 GiB float32 embedding takes). The third update (after step
    2) arrives intact but one value of ``model.norm.weight`` changes after loading (fault injection in the worker):
    the run must stop naming it."""
    run_dir = tmp_path / "run"
    result = train_with_verl_vllm(
        run_dir,
        tiny_dir,
        3,
        "actor_rollout_ref.rollout.temperature=0.7",
        "++actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
        "++ray_kwargs.ray_init.runtime_env.env_vars.AREAL_CORRUPT_LOADED_WEIGHT='model.norm.weight@3'",
        recipe="grpo_cpu_async_vllm.yaml",
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert (
        "rollout replica 0, vLLM worker rank 0: parameter model.norm.weight holds after loading something other "
        "than what it received" in output
    ), output[-3000:]
    checked = [r for r in read_jsonl(run_dir / "weight_syncs.jsonl") if r["event"] == "update_checked"]
    assert [r["version"] for r in checked] == [0, 1], checked  # the start, then after step 1
    for record in checked:
        assert_loaded_check_covers_the_tiny_model(record["checksum"])
        # Larger than the bucket (8.4 MB each; the next largest tensor is 128 KiB): cut, carried, joined, checked.
        assert sorted(record["checksum"]["joined"]) == ["lm_head.weight", "model.embed_tokens.weight"], record
    # Each update that loaded was staged first and its broadcast leg compared before the load (the record is
    # written once the engines resume, so the third, whose load failed, has none): 27 tensors, the embedding,
    # 12 per layer for 2 layers (q/k/v weights and biases, o, gate, up, down, 2 norms), the final norm and
    # lm_head (sent though tied).
    transfers = read_jsonl(run_dir / "weight_transfers.jsonl")
    assert [t["version"] for t in transfers] == [0, 1], transfers
    assert all(t["transfer_checked_tensors"] == 27 and t["workers"] == 1 for t in transfers), transfers
    actors = {record["class_name"] for record in read_jsonl(run_dir / "ray_actors.jsonl")}
    assert {"ArealVLLMHttpServer", "CheckpointEngineWorker"} <= actors, actors
    steps = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    # separate: step 2's metrics line races the failing sync (seen both ways)
    assert [s["training/global_step"] for s in steps] in ([1], [1, 2])
    assert steps[0]["training/rollout_probs_diff_max"] < 0.05  # processed log-probs, as colocated
    assert max(s["areal/staleness_max"] for s in steps) <= 2
    assert all(s["areal/gen_tokens_per_s"] > 0 for s in steps)


#: What both runs of the η = 0 pair share: temperature 0.7, each request seeded by its prompt (our server), float32
#: in the engine (so that the logits barely depend on which requests share a batch), verl's dump of every sample.
SEEDED_AT_07 = (
    "actor_rollout_ref.rollout.temperature=0.7",
    "++actor_rollout_ref.rollout.custom.areal_seeded_sampling=true",
    "actor_rollout_ref.rollout.dtype=float32",
)


def seeded_run(run_dir: Path, tiny_dir: Path, data: Path, *overrides: str) -> list[dict]:
    result = train_with_verl_vllm(
        run_dir,
        tiny_dir,
        SYNC_STEPS,
        *SEEDED_AT_07,
        f"data.train_files={data}",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        *overrides,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.mark.full
def test_eta0_on_verls_vllm_trains_the_samples_and_losses_of_synchronous_verl_at_temperature_07(
    tiny_dir, distinct_prompts, tmp_path
):
    """verl's synchronous trainer (``areal.mode=sync``: verl's trainer with our hooks, none installed) against
    ``areal_async`` at η = 0, both on verl's vLLM engine with the same seeds: the same samples at each step, and
    losses within float tolerance (verl's vanilla PPO against our decoupled objective, whose weights are 1 at η = 0)."""
    sync = seeded_run(tmp_path / "sync", tiny_dir, distinct_prompts, "areal.mode=sync")
    eta0 = seeded_run(tmp_path / "eta0", tiny_dir, distinct_prompts, "areal.max_staleness=0")
    assert_same_samples_each_step(tmp_path / "sync", tmp_path / "eta0")
    assert_float32_losses_match(sync, eta0)


@pytest.mark.full
def test_a_mixture_of_experts_trains_on_verls_vllm_with_every_expert_checked_and_its_routes_replayed(moe_dir, tmp_path):
    """The tiny Qwen2-MoE (4 experts, 2 per token, a shared expert) on verl's ``vllm``, colocated, with router
    replay on: every update's per-expert tensors (verl's ``unfuse_moe_params`` names) load into vLLM's fused
    ``w13_weight`` / ``w2_weight`` and are compared there by their sums (rollout/verl_vllm/loaded_weights.py), with
    the CPU build's experts packed again on every reload (patches/vllm_cpu_moe_reload.py); the routes vLLM recorded
    reach verl's FSDP engine and are replayed there (the CLI runs the CPU engine eager: compiled, it records none)."""
    run_dir = tmp_path / "run"
    result = train_with_verl_vllm(run_dir, moe_dir, 3, "++actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    checked = [r for r in read_jsonl(run_dir / "weight_syncs.jsonl") if r["event"] == "update_checked"]
    assert [r["version"] for r in checked] == [0, 1, 2, 3], checked
    for record in checked:
        examples = record["checksum"]["loaded_not_compared_examples"]
        assert not any("w13_weight" in name or "w2_weight" in name for name in examples), record
    steps = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [s["training/global_step"] for s in steps] == [1, 2, 3]
    # The engine samples with the weights it was sent: step 1's fresh samples' log-probs match the trainer's (as on
    # the dense model; later steps train stale samples, whose difference is the policy's change). Measured: 0.009.
    assert steps[0]["training/rollout_probs_diff_max"] < 0.05, steps[0]
    # The 4 fused expert parameters (w13, w2 of 2 layers) compared, beside what the dense model's check compares.
    assert all(record["checksum"]["loaded_compared"] >= 13 for record in checked), checked
    # Every trained trajectory carried its routes, and every step replayed them.
    samples = read_jsonl(run_dir / "areal_samples.jsonl")
    assert samples and all(s["routed_experts_rows"] > 0 for s in samples), samples[:2]
    assert all(s["actor/areal/router_replay_routes"] > 0 for s in steps), steps
    # Step 1 trains fresh samples: the trainer's own routers, with the weights the engine was sent, choose what vLLM
    # recorded but for near ties (routes never recorded, say all zeros, would change every one).
    assert steps[0]["actor/areal/router_replay_changed_fraction"] < 0.05, steps[0]
