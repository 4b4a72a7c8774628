"""The async trainer asks a schedule source where a replay differs from a live run; both sources answer it all."""

from __future__ import annotations

import ast
from pathlib import Path

from areal_plugins.driver.schedule_source import LiveSchedule, ScheduleSource
from areal_plugins.replay.driver_side import ReplayDriver

QUESTIONS = (
    "pauses_admission_before_update",
    "client_class",
    "sample_buffer",
    "served",
    "finish_version",
    "check_step",
)


def test_the_protocol_lists_every_question():
    assert set(QUESTIONS) == {n for n in vars(ScheduleSource) if not n.startswith("_")} | set(
        ScheduleSource.__annotations__
    )


def test_a_live_run_and_a_replay_answer_the_same_questions():
    for source in (LiveSchedule, ReplayDriver):
        assert all(hasattr(source, name) for name in QUESTIONS), source


def test_a_live_run_uses_the_interrupting_client_and_a_replay_the_one_that_follows_the_record():
    from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient
    from areal_plugins.replay.agent_loop_side import ReplayingLLMClient

    assert LiveSchedule().client_class() is InterruptibleLLMClient
    assert ReplayDriver.client_class(object.__new__(ReplayDriver)) is ReplayingLLMClient
    assert issubclass(ReplayingLLMClient, InterruptibleLLMClient)
    assert LiveSchedule.pauses_admission_before_update is False and ReplayDriver.pauses_admission_before_update


def test_the_live_client_no_longer_branches_on_a_replay():
    source = Path(__file__).resolve().parents[2] / "areal_plugins" / "agent_loop" / "llm_client.py"
    imported = {
        node.module
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not any(name.startswith("areal_plugins.replay") for name in imported)


def test_the_trainer_asks_its_schedule_source_instead_of_checking_for_a_replay():
    source = Path(__file__).resolve().parents[2] / "areal_plugins" / "driver" / "async_trainer.py"
    text = source.read_text()
    assert "self.replay" not in text and text.count("self.schedule.") >= 6
