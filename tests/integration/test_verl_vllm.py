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

from tests.integration.conftest import REPO, read_jsonl, train_args

pytestmark = pytest.mark.integration

VERL_VLLM_PYTHON = REPO / ".venv-verl-vllm" / "bin" / "python"


def train_with_verl_vllm(
    run_dir: Path, tiny_dir: Path, steps: int, *overrides: str, recipe: str = "grpo_cpu_async.yaml"
) -> subprocess.CompletedProcess:
    if not VERL_VLLM_PYTHON.exists():
        pytest.fail(f"{VERL_VLLM_PYTHON} is missing: run bash tools/setup.sh (it builds .venv-verl-vllm)")
    args = train_args(recipe, run_dir, tiny_dir, steps, "actor_rollout_ref.rollout.name=vllm", *overrides)
    return subprocess.run(
        [str(VERL_VLLM_PYTHON), "-m", "areal_plugins.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def test_verls_vllm_trains_checks_every_update_and_stops_on_a_weight_corrupted_in_transit(tiny_dir, tmp_path):
    """Temperature 0.7, η = 2, colocated. The first three updates (the start, after steps 1 and 2) arrive intact
    and are checked on the vLLM worker; from the fourth on (after step 3, before its metrics are written), the
    worker changes one received value of ``model.norm.weight`` (fault injection on the receiving side), and the
    run must stop naming the replica, the worker and the tensor."""
    run_dir = tmp_path / "run"
    result = train_with_verl_vllm(
        run_dir,
        tiny_dir,
        5,
        "actor_rollout_ref.rollout.temperature=0.7",
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


def test_verls_vllm_in_its_own_pool_gets_every_update_through_the_checkpoint_engine_checked(tiny_dir, tmp_path):
    """``placement: separate``: verl's standalone vLLM replica in a pool of its own, weights broadcast by our
    ``areal_gloo`` checkpoint engine to verl's checkpoint-engine worker, whose adapter (ours) checks what each vLLM
    worker received against what it passed on. Temperature 0.7, η = 2."""
    run_dir = tmp_path / "run"
    result = train_with_verl_vllm(
        run_dir, tiny_dir, 3, "actor_rollout_ref.rollout.temperature=0.7", recipe="grpo_cpu_async_separate.yaml"
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    checked = [r for r in read_jsonl(run_dir / "weight_syncs.jsonl") if r["event"] == "update_checked"]
    assert [r["version"] for r in checked] == [0, 1, 2, 3], checked  # the start, then after each step
    actors = {record["class_name"] for record in read_jsonl(run_dir / "ray_actors.jsonl")}
    assert {"ArealVLLMHttpServer", "CheckpointEngineWorker"} <= actors, actors
    steps = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [s["training/global_step"] for s in steps] == [1, 2, 3]
    assert steps[0]["training/rollout_probs_diff_max"] < 0.05  # processed log-probs, as colocated
    assert max(s["areal/staleness_max"] for s in steps) <= 2
    assert all(s["areal/gen_tokens_per_s"] > 0 for s in steps)
