"""The run's limits (driver/limits.py) and the reward's scorers (rewards/sizing.py) at the tiny recipe's values and at
a 7B GPU run's, each expected number derived by hand in the comments; every timeout constant of the package listed."""

from __future__ import annotations

import ast
import importlib
import logging
import re
from pathlib import Path

import pytest

from areal_plugins import cli
from areal_plugins.cli.preflight import compose
from areal_plugins.driver.limits import (
    CONSTANT,
    DERIVED,
    MEASURED,
    NOT_LIMITS,
    RECIPE,
    format_limits,
    run_limits,
    scorer_line,
    size_reward_scorers,
)
from areal_plugins.rewards.hooked import scorers_for
from areal_plugins.rewards.sizing import executor_threads, reward_limit_s, scorer_processes

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "grpo_cpu_async.yaml"
SEPARATE_GPU = REPO / "recipes" / "gpu" / "grpo_1.5b_separate.yaml"
#: The issue's 7B run (issue 47): Qwen2.5-7B, 512 prompts x 16 answers a step, 16k-token answers, on one node of 8
#: GPUs. No shipped recipe is 7B; the separate GPU recipe with these overrides is that run.
SEVEN_B = [
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B",
    "data.train_batch_size=512",
    "actor_rollout_ref.rollout.n=16",
    "data.max_response_length=16384",
    "actor_rollout_ref.rollout.max_model_len=17408",
]
#: A DGX H100 node: 2 x 56-core Xeon Platinum 8480C with two threads a core, 224 logical CPUs.
H100_NODE_CPUS = 224


@pytest.fixture(autouse=True)
def environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_TINY_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_TINY_CALCULATOR_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_TINY_VISION_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_DATA_DIR", str(tmp_path))


def by_name(limits):
    return {limit.name: limit for limit in limits}


# ------------------------------------------------------------------ the reward's arithmetic


def test_the_reward_limit_grows_past_timeout_chars():
    assert reward_limit_s(10.0, 4096, 64) == 10.0  # the tiny model's 16 tokens x 4 chars: under 4096
    assert reward_limit_s(10.0, 4096, 4096) == 10.0
    assert reward_limit_s(10.0, 4096, 65536) == 160.0  # 16,384 tokens x 4 = 65,536 chars = 16 x 4096: 16 x 10 s
    assert reward_limit_s(10.0, None, 65536) == 10.0


def test_scorers_at_the_tiny_recipe():
    # A = 16 prompts x 8 answers = 128, R = 1 reward worker, one node of 2 CPUs, half of them for scoring:
    # min(ceil(128 / 1) = 128, floor(2 x 0.5 / 1) = 1, min(32, 2 + 4) = 6) = 1.
    assert scorer_processes(128, 1, 1, 2, 0.5) == 1


def test_scorers_at_a_7b_run_of_8192_answers_a_step():
    # A = 512 x 16 = 8192, R = 8 (verl's default), one node of 224 CPUs, half for scoring:
    # min(ceil(8192 / 8) = 1024, floor(224 x 0.5 / ceil(8 / 1)) = floor(14) = 14, min(32, 228) = 32) = 14 a worker,
    # 8 x 14 = 112 scorers in all (the constant it replaces: 1 a worker, 8 in all).
    assert scorer_processes(8192, 8, 1, H100_NODE_CPUS, 0.5) == 14
    # Two nodes (a CPU head of 32 CPUs beside the GPU node): verl puts ceil(8 / 2) = 4 workers on each, sized by the
    # smaller node: floor(32 x 0.5 / 4) = 4.
    assert scorer_processes(8192, 8, 2, 32, 0.5) == 4


def test_scorers_are_bounded_by_the_batch_and_verls_thread_pool():
    # A step of 12 answers over 8 workers: ceil(12 / 8) = 2 answers each, however many CPUs.
    assert scorer_processes(12, 8, 1, H100_NODE_CPUS, 1.0) == 2
    # One worker with all of 224 CPUs: floor(224 x 1.0 / 1) = 224, but verl's default executor runs
    # min(32, 224 + 4) = 32 of its calls at once.
    assert executor_threads(224) == 32 and executor_threads(2) == 6
    assert scorer_processes(8192, 1, 1, H100_NODE_CPUS, 1.0) == 32
    # Never none: 8 workers on a 2-CPU node, floor(2 x 0.5 / 8) = 0 -> 1.
    assert scorer_processes(128, 8, 1, 2, 0.5) == 1
    with pytest.raises(ValueError, match="cpus_per_node=0"):
        scorer_processes(128, 8, 1, 0, 0.5)


def test_a_reward_worker_takes_the_recipes_count_else_the_drivers():
    assert scorers_for({"num_workers": 3}, 14) == 3  # areal.reward.num_workers wins
    assert scorers_for({"num_workers": None}, 14) == 14  # null: what the driver sized
    assert scorers_for({}, None) == 1  # nothing sized (a trainer that is not ours): one


def test_a_reward_worker_caps_the_drivers_count_at_its_nodes_cores():
    # The CPU recipes give Ray 16 CPU slots on 2 cores: the driver sizes floor(16 x 0.5 / 1) = 8 processes, the
    # node's cores allow floor(2 x 0.5) = 1.
    assert scorers_for({"num_workers": None}, 8, core_share=0.5, cores=2) == 1
    # An H100 node whose Ray CPUs are its 224 cores, 8 reward workers: floor(224 x 0.5 / 8) = 14, the driver's own
    # term, so nothing changes.
    assert scorers_for({"num_workers": None}, 14, core_share=0.5 / 8, cores=H100_NODE_CPUS) == 14
    assert scorers_for({"num_workers": None}, 8, core_share=0.5 / 8, cores=2) == 1  # never none
    assert scorers_for({"num_workers": 3}, 8, core_share=0.5, cores=2) == 3  # the recipe's count is not capped


# ------------------------------------------------------------------ the limits of a recipe


def test_the_tiny_recipes_limits():
    config = compose(TINY, [])
    limits = by_name(run_limits(config))
    # areal.watchdog_s: the default 900 s; the stall guard's 900 - 30 = 870 s.
    assert limits["batch wait with no rollout progress (the watchdog)"].value_s == 900.0
    guard = limits["trainer computing with nothing moving (the stall guard)"]
    assert (guard.value_s, guard.kind) == (870.0, DERIVED)
    # trainer.save_freq = -1: nothing to checkpoint, SIGTERM at once, SIGKILL 20 s later.
    assert limits["Ctrl-C: wait for the checkpointed stop before SIGTERM"].value_s == 0.0
    assert limits["SIGTERM to SIGKILL"].value_s == 20.0
    # data.max_response_length = 16 tokens ~ 64 chars, under 4096: the reward's 10 s.
    reward = limits["one reward (a scoring attempt)"]
    assert reward.value_s == 10.0 and "16 tokens ~ 64 chars" in reward.source
    # colocated, verl's naive checkpoint engine, no replay: none of their limits apply.
    assert not {name for name in limits if "replica" in name or "areal_gloo" in name or "replay" in name}
    # Scorers: A = 128, R = 1 (the recipe's reward.num_workers), on this box's kind of node, 1 of 2 CPUs: 1.
    assert scorer_line(config, 1, 2).startswith("reward scoring processes: 1 per verl reward worker, 1 in all (derived")


def test_a_7b_runs_limits():
    config = compose(SEPARATE_GPU, SEVEN_B)
    limits = by_name(run_limits(config))
    # the GPU recipes' areal.watchdog_s = 3600: the stall guard 3600 - 30 = 3570 s, judged by progress.
    assert limits["trainer computing with nothing moving (the stall guard)"].value_s == 3570.0
    # trainer.save_freq = 25: before anything is measured the Ctrl-C wait is (3600 + 3600) x 1.25 = 9000 s ...
    ctrl_c = limits["Ctrl-C: wait for the checkpointed stop before SIGTERM"]
    assert (ctrl_c.value_s, ctrl_c.kind) == (9000.0, DERIVED)
    # ... and with a measured 1200 s longest phase and 300 s checkpoint: (1200 + 300) x 1.25 = 1875 s.
    measured = by_name(run_limits(config, longest_phase_s=1200.0, checkpoint_s=300.0))
    stop = measured["Ctrl-C: wait for the checkpointed stop before SIGTERM"]
    assert (stop.value_s, stop.kind) == (1875.0, MEASURED)
    # 16,384 tokens x 4 = 65,536 chars = 16 x 4096: 16 x 10 s = 160 s.
    reward = limits["one reward (a scoring attempt)"]
    assert reward.value_s == 160.0 and "16384 tokens ~ 65536 chars" in reward.source
    # separate: a replica started mid-run gets 3 x the measured start (200 s measured: 600 s), unknown before.
    start = "a rollout replica started mid-run (replacement, growth)"
    assert limits[start].value_s is None and limits[start].kind == MEASURED
    assert by_name(run_limits(config, replica_start_s=200.0))[start].value_s == 600.0
    keyed = by_name(run_limits(compose(SEPARATE_GPU, [*SEVEN_B, "areal.replica_start_timeout_s=900"])))
    assert (keyed[start].value_s, keyed[start].kind) == (900.0, RECIPE)
    # Scorers: A = 512 x 16 = 8192, R = 8, one node of 224 CPUs: 14 a worker (test above), 112 in all.
    assert scorer_line(config, 1, H100_NODE_CPUS).startswith("reward scoring processes: 14 per verl reward worker, 112")


def test_every_limit_names_its_source():
    config = compose(SEPARATE_GPU, SEVEN_B)
    for limit in run_limits(config):
        assert limit.kind in (RECIPE, MEASURED, DERIVED, CONSTANT), limit
        assert limit.source, limit
        if limit.kind == RECIPE:
            assert re.search(r"areal\.\w+", limit.source), limit  # names the key


def test_the_drivers_sizing_reaches_the_reward_workers_kwargs():
    config = compose(SEPARATE_GPU, SEVEN_B)
    assert size_reward_scorers(config, 1, H100_NODE_CPUS) == 14
    assert config.reward.custom_reward_function.reward_kwargs.areal_scorers == 14
    # Each of R = 8 reward workers on N = 1 node may take cpu_share / ceil(8 / 1) = 0.5 / 8 of its node's cores.
    assert config.reward.custom_reward_function.reward_kwargs.areal_scorer_core_share == 0.5 / 8
    keyed = compose(SEPARATE_GPU, [*SEVEN_B, "areal.reward.num_workers=3"])
    assert size_reward_scorers(keyed, 1, H100_NODE_CPUS) == 3
    assert "recipe key: areal.reward.num_workers" in scorer_line(keyed, 1, H100_NODE_CPUS)


def test_check_prints_the_limits_of_the_recipe(caplog):
    with caplog.at_level(logging.INFO, logger="areal_plugins.cli"):
        code = cli.main(
            # the shipped separate recipe's engine GPU keeps 1.3 GiB for a 7B, under check's 2 GiB margin: the
            # limits are this test's subject, so the margin is lowered as the refusal says
            [
                "check",
                str(SEPARATE_GPU),
                *SEVEN_B,
                "areal.check.memory_margin_gib=1",
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--cpus-per-node",
                "224",
            ]
        )
    assert code == 0
    lines = [record.getMessage().strip() for record in caplog.records]
    # the same lines the run logs at startup: one function builds both
    expected = format_limits(run_limits(compose(SEPARATE_GPU, SEVEN_B)))
    assert [line for line in lines if line in expected] == expected
    assert any(line.startswith("one reward (a scoring attempt): 160 s (derived") for line in lines)
    assert any(line.startswith("reward scoring processes: 14 per verl reward worker") for line in lines)


# ------------------------------------------------------------------ no limit added silently

#: The grep of the brief: module-level names ending in _S or naming a timeout.
LIMIT_NAME = re.compile(r"^[A-Z][A-Z0-9_]*(_S|TIMEOUT[A-Z0-9_]*)$")


def module_constants() -> set[str]:
    found = set()
    for root, package in ((REPO / "areal_plugins", "areal_plugins"), (REPO / "patches", "areal_plugins.patches")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            module = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            for node in ast.parse(path.read_text()).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, ast.AnnAssign
                ) else []  # fmt: skip
                for target in targets:
                    if isinstance(target, ast.Name) and LIMIT_NAME.match(target.id):
                        found.add(f"{module}.{target.id}")
    return found


def every_branch_listed() -> set[str]:
    """The constants of run_limits where every entry applies: separate, areal_gloo, a replay, checkpoints."""
    config = compose(
        SEPARATE_GPU,
        [*SEVEN_B, "actor_rollout_ref.rollout.checkpoint_engine.backend=areal_gloo", "areal.replay.run_dir=/tmp/x"],
    )
    return {name for limit in run_limits(config) for name in limit.constants}


def test_every_timeout_constant_is_a_listed_limit_or_excluded_with_a_reason():
    found = module_constants()
    assert {
        "areal_plugins.actors.settled_groups.DRAIN_TIMEOUT_S",
        "areal_plugins.weight_sync.gloo.TIMEOUT_S",
        "areal_plugins.driver.replica_replacement.START_TIMEOUT_FACTOR",
    } <= found  # the grep finds what it must
    listed = every_branch_listed()
    unaccounted = found - listed - set(NOT_LIMITS)
    assert not unaccounted, (
        f"timeout constants neither in driver/limits.py's run_limits nor in its NOT_LIMITS: {sorted(unaccounted)}; "
        "list each (with its source) or exclude it with the reason it is no limit"
    )
    assert all(reason.strip() for reason in NOT_LIMITS.values())
    assert not set(NOT_LIMITS) & listed, "a constant both listed and excluded"


def test_listed_and_excluded_constants_exist():
    for name in [*every_branch_listed(), *NOT_LIMITS]:
        module, _, attribute = name.rpartition(".")
        assert hasattr(importlib.import_module(module), attribute), name
