"""One flag (areal.enable: true) puts the decoupled objective into verl's trainer; its behaviour
importance weights are exactly 1 on fresh samples and move away from 1 on stale ones."""

from __future__ import annotations

import pytest

from tests.integration.conftest import OBSERVED_STEPS

pytestmark = pytest.mark.integration
STALENESS_MAX = "areal/staleness_max"  # trainer version - head version of the oldest consumed token
WEIGHT_MAX = "actor/areal/behav_imp_weight_max"
WEIGHT_MEAN = "actor/areal/behav_imp_weight_mean"


def test_decoupled_stats_are_logged_every_step(observed_run):
    steps, _, _ = observed_run
    assert len(steps) == OBSERVED_STEPS
    for step in steps:
        for key in (WEIGHT_MEAN, WEIGHT_MAX, "actor/areal/clip_frac", "actor/areal/behav_imp_weight_capped_frac"):
            assert key in step, f"{key} missing: is policy loss areal_decoupled in use?"


def test_weights_respond_to_staleness(observed_run):
    steps, _, _ = observed_run
    stale = [s for s in steps if s[STALENESS_MAX] >= 1]
    fresh = [s for s in steps if s[STALENESS_MAX] == 0]
    assert stale and fresh, "areal_async (eta=2) should consume a fresh first batch, then stale ones"
    for step in fresh:  # behaviour = proximal: the engine and the trainer scored with the same weights
        assert abs(step[WEIGHT_MAX] - 1) < 1e-4
    for step in stale:  # one or more optimizer steps apart: w = pi_prox / pi_behav != 1
        assert abs(step[WEIGHT_MAX] - 1) > 1e-3
