"""A plugin installed only through the ``areal_plugins`` entry-point group takes part in a real run."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import run_cli, train_args, train_tiny, with_example_plugin

pytestmark = pytest.mark.integration
STEPS = 2


#: Token budget of one micro-batch: a few of the run's sequences (chat template + prompt + response: up to ~130 tokens).
MICRO_BATCH_TOKENS = 512


@pytest.fixture(scope="module")
def observed_run(tiny_dir, tmp_path_factory):
    """One async run with the example plugin observing (and filtering) and FFD micro-batching on."""
    tmp_path = tmp_path_factory.mktemp("observed")
    log = tmp_path / "observer.jsonl"
    steps = train_tiny(
        "grpo_cpu_async.yaml",
        tmp_path / "run",
        tiny_dir,
        STEPS,
        f"areal.micro_batch.max_tokens={MICRO_BATCH_TOKENS}",
        env=with_example_plugin(AREAL_EXAMPLE_OBSERVER_LOG=str(log), AREAL_EXAMPLE_OBSERVER_MIN_REWARD="0.5"),
    )
    return steps, [json.loads(line) for line in log.read_text().splitlines()], tmp_path / "run"


def test_hooks_see_every_weight_version_and_step(observed_run):
    steps, events, _ = observed_run
    # The plugin judged finished, scored trajectories; the wrong ones it rejected never reached training.
    verdicts = [e for e in events if e["event"] == "accept_trajectory"]
    assert {e["reward"] for e in verdicts} == {0.0, 1.0}
    assert all(e["kept"] == (e["reward"] >= 0.5) for e in verdicts)
    rejected = steps[-1]["areal/rejected_trajectories"]
    assert rejected > 0
    assert all(s["critic/score/min"] == 1.0 for s in steps), "a rejected trajectory was trained on"
    # The initial sync serves version 0; each step then pushes its weights as version = step.
    assert [e["version"] for e in events if e["event"] == "weights_updated"] == list(range(STEPS + 1))
    assert [e["step"] for e in events if e["event"] == "after_train_step"] == list(range(1, STEPS + 1))
    assert events[-1] == {"event": "shutdown", "reason": "completed"}
    # A metric the plugin added in areal_after_train_step reached verl's logger.
    assert [s["example_observer/step_seen"] for s in steps] == list(range(1, STEPS + 1))


def test_ffd_micro_batches_and_reward_service_metrics(observed_run):
    steps, _, run_dir = observed_run
    packs = [json.loads(line) for line in (run_dir / "micro_batches.jsonl").read_text().splitlines()]
    # verl's actor split its batches through our FFD packing, within the budget, every sequence once.
    assert packs and all(p["capacity"] == MICRO_BATCH_TOKENS for p in packs)
    assert all(max(p["tokens"]) <= MICRO_BATCH_TOKENS and sum(p["sizes"]) == p["sequences"] for p in packs)
    assert any(p["micro_batches"] > 1 for p in packs)
    # The reward service's per-trajectory reports became step metrics in verl's logger.
    assert all(s["areal/reward_latency_s_mean"] > 0 and s["areal/reward_failed"] == 0 for s in steps)


def test_a_raising_plugin_stops_the_run_naming_plugin_and_hook(tiny_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        *train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, 1),
        env=with_example_plugin(AREAL_EXAMPLE_OBSERVER_RAISE="1"),
        check=False,
    )
    assert result.returncode != 0
    log = (run_dir / "train.log").read_text()
    assert "plugin 'example_observer' raised in hook areal_after_train_step" in log
    assert "the example observer was told to fail" in log


def test_excluded_plugin_is_not_called(tiny_dir, tmp_path):
    log = tmp_path / "observer.jsonl"
    train_tiny(
        "grpo_cpu_async.yaml",
        tmp_path / "run",
        tiny_dir,
        1,
        "areal.mode=sync",
        "areal.plugins.exclude=[example_observer]",
        env=with_example_plugin(AREAL_EXAMPLE_OBSERVER_LOG=str(log), AREAL_EXAMPLE_OBSERVER_RAISE="1"),
    )
    assert not log.exists()
