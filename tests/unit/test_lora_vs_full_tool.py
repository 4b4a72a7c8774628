"""tools/lora_vs_full.py's arithmetic and overrides, on runs written by hand."""

from __future__ import annotations

import pytest

from tests.unit.tool_scripts import load_tool

tool = load_tool("lora_vs_full")


def test_the_lora_arm_trains_a_rank_8_adapter_at_ten_times_the_full_rate():
    assert tool.arm_overrides("full", 10.0) == ["actor_rollout_ref.actor.optim.lr=0.0002"]
    assert tool.arm_overrides("lora", 10.0) == [
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=0.002",
    ]


def test_the_summary_is_per_arm_over_seeds():
    def run(arm, seed, validation, reward, seconds):
        return {"arm": arm, "seed": seed, "validation": validation, "reward": reward, "seconds_per_step": seconds}

    runs = {
        "lora-seed0": run("lora", 0, [(0, 0.10), (8, 0.20)], [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5)], 10.0),
        "lora-seed1": run("lora", 1, [(0, 0.12), (8, 0.30)], [(1, 0.2), (2, 0.2), (3, 0.6), (4, 0.6)], 12.0),
    }
    row = tool.summarize(runs, window=2)["lora"]
    assert row["seeds"] == 2
    # Hand: gains 0.10 and 0.18; first two rewards 0.15 and 0.2, last two 0.45 and 0.6.
    assert row["validation_gain"]["mean"] == pytest.approx(0.14)
    assert (row["validation_gain"]["min"], row["validation_gain"]["max"]) == pytest.approx((0.10, 0.18))
    assert row["reward_first_steps"]["mean"] == pytest.approx(0.175)
    assert row["reward_last_steps"]["mean"] == pytest.approx(0.525)
    assert row["seconds_per_step"]["mean"] == pytest.approx(11.0)
    table = tool.markdown_table({"summary": {"lora": row}, "lr": {"lora": 0.002}})
    assert "| lora | 0.002 | 2 | 0.110 (0.100 to 0.120) | 0.250 (0.200 to 0.300) |" in table
