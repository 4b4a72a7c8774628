"""tools/ablation.py's reading of runs: drift per setting, the regime rule, the per-objective summary."""

from __future__ import annotations

import pytest

from tests.unit.tool_scripts import load_tool

ablation = load_tool("ablation")


def row(step: int, **data: float) -> dict:
    return {"step": step, "data": data}


KL, WMAX, REWARD = "actor/areal/approx_kl_prox_behav", "actor/areal/behav_imp_weight_max", "critic/score/mean"


def test_drift_averages_each_metric_but_takes_the_largest_weight_and_staleness():
    rows = [
        row(1, **{KL: 0.0, WMAX: 1.0, "areal/staleness_max": 0.0}),
        row(2, **{KL: 0.3, WMAX: 7.0, "areal/staleness_max": 4.0}),
        row(3, **{KL: 0.6, WMAX: 2.0, "areal/staleness_max": 3.0}),
    ]
    measured = ablation.drift(rows)
    assert measured["kl_prox_behav"] == pytest.approx(0.3)  # (0 + 0.3 + 0.6) / 3
    assert measured["w_max"] == 7.0 and measured["staleness_max"] == 4.0
    assert "capped_frac" not in measured  # absent from every row: not invented


def test_the_regime_is_the_largest_drift_that_still_learns():
    settings = [
        {"lr": 1e-3, "mini_batch": 4, "drift": {"kl_prox_behav": 0.9}, "learns": False},  # collapsed
        {"lr": 5e-4, "mini_batch": 4, "drift": {"kl_prox_behav": 0.4}, "learns": True},
        {"lr": 2e-4, "mini_batch": 16, "drift": {"kl_prox_behav": 0.1}, "learns": True},
    ]
    assert ablation.choose_regime(settings)["lr"] == 5e-4
    assert ablation.choose_regime([settings[0]]) is None


def test_learning_compares_the_last_three_steps_with_the_first_three():
    assert ablation.learns([0.1, 0.2, 0.3, 0.2, 0.2, 0.2])  # 0.2 vs 0.2
    assert not ablation.learns([0.3, 0.3, 0.3, 0.1, 0.2, 0.2])
    assert not ablation.learns([0.1, 0.5])  # too short to judge


def test_validation_accuracy_is_read_from_verls_val_core_metric_by_step():
    rows = [
        row(0, **{"val-core/addition/acc/mean@1": 0.5}),
        row(1, **{REWARD: 0.2}),
        row(10, **{"val-core/addition/acc/mean@1": 0.6}),
    ]
    assert ablation.validation_accuracy(rows) == [(0, 0.5), (10, 0.6)]


def test_summary_gives_each_objective_its_seed_mean_and_range():
    runs = {
        f"eta8-standard-seed{seed}": {
            "eta": 8,
            "objective": "standard",
            "seed": seed,
            "validation": [(0, 0.5), (20, final)],
            "reward": [(step, 0.1 * seed) for step in range(1, 6)],
            "drift": {},
        }
        for seed, final in enumerate([0.4, 0.7, 0.55])
    }
    summary = ablation.summarize(runs, window=2)["eta8-standard"]
    assert summary["seeds"] == 3
    assert summary["final_validation"] == pytest.approx({"mean": 0.55, "min": 0.4, "max": 0.7})
    assert summary["final_reward"] == pytest.approx({"mean": 0.1, "min": 0.0, "max": 0.2})
    assert summary["kl_prox_behav"] is None


def test_staleness_excess_counts_trajectories_older_than_eta_by_their_oldest_token():
    samples = [
        {"trainer_version": 5, "head_version": 1, "num_interrupts": 2},  # staleness 4 = η: within
        {"trainer_version": 5, "head_version": 0, "num_interrupts": 3},  # 5: one past
        {"trainer_version": 6, "head_version": 0, "num_interrupts": 0},  # 6: two past
        {"trainer_version": 6, "head_version": 6, "num_interrupts": 0},
    ]
    measured = ablation.staleness_excess(samples, eta=4)
    assert measured == {
        "trajectories": 4,
        "over_eta_fraction": 0.5,
        "max_excess": 2.0,
        "interrupted_fraction": 0.5,
    }


def test_the_readme_tables_print_the_committed_numbers(tmp_path):
    import json

    (tmp_path / "staleness_guarantee.json").write_text(
        json.dumps(
            {
                "runs": [
                    {
                        "placement": "colocated",
                        "eta": 4,
                        "on_stale": "reissue",
                        "over_eta_fraction": 0.0,
                        "max_excess": 0.0,
                        "reissued_stale_groups": 7.0,
                        "interrupted_fraction": 0.5,
                        "seconds_per_step": 9.04,
                        "final_reward": 0.0444,
                    }
                ]
            }
        )
    )
    table = ablation.markdown_tables(tmp_path)
    assert "| colocated | 4 | reissue | 0.0% | 0 | 7 | 50% | 9.0 | 0.044 |" in table


def test_a_regime_that_loses_accuracy_at_eta_0_is_refused():
    import argparse

    args = argparse.Namespace(lr=5e-4, mini_batch=4)
    with pytest.raises(SystemExit, match=r"does not learn even at η = 0 \(validation accuracy 0.512 -> 0.215\)"):
        ablation.check_learns_synchronously([(0, 0.512), (8, 0.32), (16, 0.215)], args)
    ablation.check_learns_synchronously([(0, 0.512), (16, 0.47)], args)  # within 0.05: kept
