"""One flag (areal.enable: true) puts the decoupled objective into verl's trainer; its behaviour
importance weights are exactly 1 on fresh samples and move away from 1 on stale ones."""

from __future__ import annotations

import pytest

from tests.integration.conftest import train_tiny

pytestmark = pytest.mark.integration
STEPS = 4
STALENESS_MAX = "areal/staleness_max"  # trainer version - head version of the oldest consumed token
WEIGHT_MAX = "actor/areal/behav_imp_weight_max"
WEIGHT_MEAN = "actor/areal/behav_imp_weight_mean"


@pytest.fixture(scope="module")
def async_run(tiny_dir, tmp_path_factory) -> list[dict]:
    return train_tiny("grpo_cpu_async.yaml", tmp_path_factory.mktemp("async_run"), tiny_dir, STEPS)


def test_decoupled_stats_are_logged_every_step(async_run):
    assert len(async_run) == STEPS
    for step in async_run:
        for key in (WEIGHT_MEAN, WEIGHT_MAX, "actor/areal/clip_frac", "actor/areal/behav_imp_weight_capped_frac"):
            assert key in step, f"{key} missing: is policy loss areal_decoupled in use?"


def test_weights_respond_to_staleness(async_run):
    stale = [s for s in async_run if s[STALENESS_MAX] >= 1]
    fresh = [s for s in async_run if s[STALENESS_MAX] == 0]
    assert stale and fresh, "areal_async (eta=2) should consume a fresh first batch, then stale ones"
    for step in fresh:  # behaviour = proximal: the engine and the trainer scored with the same weights
        assert abs(step[WEIGHT_MAX] - 1) < 1e-4
    for step in stale:  # one or more optimizer steps apart: w = pi_prox / pi_behav != 1
        assert abs(step[WEIGHT_MAX] - 1) > 1e-3
