"""Multi-turn episodes under ``areal_async``: verl's ``tool_agent`` loop with the calculator tool, and a
custom two-turn loop registered the way verl documents, interrupted between and inside turns.

Real verl agent loops, trainer and workers, Ray, TransferQueue, the areal_cpu engine and math-verify.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.integration.conftest import (
    PAIR_PROMPTS,
    SYNC_STEPS,
    assert_bf16_pair_trains_the_same_samples,
    consumed_by_step,
    read_jsonl,
    train_tiny,
    with_example_plugin,
)

pytestmark = pytest.mark.integration

#: Prompts a step in the recipe (the two-turn run; the bf16 pair runs PAIR_PROMPTS); answers per prompt.
BATCH, GROUP = 16, 8


# ---------------------------------------------------------------- verl's tool_agent loop, calculator tool
# The pair (``tool_runs``, in conftest.py) runs in bf16 with packed sequences, as on GPUs.


def test_eta0_multi_turn_trains_the_episodes_and_losses_of_synchronous_verl(tool_runs):
    sync, eta0, _ = tool_runs
    assert any("tool" in output for _, output in consumed_by_step(sync)[1]), "no episode called the tool"
    # The same episodes (step 1 exactly; from step 2 up to bf16's token flips: conftest.py), the same scores where
    # they are the same, and the losses within what bf16 allows: test_gpu_numerics.py (the pair runs in bf16).
    differing = assert_bf16_pair_trains_the_same_samples(sync, eta0)
    for a, b in zip(read_jsonl(sync / "metrics.jsonl"), read_jsonl(eta0 / "metrics.jsonl"), strict=True):
        a, b = a["data"], b["data"]
        if differing[a["training/global_step"]] == 0:
            assert a["critic/score/mean"] == b["critic/score/mean"]


def test_every_generated_token_is_trained_with_its_version_and_the_tools_answer_is_not(tool_runs, calculator_dir):
    from transformers import AutoTokenizer

    _, eta0, episodes_file = tool_runs
    tokenizer = AutoTokenizer.from_pretrained(calculator_dir / "model")
    episodes = read_jsonl(episodes_file)
    assert len(episodes) >= SYNC_STEPS * PAIR_PROMPTS * GROUP
    two_turns = [e for e in episodes if len(e["areal_turn_tokens"]) == 2]
    assert two_turns, "no episode of two turns"
    for episode in episodes:
        turns = episode["areal_turn_tokens"]
        # Trained tokens (response_mask 1) = the tokens the engine generated, turn after turn.
        assert len(episode["response_ids"]) == len(episode["versions"]) == sum(turns)
        # A call between each two turns, and one more when the response limit ended the episode after a call.
        assert len(turns) - 1 <= episode["areal_tool_calls"] <= len(turns)
    for episode in two_turns:
        text = tokenizer.decode(episode["response_ids"])
        assert "<|im_start|>tool" not in text  # the tool's message is context, not trained
        assert text.count("<|im_end|>") == 2  # each turn ends the assistant's message
    # η = 0: step s trains only what version s - 1 generated, in both turns.
    steps = read_jsonl(eta0 / "areal_samples.jsonl")
    assert {(s["head_version"], s["tail_version"]) for s in steps if s["step"] == 2} == {(1, 1)}
    metrics = read_jsonl(eta0 / "areal_steps.jsonl")
    tool_calls = sum(m["areal/tool_calls"] for m in metrics)
    assert tool_calls == sum(s["tool_calls"] for s in steps)
    assert 1.0 < metrics[0]["areal/turns_mean"] <= 2.0


# ---------------------------------------------------------------- a custom two-turn loop, interrupted

TWO_TURN_STEPS = 3
FIRST_TOKENS, SECOND_TOKENS = 4, 20
ENVIRONMENT_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def two_turn_run(tiny_dir, long_response_model, tmp_path_factory) -> dict[str, Path]:
    """η = 1 with the custom loop on a random model (its turns run to their limits): weight updates
    land in the 0.5 s environment step and inside the 20-token second turn. The first attempt of one
    prompt's environment step raises, of another hangs."""
    root = tmp_path_factory.mktemp("two_turn")
    paths = {"run": root / "run", "calls": root / "calls.jsonl", "markers": root / "faults"}
    paths["episodes"] = root / "episodes.jsonl"
    loops = root / "agent_loops.yaml"
    loops.write_text(
        "- name: two_turn\n"
        "  _target_: two_turn_agent_loop.TwoTurnAgentLoop\n"
        f"  calls_log: {paths['calls']}\n"
        f"  marker_dir: {paths['markers']}\n"
        "  tool_seconds: 0.5\n"
        f"  first_tokens: {FIRST_TOKENS}\n"
        f"  second_tokens: {SECOND_TOKENS}\n"
        "  raising: 1\n"
        "  hanging: 1\n"
    )
    train_tiny(
        "grpo_cpu_async.yaml",
        paths["run"],
        tiny_dir,
        TWO_TURN_STEPS,
        "areal.max_staleness=1",
        f"areal.episodes.environment_timeout_s={ENVIRONMENT_TIMEOUT_S}",
        f"actor_rollout_ref.model.path={long_response_model}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=two_turn",
        "data.max_response_length=32",
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.max_batch_size=24",
        env=with_example_plugin(AREAL_EXAMPLE_OBSERVER_EPISODES=str(paths["episodes"])),
    )
    return paths


@pytest.mark.full
def test_an_episode_interrupted_in_its_second_turn_carries_both_versions_on_the_right_tokens(two_turn_run):
    episodes = read_jsonl(two_turn_run["episodes"])
    split_in_turn_two = []
    for episode in episodes:
        versions, (first, second) = episode["versions"], episode["areal_turn_tokens"]
        assert len(episode["response_ids"]) == len(versions) == first + second  # the observation is masked
        assert versions == sorted(versions)  # a token is never older than the one before it
        if len(set(versions[first:])) > 1:
            split_in_turn_two.append(episode)
        # The recorded requests, against the versions the engine stamped on each token: a request starts where
        # each turn starts and wherever the version changes, and runs under one version.
        starts = [start for start, _, _ in episode["areal_chunks"]]
        assert {0, first} <= set(starts) and starts == sorted(starts), episode["areal_chunks"]
        assert {i for i in range(1, len(versions)) if versions[i] != versions[i - 1]} <= set(starts)
        for (start, version, seed), end in zip(episode["areal_chunks"], [*starts[1:], len(versions)], strict=True):
            assert set(versions[start:end]) == {version} and isinstance(seed, int), episode["areal_chunks"]
    assert split_in_turn_two, "no second turn was interrupted by a weight update"
    for episode in split_in_turn_two:
        assert episode["num_interrupts"] >= 1
        first = episode["areal_turn_tokens"][0]
        turn_two = episode["versions"][first:]
        cut = next(i for i, v in enumerate(turn_two) if v != turn_two[0])
        assert 0 < cut < SECOND_TOKENS  # the new version starts inside the turn, where generation resumed
        assert set(turn_two[:cut]) == {turn_two[0]} and min(turn_two[cut:]) > turn_two[0]


@pytest.mark.full
def test_updates_between_turns_neither_lose_nor_repeat_the_environment_step(two_turn_run):
    episodes = read_jsonl(two_turn_run["episodes"])
    assert any(e["areal_updates_between_turns"] for e in episodes), "no weight update landed between two turns"
    for e in episodes:
        if e["areal_updates_between_turns"]:
            first = e["areal_turn_tokens"][0]
            assert e["versions"][first] > e["versions"][first - 1]
    calls = Counter(call["episode"] for call in read_jsonl(two_turn_run["calls"]))
    assert all(calls[e["episode"]] == 1 for e in episodes)  # one environment step per finished episode


@pytest.mark.full
def test_a_raising_or_hanging_environment_costs_its_episode_a_counted_failure_not_the_run(two_turn_run):
    import os

    faults = {uid: (two_turn_run["markers"] / uid).read_text() for uid in os.listdir(two_turn_run["markers"])}
    assert sorted(faults.values()) == ["hang", "raise"]
    log = (two_turn_run["run"] / "train.log").read_text()
    assert "deliberate environment failure" in log
    assert "outside the engine" in log and "environment_timeout_s" in log
    (accounting,) = read_jsonl(two_turn_run["run"] / "areal_accounting.jsonl")
    assert (accounting["failed_groups"], accounting["reissued_groups"], accounting["rejected"]) == (2, 2, 0)
    trained = {s["group"] for s in read_jsonl(two_turn_run["run"] / "areal_samples.jsonl")}
    steps = read_jsonl(two_turn_run["run"] / "areal_steps.jsonl")
    assert len(steps) == TWO_TURN_STEPS
    # Every consumed episode had two turns; the interrupt counters saw both kinds of update.
    assert all(step["areal/turns_mean"] == 2.0 for step in steps)
    assert sum(step["areal/episodes_interrupted_within_turn"] for step in steps) > 0
    assert sum(step["areal/episodes_updated_between_turns"] for step in steps) > 0
    assert accounting["consumed"] == TWO_TURN_STEPS * BATCH
    assert len(trained) == TWO_TURN_STEPS * BATCH
