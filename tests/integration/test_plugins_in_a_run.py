"""A plugin installed only through the ``areal_plugins`` entry-point group takes part in a real run."""

from __future__ import annotations

import pytest

from tests.integration.conftest import (
    MICRO_BATCH_TOKENS,
    OBSERVED_STEPS,
    REPO,
    read_jsonl,
    run_cli,
    train_args,
    with_example_plugin,
)

pytestmark = pytest.mark.integration


def test_a_stock_shaped_recipe_trains_on_verls_default_engine_fsdp1_with_our_loss_and_micro_batches(observed_run):
    """The observed run's recipe sets no trainer engine (tests/user_recipe.py:stock_recipe): verl composed its
    default ``fsdp`` (FSDP1, ``trainer/config/actor/dp_actor.yaml``), and our loss, micro-batching and progress
    reports ran in it (the micro-batches' own checks: test_micro_batch_partitioner_and_reward_service_metrics)."""
    import yaml

    steps, _, run_dir = observed_run
    composed = yaml.safe_load((run_dir / "hydra" / ".hydra" / "config.yaml").read_text())
    assert "strategy" not in (REPO / "recipes" / "_cpu_grpo_tiny.yaml").read_text().split("# @package")[1]
    assert composed["actor_rollout_ref"]["actor"]["strategy"] == "fsdp"
    assert not composed["areal"].keys() - {"enable", "max_staleness", "micro_batch"}  # only what the command line gave
    assert composed["trainer"]["v1"]["trainer_mode"] == "sync"  # as composed; areal.enable routed it at validation
    log = (run_dir / "train.log").read_text()
    assert "areal.enable=true routed trainer.v1.trainer_mode='areal_async'" in log
    assert all(s["actor/areal/behav_imp_weight_mean"] > 0 for s in steps)  # our decoupled loss, every step
    packs = read_jsonl(run_dir / "micro_batches.jsonl")
    assert len(packs) >= OBSERVED_STEPS and all(p["capacity"] == MICRO_BATCH_TOKENS for p in packs)


def test_hooks_see_every_weight_version_and_step(observed_run):
    steps, events, _ = observed_run
    # The plugin judged finished, scored trajectories; the wrong ones it rejected never reached training.
    verdicts = [e for e in events if e["event"] == "accept_trajectory"]
    assert {e["reward"] for e in verdicts} == {0.0, 1.0}
    assert all(e["kept"] == (e["reward"] >= 0.5) for e in verdicts)
    rejected = steps[-1]["areal/rejected_trajectories"]
    assert rejected > 0
    assert all(s["critic/score/min"] == 1.0 for s in steps), "a rejected trajectory was trained on"
    # With an accept hook installed every settled group's rows are read back for it, none from summaries.
    assert steps[-1]["areal/settled_from_reports"] == 0 and steps[-1]["areal/settled_from_rows"] > 0
    # The initial sync serves version 0; each step then pushes its weights as version = step.
    assert [e["version"] for e in events if e["event"] == "weights_updated"] == list(range(OBSERVED_STEPS + 1))
    assert [e["step"] for e in events if e["event"] == "after_train_step"] == list(range(1, OBSERVED_STEPS + 1))
    assert events[-1] == {"event": "shutdown", "reason": "completed"}
    # A metric the plugin added in areal_after_train_step reached verl's logger.
    assert [s["example_observer/step_seen"] for s in steps] == list(range(1, OBSERVED_STEPS + 1))


def test_the_plugin_is_loaded_in_the_worker_processes_too(observed_run):
    _, events, _ = observed_run
    # The trainer workers asked the loss hook, the reward workers the reward hook: other processes.
    loss_pids = {e["pid"] for e in events if e["event"] == "make_policy_loss"}
    reward_pids = {e["pid"] for e in events if e["event"] == "make_reward_fn"}
    assert loss_pids and reward_pids and not loss_pids & reward_pids


def test_micro_batch_partitioner_and_reward_service_metrics(observed_run):
    steps, _, run_dir = observed_run
    packs = read_jsonl(run_dir / "micro_batches.jsonl")
    # verl's actor split its batches through our packing, every sequence once; the CPU recipes pad each
    # micro-batch (use_remove_padding: false), so the runs of like length hold the budget counted padded.
    assert packs and all(p["capacity"] == MICRO_BATCH_TOKENS and p["strategy"] == "padded_runs" for p in packs)
    assert all(max(p["padded_tokens"]) <= MICRO_BATCH_TOKENS and sum(p["sizes"]) == p["sequences"] for p in packs)
    assert any(p["micro_batches"] > 1 for p in packs)
    # The reward service's per-trajectory reports became step metrics in verl's logger.
    assert all(s["areal/reward_latency_s_mean"] > 0 and s["areal/reward_failed"] == 0 for s in steps)


@pytest.mark.full
def test_a_users_recipe_is_routed_and_a_raising_plugin_stops_the_run_naming_plugin_and_hook(tiny_dir, tmp_path):
    # The recipe has no areal config group: only the routing at verl's startup turns areal.enable into
    # our areal_sync trainer (verl's sync trainer with our hooks), whose hook call then meets the failure.
    import shutil

    from tests.integration.conftest import REPO
    from tests.user_recipe import user_recipe

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    shutil.copy(REPO / "recipes" / "_cpu_grpo_tiny.yaml", recipes)
    (recipes / "my_recipe.yaml").write_text(user_recipe(mode="sync"))
    run_dir = tmp_path / "run"
    args = train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, 1)
    args[1] = str(recipes / "my_recipe.yaml")
    result = run_cli(*args, env=with_example_plugin(AREAL_EXAMPLE_OBSERVER_RAISE="1"), check=False)
    assert result.returncode != 0
    log = (run_dir / "train.log").read_text()
    assert "areal.enable=true routed trainer.v1.trainer_mode='areal_sync'" in log
    assert "plugin 'example_observer' raised in hook areal_after_train_step" in log
    assert "the example observer was told to fail" in log
