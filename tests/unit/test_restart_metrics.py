"""One metrics.jsonl for a run across automatic restarts (issue 50 item 6), written by verl's own file logger.

Each attempt is verl's ``FileLogger`` as ``main_ppo`` builds it from ``VERL_FILE_LOGGER_PATH`` (it truncates the
file it opens); the run folder is prepared and joined as ``areal-plugins train``'s restart loop does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from verl.utils.tracking import FileLogger

from areal_plugins.cli.launch import EARLIER_METRICS, join_metrics, prepare_run_dir
from areal_plugins.records.report import REWARD_KEY, summarize_run


def _attempt(run_dir: Path, restart: bool, steps: range, reward: float, monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    prepare_run_dir(run_dir, env, restart=restart)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", env["VERL_FILE_LOGGER_PATH"])
    verl_logger = FileLogger("project", "experiment")
    for step in steps:
        verl_logger.log({REWARD_KEY: reward, "training/global_step": step}, step=step)
    verl_logger.finish()
    join_metrics(run_dir)


def _rows(path: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["data"][REWARD_KEY]) for row in map(json.loads, path.read_text().splitlines())]


def test_metrics_continue_across_two_restarts_and_the_summary_counts_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 10-step run: the first attempt logs steps 1-7 and dies (checkpoint of step 6: the second retrains 7), the
    # second logs 7-8 and dies (checkpoint of step 7: the third retrains 8), the third logs 8-10.
    _attempt(tmp_path, False, range(1, 8), 0.1, monkeypatch)
    _attempt(tmp_path, True, range(7, 9), 0.2, monkeypatch)
    _attempt(tmp_path, True, range(8, 11), 0.3, monkeypatch)
    expected = [(1, 0.1), (2, 0.1), (3, 0.1), (4, 0.1), (5, 0.1), (6, 0.1), (7, 0.2), (8, 0.3), (9, 0.3), (10, 0.3)]
    assert _rows(tmp_path / "metrics.jsonl") == expected
    assert not list(tmp_path.glob("metrics.before-*.jsonl"))
    assert not (tmp_path / EARLIER_METRICS).exists()
    assert summarize_run(tmp_path / "metrics.jsonl")[0].endswith("over 10 steps")


def test_a_restart_that_logged_nothing_keeps_the_earlier_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _attempt(tmp_path, False, range(1, 4), 0.1, monkeypatch)
    _attempt(tmp_path, True, range(0), 0.2, monkeypatch)  # died during startup: verl opened (emptied) the file
    assert _rows(tmp_path / "metrics.jsonl") == [(1, 0.1), (2, 0.1), (3, 0.1)]


def test_a_new_train_in_an_old_folder_still_keeps_its_metrics_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _attempt(tmp_path, False, range(1, 3), 0.1, monkeypatch)
    _attempt(tmp_path, False, range(1, 2), 0.5, monkeypatch)
    (kept,) = tmp_path.glob("metrics.before-*.jsonl")
    assert _rows(kept) == [(1, 0.1), (2, 0.1)]
    assert _rows(tmp_path / "metrics.jsonl") == [(1, 0.5)]


def test_rows_of_a_restart_interrupted_before_its_join_go_back_into_that_run(tmp_path: Path) -> None:
    (tmp_path / EARLIER_METRICS).write_text(json.dumps({"step": 1, "data": {REWARD_KEY: 0.1}}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "data": {REWARD_KEY: 0.2}}) + "\n")
    prepare_run_dir(tmp_path, {})
    (kept,) = tmp_path.glob("metrics.before-*.jsonl")
    assert _rows(kept) == [(1, 0.1), (2, 0.2)]
