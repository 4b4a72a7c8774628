"""``areal-plugins compare``: the first difference between two runs' records, samples before losses."""

from __future__ import annotations

import json
from pathlib import Path

from areal_plugins.cli import main
from areal_plugins.records.compare import Divergence, compare_runs


def sample(step: int, prompt: str, response: str, reward: float = 1.0) -> dict:
    return {
        "step": step,
        "group": f"g-{prompt}",
        "prompt_digest": prompt,
        "response_digest": response,
        "response_tokens": 4,
        "chunks": [[0, step - 1, 11], [2, step, 12]],
        "head_version": step - 1,
        "tail_version": step,
        "reward": reward,
    }


def metrics(step: int, loss: float, lr: float = 1e-3) -> dict:
    return {"step": step, "data": {"training/global_step": step, "actor/lr": lr, "actor/pg_loss": loss}}


def write_run(run_dir: Path, samples: list[dict], steps: list[dict]) -> Path:
    run_dir.mkdir()
    (run_dir / "areal_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    return run_dir


SAMPLES = [sample(1, "p1", "r1"), sample(1, "p2", "r2"), sample(2, "p3", "r3"), sample(2, "p4", "r4")]
METRICS = [metrics(1, 0.5), metrics(2, 0.25)]


def test_identical_records_match_over_every_step_and_trajectory(tmp_path):
    first = write_run(tmp_path / "a", SAMPLES, METRICS)
    second = write_run(tmp_path / "b", SAMPLES, METRICS)
    result = compare_runs(first, second)
    assert (result.steps, result.trajectories, result.divergence) == (2, 4, None)
    assert main(["compare", str(first), str(second)]) == 0


def test_a_trajectory_trained_by_one_run_only_is_named_with_the_one_the_other_trained(tmp_path):
    other = [*SAMPLES[:3], sample(2, "p4", "r4-other")]
    first = write_run(tmp_path / "a", SAMPLES, METRICS)
    second = write_run(tmp_path / "b", other, [metrics(1, 0.5), metrics(2, 0.75)])
    result = compare_runs(first, second)
    # Step 2's loss differs too; the samples it was computed from come first.
    assert result.divergence == Divergence(2, "trained (prompt, response) digests", ("p4", "r4"), ("p4", "r4-other"))
    assert (result.steps, result.trajectories) == (1, 2)


def test_the_same_trajectories_in_another_order_are_told_apart_from_other_trajectories(tmp_path):
    first = write_run(tmp_path / "a", SAMPLES, METRICS)
    second = write_run(tmp_path / "b", [*SAMPLES[:2], SAMPLES[3], SAMPLES[2]], METRICS)
    assert compare_runs(first, second).divergence == Divergence(
        2, "consumption order", ("p3", "r3"), ("p4", "r4"), trajectory=0
    )


def test_a_trajectory_interrupted_elsewhere_differs_even_with_the_same_tokens(tmp_path):
    moved = dict(SAMPLES[1], chunks=[[0, 0, 11], [3, 1, 12]])
    first = write_run(tmp_path / "a", SAMPLES, METRICS)
    second = write_run(tmp_path / "b", [SAMPLES[0], moved, *SAMPLES[2:]], METRICS)
    assert compare_runs(first, second).divergence == Divergence(
        1, "chunks", [[0, 0, 11], [2, 1, 12]], [[0, 0, 11], [3, 1, 12]], trajectory=1
    )


def test_a_changed_learning_rate_shows_at_the_first_step_and_the_cli_says_so(tmp_path, capsys):
    first = write_run(tmp_path / "a", SAMPLES, METRICS)
    second = write_run(tmp_path / "b", SAMPLES, [metrics(1, 0.5, lr=2e-3), metrics(2, 0.3, lr=2e-3)])
    assert compare_runs(first, second).divergence == Divergence(1, "actor/lr", 1e-3, 2e-3)
    assert main(["compare", str(first), str(second)]) == 1
    assert "step 1, actor/lr: 0.001 vs 0.002 (after 0 matching steps)" in capsys.readouterr().out


def test_a_tolerance_applies_to_floats_only(tmp_path):
    first = write_run(tmp_path / "a", SAMPLES, METRICS)
    second = write_run(tmp_path / "b", SAMPLES, [metrics(1, 0.5 * (1 + 1e-7)), metrics(2, 0.25)])
    assert compare_runs(first, second).divergence == Divergence(1, "actor/pg_loss", 0.5, 0.5 * (1 + 1e-7))
    assert compare_runs(first, second, rtol=1e-6).divergence is None


def test_a_step_with_a_different_number_of_trajectories_is_named(tmp_path):
    first = write_run(tmp_path / "a", SAMPLES, METRICS)
    second = write_run(tmp_path / "b", SAMPLES[:3], METRICS)
    assert compare_runs(first, second).divergence == Divergence(
        2, "trained (prompt, response) digests", ("p4", "r4"), None
    )


def test_validation_lines_resumed_steps_and_nan_losses_are_read_as_a_run_wrote_them(tmp_path):
    """verl logs validation without a training step; after a resume areal-plugins train keeps the earlier metrics
    as metrics.before-*.jsonl and step 2 is trained again (its last attempt counts); a NaN loss equals a NaN."""
    first = write_run(tmp_path / "a", SAMPLES, [metrics(1, 0.5), metrics(2, float("nan"))])
    died = dict(sample(2, "p9", "lost"), attempt="dead")  # step 2's first attempt, then the resumed run's
    retried = [*SAMPLES[:2], died, *(s | {"attempt": "resumed"} for s in SAMPLES[2:])]
    second = write_run(tmp_path / "b", retried, [{"step": 0, "data": {"val-core/acc": 0.1}}, metrics(2, float("nan"))])
    (second / "metrics.before-20261202-101010.jsonl").write_text(json.dumps(metrics(1, 0.5)) + "\n")
    assert compare_runs(first, second).divergence is None
    (second / "metrics.before-20261202-101010.jsonl").write_text(json.dumps(metrics(1, 0.4)) + "\n")
    assert compare_runs(first, second).divergence == Divergence(1, "actor/pg_loss", 0.5, 0.4)


def test_a_run_without_records_or_digests_is_refused_saying_why(tmp_path, capsys):
    assert main(["compare", str(tmp_path), str(tmp_path)]) == 2  # neither "match" (0) nor "differ" (1)
    assert "areal_samples.jsonl is missing" in capsys.readouterr().err
    old = [{key: value for key, value in s.items() if not key.endswith("_digest")} for s in SAMPLES]
    first = write_run(tmp_path / "old", old, METRICS)
    assert main(["compare", str(first), str(first)]) == 2
    assert "predates the schedule record" in capsys.readouterr().err
