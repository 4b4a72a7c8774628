"""A mixture-of-experts model through the async trainer: the tiny Qwen2-MoE (4 experts, 2 per token, a shared
expert) trains on ``areal_cpu`` with router replay on, every update checked, the engines returning each token's
experts. Full tier (one verl start)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import REPO, read_jsonl, run_cli, train_tiny

pytestmark = [pytest.mark.integration, pytest.mark.full]
MOE_DIR = REPO / ".areal" / "tiny_moe"
STEPS = 3


@pytest.fixture(scope="module")
def moe_dir():
    run_cli("build-tiny", "--workload", "moe", "--out", str(MOE_DIR), timeout=1800)
    return MOE_DIR


def test_a_moe_model_trains_asynchronously_with_router_replay_and_every_update_checked(moe_dir, tmp_path):
    import json

    config = json.loads((moe_dir / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["num_experts"] == 4, config
    run_dir = tmp_path / "run"
    steps = train_tiny(
        "grpo_cpu_async.yaml",
        run_dir,
        moe_dir,
        STEPS,
        "++actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    )
    assert [s["training/global_step"] for s in steps] == list(range(1, STEPS + 1))
    # The engine generated (a step whose batch was all admitted ahead, η = 2, may see no tokens in its own window).
    assert any(s["areal/gen_tokens_per_s"] > 0 for s in steps)
    assert max(s["areal/staleness_max"] for s in steps) <= 2
    # Every version reached the engine and was checked there (that the check covers the expert tensors is
    # test_tiny_moe.py's).
    updates = [e for e in read_jsonl(run_dir / "weight_syncs.jsonl") if e["event"] == "update"]
    assert sorted({e["version"] for e in updates}) == list(range(STEPS + 1)), updates
