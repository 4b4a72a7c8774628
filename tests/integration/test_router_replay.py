"""Router replay (R3) through verl's trainer: with routes that differ by construction, step 1's log-probs match the
engine's only with replay.

The tiny Qwen2-MoE's engine routers prefer expert 0 in their choice (``test_router_choice_bias``,
areal_plugins/testing/router_bias.py), the trainer's do not. Step 1 trains fresh samples (every token of version
0, the trainer at version 0), so verl's ``training/rollout_probs_diff_max`` (engine vs trainer probability of each
sampled token) measures routing alone. Measured 2026-12-07 (2-core box): with replay 1.19e-06 (the unbiased MoE
run's own 1.31e-06: float32 noise), without 0.139, with 83% of routes flipped by the bias
(docs/results/router_replay.md).
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import train_tiny

pytestmark = [pytest.mark.integration, pytest.mark.full]

BIAS = "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.test_router_choice_bias=[0,3.0]"
REPLAY = "++actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
#: float32 agreement of one token's probability between two forward passes of the same weights and routes (the
#: engine decodes with a KV cache, the trainer runs the whole sequence): a few float32 ulps of a probability <= 1.
FLOAT32_AGREEMENT = 1e-5


def test_replayed_routes_bring_the_trainers_probabilities_to_the_engines(moe_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp("router_replay")
    replayed = train_tiny("grpo_cpu_async.yaml", runs / "replayed", moe_dir, 1, BIAS, REPLAY)[0]
    unreplayed = train_tiny("grpo_cpu_async.yaml", runs / "unreplayed", moe_dir, 1, BIAS)[0]
    # The construction worked: the trainer alone would have chosen other experts for many routes.
    assert replayed["actor/areal/router_replay_changed_fraction"] > 0.1, replayed
    assert replayed["training/rollout_probs_diff_max"] < FLOAT32_AGREEMENT, replayed
    assert unreplayed["training/rollout_probs_diff_max"] > 100 * FLOAT32_AGREEMENT, unreplayed
    assert "actor/areal/router_replay_routes" not in unreplayed  # nothing replayed without the key
