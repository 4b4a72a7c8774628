"""``areal-plugins plan`` for what a verl user brings (issue 60, item 5): both placements planned (colocated, what
``+areal.enable=true`` alone gives, and separate), one verdict per answer, and answer lengths never above the
recipe's cap (derived from the paper's lengths cut at the cap, and said so)."""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics

import pytest

from areal_plugins.cli import main as cli_main
from areal_plugins.cli.preflight import plan_options
from areal_plugins.planning import plan as plan_module
from areal_plugins.planning.cluster_sim import Cluster, Workload
from areal_plugins.planning.hardware import GPUS, MODELS
from areal_plugins.planning.plan import (
    PAPER_FIT,
    PAPER_WORKLOAD,
    Plan,
    capped_mean,
    command_line,
    default_workload,
    format_plan,
    make_plan,
    recipe_keys,
)
from tests.unit.test_verl_scripts import PPO_TRAINER, QWEN3_8B_GRPO

CLUSTER = Cluster(GPUS["h100"], MODELS["1.5b"], PAPER_FIT, gpus=8)
WORK = Workload(batch=32, group=8, response_mean=1500, max_response=8192)


def test_the_capped_mean_is_the_mean_of_answers_cut_at_the_cap():
    """Against a Monte-Carlo mean of min(X, cap) (an independent reference), for the paper's lengths at caps from
    the paper's own 27,648 down to verl's example 1,024; never above the cap."""
    mu, sigma = PAPER_WORKLOAD.lognormal()
    rng = random.Random(0)
    draws = [rng.lognormvariate(mu, sigma) for _ in range(200_000)]
    for cap in (27648, 8192, 2048, 1024):
        expected = statistics.fmean(min(x, cap) for x in draws)
        assert capped_mean(mu, sigma, cap) == pytest.approx(expected, rel=0.01), cap
        assert capped_mean(mu, sigma, cap) < cap


def test_the_default_lengths_below_the_papers_cap_are_cut_there_and_warned():
    work, line = default_workload(batch=1024, group=5, max_response=2048, prompt=200)
    mu, sigma = PAPER_WORKLOAD.lognormal()
    assert (work.log_mu, work.log_sigma) == (mu, sigma)  # the paper's distribution, not a new fit to a lower mean
    assert work.max_response == 2048 and work.response_mean < 2048
    # the share past the cap: P(X > 2048) = 1 - Φ((ln 2048 - μ) / σ)
    share = 1 - statistics.NormalDist().cdf((math.log(2048) - mu) / sigma)
    assert work.truncated_fraction == pytest.approx(share)
    assert (
        line.startswith("warning: responses: the paper's lengths") and f"{share:.1%} of answers reach the cap" in line
    )
    same, note = default_workload(batch=512, group=16, max_response=27648, prompt=200)
    assert same.response_mean == 2117.0 and not note.startswith("warning")  # the paper's own setting: unchanged


def test_a_mean_above_the_cap_is_refused():
    with pytest.raises(SystemExit, match=r"--response-mean 2117 is above the answers' cap --max-response 2048"):
        cli_main(["plan", "--gpus", "8", "--response-mean", "2117", "--max-response", "2048"])


def hand_plan(async_tokens_per_s: float, placement: str) -> Plan:
    return Plan(
        eta=2, rollout_gpus=8 if placement == "colocated" else 4, train_gpus=8 if placement == "colocated" else 4,
        tensor_parallel=1, async_tokens_per_s=async_tokens_per_s, sync_tokens_per_s=100.0, speedup_range=(0.9, 1.3),
        throughput_by_eta={}, throughput_by_split={4: 90.0}, placement=placement,
        placements={"colocated": (2, 105.0), "separate": (1, 90.0)}, colocated_by_eta={0: 100.0, 2: 105.0},
        separate_by_eta={0: 80.0, 1: 90.0},
    )  # fmt: skip


def test_one_verdict_when_asynchrony_does_not_pay():
    """The issue's answer said "recommended η: 1" and "placement: none" at once; now one verdict, no η to set."""
    slow = hand_plan(105.0, "colocated")  # 1.05x < 1.1x
    assert slow.verdict == "synchronous"
    out = format_plan(slow, CLUSTER, WORK, gpus_per_node=8)
    assert len(re.findall(r"verdict:", out)) == 1 and "verdict: stay synchronous (areal.enable: false)" in out
    assert "recommended η" not in out and "areal.placement" not in out and "areal.max_staleness:" not in out


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_one_verdict_and_its_keys_agree(placement):
    fast = hand_plan(200.0, placement)
    out = format_plan(fast, CLUSTER, WORK, gpus_per_node=8)
    assert len(re.findall(r"verdict:", out)) == 1 and f"verdict: {placement}, η = 2: " in out
    assert f"recommended η (areal.max_staleness): 2; placement: {placement}" in out
    keys = recipe_keys(fast, WORK, gpus_per_node=8)
    assert f"areal.placement: {placement}" in keys
    pools = [key for key in keys if key.startswith("actor_rollout_ref.rollout.n")]
    if placement == "colocated":  # the engines on the trainer's 8 GPUs, weights handed over in-process
        assert "trainer.n_gpus_per_node: 8" in keys and pools == ["actor_rollout_ref.rollout.n: 8"]
        assert "actor_rollout_ref.rollout.checkpoint_engine.backend: naive" in keys
    else:
        assert "actor_rollout_ref.rollout.n_gpus_per_node: 4" in keys and "trainer.n_gpus_per_node: 4" in keys
        assert "actor_rollout_ref.rollout.checkpoint_engine.backend: nccl" in keys
    # on verl's own recipe every areal key takes a + (docs/guides/own_recipe.md); verl's keys do not
    line = command_line(keys)
    assert f"+areal.enable=true +areal.max_staleness=2 +areal.placement={placement} trainer.nnodes=1" in line
    assert f"on verl's own ppo_trainer.yaml: {line}" in out


@pytest.mark.parametrize(
    ("together", "apart", "chosen"),
    [(100.0, 104.0, "colocated"), (100.0, 106.0, "separate"), (100.0, 90.0, "colocated")],
)
def test_colocated_unless_separate_is_more_than_five_percent_faster(monkeypatch, together, apart, chosen):
    """Throughputs set by hand (flat in η, so each placement's η is the smallest planned, 0)."""

    def throughput(cluster, work, eta, seed=0, colocated=False):
        return together if colocated else apart

    monkeypatch.setattr(plan_module, "tokens_per_s", throughput)
    monkeypatch.setitem(plan_module.BASELINES, "verl", (lambda cluster, work: 50.0, "a stand-in baseline"))
    planned = make_plan(CLUSTER, WORK, etas=(0, 1))
    assert planned.placement == chosen and planned.verdict == chosen
    assert set(planned.placements) == {"colocated", "separate"}
    assert planned.async_tokens_per_s == (together if chosen == "colocated" else apart)
    assert planned.placements["colocated"] == (0, together) and planned.placements["separate"] == (0, apart)


def test_a_split_plans_the_separate_placement_only(monkeypatch):
    monkeypatch.setattr(plan_module, "tokens_per_s", lambda *args, **kwargs: 200.0)
    monkeypatch.setitem(plan_module.BASELINES, "verl", (lambda cluster, work: 50.0, "a stand-in baseline"))
    planned = make_plan(CLUSTER, WORK, etas=(0,), split=4)
    assert planned.placement == "separate" and set(planned.placements) == {"separate"}
    assert planned.rollout_gpus == 4 and planned.train_gpus == 4


def test_plan_prints_both_placements_and_one_verdict(capsys):
    assert cli_main(["plan", "--gpus", "8", "--batch", "32", "--group", "8", "--response-mean", "1500",
                     "--max-response", "8192", "--truncated-fraction", "0.002"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "colocated (every GPU generates, then trains; what +areal.enable=true alone gives)" in out
    assert "separate (engines in a pool of their own)" in out
    assert len(re.findall(r"verdict:", out)) == 1


def plan_args(*argv: str) -> argparse.Namespace:
    from areal_plugins.cli import build_parser

    args, rest = build_parser().parse_known_args(["plan", "--gpus", "8", *argv])
    args.overrides += [arg for arg in rest if "=" in arg]
    return args


def test_plan_reads_a_verl_scripts_recipe_and_an_option_wins(tmp_path):
    """verl's ppo_trainer.yaml with its Qwen3-8B GRPO script's overrides as they are, plus +areal.enable=true: the
    plan's batch, group, cap and model are the script's."""
    script = [o.replace("$HOME", str(tmp_path)) for o in QWEN3_8B_GRPO]
    script = [o.replace("<model>", "Qwen/Qwen3-8B") for o in script]
    args = plan_args("--recipe", str(PPO_TRAINER), *script, "+areal.enable=true")
    plan_options(args)
    assert (args.batch, args.group, args.max_response, args.model) == (1024, 5, 1024, "Qwen/Qwen3-8B")
    assert args.prompt_len == 200  # the default mean prompt, under the script's data.max_prompt_length=512
    assert args.notes[0].startswith("recipe: ppo_trainer.yaml gives data.train_batch_size=1024")
    args = plan_args("--recipe", str(PPO_TRAINER), "--batch", "64", *script, "data.max_prompt_length=128")
    plan_options(args)
    assert args.batch == 64 and args.prompt_len == 128
    bare = plan_args()
    plan_options(bare)
    assert (bare.batch, bare.group, bare.max_response, bare.model, bare.prompt_len) == (512, 16, 27648, "1.5b", 200)
    with pytest.raises(SystemExit, match="need --recipe"):
        plan_options(plan_args("data.train_batch_size=8"))
