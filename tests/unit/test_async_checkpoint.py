"""Our part of a checkpoint: the saved counters, the refusals of a checkpoint that cannot resume, and the
checkpoint a requested stop takes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from areal_plugins.core.staleness import StalenessController
from areal_plugins.driver import async_checkpoint
from areal_plugins.driver.async_checkpoint import (
    DrawCounts,
    checkpoint_before_stopping,
    checkpoint_folder,
    restore_async_state,
    resume_folder,
    save_async_state,
)
from areal_plugins.records.writer import RunRecorder


def trainer_config(tmp_path, save_freq=2, resume_mode="auto", resume_from_path=None):
    return SimpleNamespace(
        default_local_dir=str(tmp_path), save_freq=save_freq, resume_mode=resume_mode, resume_from_path=resume_from_path
    )


def test_the_saved_counters_are_the_ones_given(tmp_path):
    controller = StalenessController(max_staleness=1, batch_size=4, max_concurrent=100)
    controller.on_submit(6)
    controller.on_accept(4)
    partials = {"requests": 5, "tokens": 81}  # what the agent-loop workers kept (partial_outputs.py)
    save_async_state(str(tmp_path), 3, DrawCounts(consumed_groups=12, submissions=7), controller, partials)
    saved = json.loads((tmp_path / "areal_state.json").read_text())
    assert saved == {
        "version": 3,
        "consumed_groups": 12,
        "submissions": 7,
        "staleness_controller": {"running": 2, "accepted": 4, "rejected": 0},
        "partials": {"requests": 5, "tokens": 81},
    }


def test_a_checkpoint_written_before_the_rename_still_resumes(tmp_path, monkeypatch):
    # areal_state.json as 0.1.0's pre-release wrote it: the counts under "controller", not "staleness_controller".
    old = {
        "version": 2,
        "consumed_groups": 8,
        "submissions": 5,
        "controller": {"running": 1, "accepted": 8, "rejected": 3},
        "partials": {"requests": 0, "tokens": 0},
    }
    (tmp_path / "areal_state.json").write_text(json.dumps(old))
    listing = {"p7": {"is_prompt": True}, "p7_0": {"is_prompt": False}, "p9": {"is_prompt": True}}
    monkeypatch.setattr(async_checkpoint, "tq", SimpleNamespace(kv_list=lambda partition_id: {"train": listing}))
    controller = StalenessController(max_staleness=1, batch_size=4, max_concurrent=100)
    records = tmp_path / "records"
    records.mkdir()
    counts = restore_async_state(str(tmp_path), 2, controller, RunRecorder(str(records)))
    assert counts == DrawCounts(consumed_groups=8, submissions=5)
    assert (controller.running, controller.accepted) == (2, 2 * 4)  # the two restored prompts; v·B accepted
    (restored,) = [json.loads(line) for line in (records / "areal_restored.jsonl").read_text().splitlines()]
    assert restored["uids"] == ["p7", "p9"]
    assert restored["saved"]["staleness_controller"] == {"running": 1, "accepted": 8, "rejected": 3}
    assert "controller" not in restored["saved"]  # the record reads the same whatever wrote the checkpoint


def test_a_checkpoint_without_our_state_or_of_another_version_is_refused_saying_what_to_do(tmp_path):
    controller = StalenessController(max_staleness=1, batch_size=4, max_concurrent=100)
    with pytest.raises(RuntimeError, match=r"lacks .*trainer\.resume_mode=disable"):
        restore_async_state(str(tmp_path), 2, controller, RunRecorder())
    (tmp_path / "areal_state.json").write_text(json.dumps({"version": 1}))
    with pytest.raises(RuntimeError, match="is for version 1, the weights are version 2"):
        restore_async_state(str(tmp_path), 2, controller, RunRecorder())


def test_saves_go_where_verl_saves_and_a_resume_reads_where_verl_resumed_from(tmp_path):
    given = trainer_config(tmp_path, resume_mode="resume_path", resume_from_path="/ckpt/global_step_4")
    assert resume_folder(given, 4) == "/ckpt/global_step_4"
    assert resume_folder(trainer_config(tmp_path), 4) == str(tmp_path / "global_step_4")
    # A save, even of the step resumed from (a stop right after the resume): verl writes default_local_dir.
    assert checkpoint_folder(given, 4) == str(tmp_path / "global_step_4")


def test_a_requested_stop_checkpoints_the_last_finished_step_once(tmp_path):
    saved: list[int] = []
    assert checkpoint_before_stopping(trainer_config(tmp_path), 3, saved.append) == "; a checkpoint of step 3 was saved"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    assert checkpoint_before_stopping(trainer_config(tmp_path), 3, saved.append) == "; step 3 was already checkpointed"
    assert checkpoint_before_stopping(trainer_config(tmp_path, save_freq=-1), 4, saved.append) == ""
    assert checkpoint_before_stopping(trainer_config(tmp_path), 0, saved.append) == ""  # nothing trained yet
    assert saved == [3]
