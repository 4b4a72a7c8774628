"""Kill an async run's driver with SIGKILL after a checkpoint, resume it, and account for every prompt.

Full tier (``tools/test.sh --full``), like test_cluster.py's run, which checks the same resume guarantees after
losing its engines' node; this one adds the crash of every process at once.
"""

from __future__ import annotations

import json
import time

import pytest

from areal_plugins.agent_loop.partial_outputs import read_partials
from tests.integration.conftest import (
    assert_within_staleness_bound,
    cli_output,
    kill_tree,
    read_jsonl,
    run_cli,
    start_cli,
    train_args,
)

pytestmark = [pytest.mark.integration, pytest.mark.full]
STEPS = 4
CHECKPOINT_STEP = 2
MAX_STALENESS = 2
OVERRIDES = (
    f"trainer.save_freq={CHECKPOINT_STEP}",
    f"areal.max_staleness={MAX_STALENESS}",
    # Long answers decoded a few at a time: generation is still under way when sampling ends, so the checkpoint
    # finds requests in flight with output (what it keeps, and the resumed run continues).
    "data.max_response_length=24",
    "+actor_rollout_ref.rollout.engine_kwargs.areal_cpu.max_batch_size=8",
)


def overrides(model) -> tuple[str, ...]:
    return (*OVERRIDES, f"actor_rollout_ref.model.path={model}")


def kill_after_checkpoint(run_dir, tiny_dir, model) -> None:
    """Start the run; SIGKILL its whole process group once step CHECKPOINT_STEP is saved and more was drawn."""
    marker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    process = start_cli(*train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, STEPS, *overrides(model)))
    deadline = time.monotonic() + 900
    try:
        while not (marker.exists() and marker.read_text().strip() == str(CHECKPOINT_STEP)):
            assert process.poll() is None, f"ended before step-{CHECKPOINT_STEP} checkpoint:\n{cli_output(process)}"
            assert time.monotonic() < deadline, "no checkpoint within 15 minutes"
            time.sleep(0.5)
        state = json.loads(
            (run_dir / "checkpoints" / f"global_step_{CHECKPOINT_STEP}" / "areal_state.json").read_text()
        )
        # Let the run go on drawing prompts past the checkpoint (work the crash will lose), then kill it mid-step.
        while len(read_jsonl(run_dir / "areal_submissions.jsonl")) <= state["submissions"]:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        kill_tree(process)  # every process of this run, Ray's included; no other Ray cluster is touched


@pytest.fixture(scope="module")
def resumed_run(tiny_dir, long_response_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    kill_after_checkpoint(run_dir, tiny_dir, long_response_model)
    before = {
        name: read_jsonl(run_dir / name)
        for name in ("areal_submissions.jsonl", "areal_samples.jsonl", "areal_steps.jsonl")
    }
    for name in before:
        (run_dir / name).rename(run_dir / f"killed.{name}")
    run_cli(*train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, STEPS, *overrides(long_response_model)))
    after = {name: read_jsonl(run_dir / name) for name in before}
    (restored,) = read_jsonl(run_dir / "areal_restored.jsonl")
    return before, after, restored, run_dir


def test_resume_continues_the_step_and_version_sequence(resumed_run):
    _, after, restored, run_dir = resumed_run
    assert restored["version"] == CHECKPOINT_STEP
    assert [s["step"] for s in after["areal_steps.jsonl"]] == list(range(CHECKPOINT_STEP + 1, STEPS + 1))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(CHECKPOINT_STEP + 1, STEPS + 1))
    syncs = [r["version"] for r in read_jsonl(run_dir / "weight_syncs.jsonl")]
    assert syncs[-(STEPS - CHECKPOINT_STEP + 1) :] == list(range(CHECKPOINT_STEP, STEPS + 1))


def test_every_prompt_in_flight_at_the_checkpoint_comes_back_exactly_once(resumed_run):
    before, after, restored, _ = resumed_run
    saved = restored["saved"]
    drawn_before = [uid for line in before["areal_submissions.jsonl"][: saved["submissions"]] for uid in line["uids"]]
    consumed_before = {s["group"] for s in before["areal_samples.jsonl"] if s["step"] <= CHECKPOINT_STEP}
    assert saved["staleness_controller"]["rejected"] == 0  # nothing was filtered: every drawn group is trained or alive
    alive = set(drawn_before) - consumed_before
    assert set(restored["uids"]) == alive, "a prompt in flight or buffered at the checkpoint was lost or invented"
    assert len(restored["uids"]) == len(set(restored["uids"]))
    consumed_after = [s["group"] for s in after["areal_samples.jsonl"]]
    groups_after = set(consumed_after)
    assert not groups_after & consumed_before, "a group trained before the checkpoint was trained again"
    # Each consumed group is trained once (all its trajectories in one step).
    steps_of = {}
    for sample in after["areal_samples.jsonl"]:
        steps_of.setdefault(sample["group"], set()).add(sample["step"])
    assert all(len(steps) == 1 for steps in steps_of.values())


def test_the_dataloader_continues_where_the_checkpoint_left_it(resumed_run):
    before, after, restored, _ = resumed_run
    saved = restored["saved"]
    lost_draws = [p for line in before["areal_submissions.jsonl"][saved["submissions"] :] for p in line["prompts"]]
    new_draws = [p for line in after["areal_submissions.jsonl"] for p in line["prompts"]]
    assert lost_draws, "the kill came before any draw past the checkpoint"
    # Drawn after the checkpoint by the killed run = what the resumed run draws first (same order, no gap).
    common = min(len(lost_draws), len(new_draws))
    assert new_draws[:common] == lost_draws[:common]
    assert common >= 16  # a whole batch of prompts in the same order: not a coincidence of repeated prompts


def test_no_sample_beyond_the_staleness_bound_uncounted_after_resume(resumed_run):
    _, after, _, _ = resumed_run
    assert_within_staleness_bound(after["areal_samples.jsonl"], after["areal_steps.jsonl"], MAX_STALENESS)


def test_requests_in_flight_at_the_checkpoint_continue_from_their_saved_output(resumed_run):
    """The checkpoint kept the output so far of the answers of groups in flight (finished ones whole); the resumed
    run continued them instead of generating them again. Checked from the records: a trained answer of a saved one
    begins with the saved requests (their first token, version and the seed each was sampled with), and goes on
    with more where it was still generating (cut once more by the resume) or is exactly it where it had finished."""
    _, after, restored, run_dir = resumed_run
    folder = run_dir / "checkpoints" / f"global_step_{CHECKPOINT_STEP}"
    partials = read_partials(folder)
    assert partials, "no request had output in flight at the checkpoint"
    saved_tokens = sum(len(p["tokens"]) for p in partials)
    assert json.loads((folder / "areal_state.json").read_text())["partials"] == {
        "requests": len(partials),
        "tokens": saved_tokens,
    }
    assert {p["uid"] for p in partials} <= set(restored["uids"])  # only groups in flight at the checkpoint
    saved = {(p["uid"], p["session"]): p for p in partials}
    continued = []
    for sample in after["areal_samples.jsonl"]:
        uid, session, _ = sample["key"].rsplit("_", 2)
        partial = saved.get((uid, int(session)))
        if partial is not None:
            assert sample["chunks"][: len(partial["chunks"])] == partial["chunks"], (sample, partial)
            assert sample["head_version"] == partial["versions"][0] < CHECKPOINT_STEP + 1
            if partial["stop_reason"] is None:
                assert sample["num_interrupts"] >= partial["interrupts"] + 1  # the resume cut it once more
            else:
                assert sample["chunks"] == partial["chunks"] and sample["response_tokens"] == len(partial["tokens"])
            continued.append(partial)
    assert continued, "no trained answer continued a request saved in the checkpoint"
    last = read_jsonl(run_dir / "areal_steps.jsonl")[-1]
    assert last["areal/resume_saved_tokens"] == saved_tokens
    assert last["areal/resume_continued_tokens"] >= sum(len(p["tokens"]) for p in continued)
    finished = sum(p["stop_reason"] is not None for p in partials)
    print(  # the measure: tokens a resume generated again, before (all that was saved) and now
        f"resume: {len(partials)} answers ({finished} finished) with {saved_tokens} tokens kept by the checkpoint; "
        f"{int(last['areal/resume_continued_tokens'])} tokens continued, "
        f"{saved_tokens - int(last['areal/resume_continued_tokens'])} generated again (before: all {saved_tokens})"
    )
