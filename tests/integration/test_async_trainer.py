"""The ``areal_async`` trainer in verl on CPU: staleness bound, interruption, accounting, η = 0 = sync.

Real verl trainer and workers, Ray, TransferQueue, the areal_cpu engine and math-verify. The η = 1 run trains a LoRA
adapter (verl's default adapter-only sync): CI's LoRA run on ``areal_cpu`` (test_lora.py says what its records
show), sharing this verl start; the full-weight runs on this engine are the observed run, the bf16 pair and the
stall guard's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import (
    SYNC_STEPS,
    assert_float32_losses_match,
    assert_same_samples_each_step,
    assert_schedule_is_consistent,
    assert_within_staleness_bound,
    read_jsonl,
    run_with_dump,
    train_tiny,
    with_example_plugin,
)
from tests.integration.test_lora import (
    ADAPTER_TENSORS,
    BASE_PARAMETERS,
    LORA,
    assert_the_adapter_trained_and_the_base_stayed,
)

pytestmark = pytest.mark.integration

ETA = 1
STEPS = 4
BATCH = 16  # prompt groups per step (the recipes' data.train_batch_size)


@pytest.fixture(scope="module")
def async_run(tiny_dir, long_response_model, tmp_path_factory) -> tuple[Path, Path]:
    """η = 1 with a LoRA adapter, with the example plugin installed but excluded (and told to fail): no process may
    load it."""
    run_dir = tmp_path_factory.mktemp("async_run")
    observer = tmp_path_factory.mktemp("excluded") / "observer.jsonl"
    train_tiny(
        "grpo_cpu_async.yaml",
        run_dir,
        tiny_dir,
        STEPS,
        f"areal.max_staleness={ETA}",
        *LORA,
        f"actor_rollout_ref.model.path={long_response_model}",
        "data.max_response_length=24",
        # A small engine batch keeps generation going all the time, as on a loaded cluster.
        "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.max_batch_size=24",
        # And updates always find requests mid-answer, on any machine: under each version only the first BATCH
        # groups finish, the others wait after a token for the update (testing/holds.py).
        f"+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.finish_groups_per_version={BATCH}",
        "areal.plugins.exclude=[example_observer]",
        # verl's validation after the last step (the held-out problems, greedy): each agent-loop worker's client
        # makes many validation calls, which go ahead of the training backlog (docs/backends.md).
        f"trainer.test_freq={STEPS}",
        env=with_example_plugin(AREAL_EXAMPLE_OBSERVER_LOG=str(observer), AREAL_EXAMPLE_OBSERVER_RAISE="1"),
    )
    return run_dir, observer


def test_verls_validation_runs_through_the_async_trainer(async_run):
    async_run, _ = async_run
    lines = read_jsonl(async_run / "metrics.jsonl")
    validated = [line["step"] for line in lines if any(key.startswith("val-core/") for key in line["data"])]
    assert validated == [STEPS], validated


def test_no_consumed_sample_is_older_than_eta_unless_counted(async_run):
    async_run, _ = async_run
    samples = read_jsonl(async_run / "areal_samples.jsonl")
    assert len(samples) == STEPS * BATCH * 8
    assert_within_staleness_bound(samples, read_jsonl(async_run / "areal_steps.jsonl"), ETA)
    assert all(sample["tail_version"] <= sample["trainer_version"] for sample in samples)
    # η = 1 with admission ahead of training: some samples are one version old.
    assert {0, 1} <= {s["trainer_version"] - s["head_version"] for s in samples}


def test_interrupted_trajectories_carry_two_versions(async_run):
    async_run, _ = async_run
    samples = read_jsonl(async_run / "areal_samples.jsonl")
    spanning = [s for s in samples if s["tail_version"] > s["head_version"]]
    assert spanning, "no trajectory was interrupted by a weight update and resumed"
    assert all(s["num_interrupts"] >= 1 for s in spanning)
    # The schedule a replay follows: each sample's requests, with the seed areal_cpu sampled each with.
    for sample in samples:
        assert_schedule_is_consistent(sample, seeded=True)
    assert all(len(s["chunks"]) >= 2 for s in spanning)


def test_every_submitted_rollout_is_accounted_for(async_run):
    async_run, _ = async_run
    (final,) = read_jsonl(async_run / "areal_accounting.jsonl")
    # Submissions counted from the record of every prompt batch drawn, not from the controller's counters.
    drawn = [uid for line in read_jsonl(async_run / "areal_submissions.jsonl") for uid in line["uids"]]
    assert len(drawn) == len(set(drawn)) == final["submitted"]
    assert len(drawn) == final["accepted"] + final["rejected"] + final["running"]
    assert final["consumed"] == STEPS * BATCH
    assert final["accepted"] == final["consumed"] + final["buffered"]
    # Admission never ran ahead of the bound: (η + v + 1) * B at the last version.
    assert final["accepted"] + final["running"] <= (ETA + final["version"] + 1) * BATCH


def test_admission_finds_finished_groups_by_the_workers_reports_not_by_listing_transfer_queue(async_run):
    """verl's agent-loop workers (ours) report each settled group; a poll reads only those. The whole partition is
    listed at the first poll and then every 30 s: far fewer than one poll in ten over a run of a few minutes
    (listing on every poll, as without the reports, makes the two counts equal)."""
    async_run, _ = async_run
    last = read_jsonl(async_run / "areal_steps.jsonl")[-1]
    assert last["areal/admission_polls"] > 100
    assert last["areal/partition_listings"] <= last["areal/admission_polls"] / 10
    # No plugin asks about trajectories here: groups settle from the summaries their workers reported, and rows are
    # read only for a group a listing found before its report came.
    from_reports, from_rows = last["areal/settled_from_reports"], last["areal/settled_from_rows"]
    # Every trained group settled one way or the other (CI, 2026-12-03: 63 from reports and 1 a listing found first).
    assert from_reports + from_rows >= STEPS * BATCH, (from_reports, from_rows)
    assert from_rows <= max(2, from_reports / 20), (from_reports, from_rows)


def test_engines_serve_the_trainers_version_after_each_update_adapter_only_and_checked(async_run):
    """LoRA: the base weights once (version 0), then every version's adapter alone, each tensor checked on arrival
    (test_lora.py derives these records from verl's ``engine_workers.update_weights``)."""
    async_run, _ = async_run
    syncs = read_jsonl(async_run / "weight_syncs.jsonl")
    versions = list(range(STEPS + 1))
    assert [s["version"] for s in syncs if s["event"] == "update"] == [0], syncs  # the base weights, once
    assert {s["event"] for s in syncs} == {"load", "update", "update_adapter", "update_checked"}, syncs
    loaded = [s for s in syncs if s["event"] == "update_adapter"]
    assert [s["version"] for s in loaded] == versions, loaded
    assert all(s["checksum"]["adapter_tensors"] == ADAPTER_TENSORS and s["checksum"]["unplaced"] == [] for s in loaded)
    checked = [s for s in syncs if s["event"] == "update_checked"]
    assert [s["version"] for s in checked] == versions, checked
    expected = {
        "adapter_tensors": ADAPTER_TENSORS,
        "adapter_ranks": 1,
        "adapter_only": True,
        "base_rechecked": BASE_PARAMETERS,
    }
    assert all(s["checksum"] == expected for s in checked), checked
    assert_the_adapter_trained_and_the_base_stayed(async_run, versions)  # each update shipped a new adapter
    steps = read_jsonl(async_run / "areal_steps.jsonl")
    assert [s["areal/trainer_version"] for s in steps] == list(range(STEPS))


def test_an_excluded_plugin_is_called_in_no_process(async_run):
    # Installed, told to raise in areal_after_train_step (driver) and to log every hook it sees: had the
    # driver, a trainer worker or a reward worker loaded it, the run would have failed or the log exist.
    run_dir, observer = async_run
    assert not observer.exists()
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == STEPS


# ---------------------------------------------------------------- η = 0 reproduces synchronous verl


@pytest.fixture(scope="module")
def eta0_pair(sync_run, tiny_dir, distinct_prompts, tmp_path_factory) -> tuple[Path, Path]:
    eta0 = run_with_dump("grpo_cpu_async.yaml", tiny_dir, tmp_path_factory, distinct_prompts, "areal.max_staleness=0")
    return sync_run, eta0


# The same guarantee runs in CI in bf16 with packed multi-turn episodes on this engine (test_gpu_numerics.py); this
# float32 single-turn pair, like the one on verl's vLLM at temperature 0.7 (test_verl_vllm.py), is the full tier's.
@pytest.mark.full
def test_eta0_consumes_the_samples_of_synchronous_verl(eta0_pair):
    sync, eta0 = eta0_pair
    assert_same_samples_each_step(sync, eta0)
    # ... generated by the same versions: synchronous verl's are the step's own weights, by construction.
    for sample in read_jsonl(eta0 / "areal_samples.jsonl"):
        assert sample["head_version"] == sample["tail_version"] == sample["step"] - 1


@pytest.mark.full
def test_eta0_losses_match_synchronous_verl(eta0_pair):
    sync, eta0 = ([line["data"] for line in read_jsonl(run / "metrics.jsonl")] for run in eta0_pair)
    assert len(sync) == SYNC_STEPS
    assert_float32_losses_match(sync, eta0)
