"""Progress the stall guard reads: the trainer workers' micro-batches, through verl's FSDP engine."""

from __future__ import annotations

import pytest
import torch
from areal_plugins.patches import trainer_progress
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp import transformer_impl

from areal_plugins import patches
from areal_plugins.actors import progress_board as progress


class Board:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.report = self  # board.report.remote(...)

    def remote(self, kind: str, process: str, total: int) -> None:
        self.calls.append((kind, process, total))


def test_the_board_sums_each_kind_over_processes_and_keeps_each_running_total():
    board = progress.ProgressBoard()
    board.report("trainer_micro_batches", "a", 3)
    board.report("trainer_micro_batches", "b", 4)
    board.report("trainer_micro_batches", "a", 2)  # a late, older report does not go back
    board.report("weight_buckets", "a", 1)
    assert board.totals() == {"trainer_micro_batches": 7, "weight_buckets": 1}


def test_a_process_reports_its_running_total_at_most_once_per_interval():
    now = [0.0]
    reporter = progress.ProgressReporter(clock=lambda: now[0])
    board = Board()
    reporter._board = board
    for tick in range(10):  # ten micro-batches 0.25 s apart: 2.25 s -> reports at 0, 1.0 and 2.0 s
        now[0] = tick * 0.25
        reporter.bump("trainer_micro_batches")
    assert [total for _, _, total in board.calls] == [1, 5, 9]
    assert reporter.counts["trainer_micro_batches"] == 10


@pytest.fixture
def patched():
    trainer_progress.apply()
    yield
    trainer_progress.revert()


def batch_of(n: int) -> TensorDict:
    data = TensorDict({"input_ids": torch.ones(n, 4, dtype=torch.long)}, batch_size=[n])
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    return data


def test_verls_engine_reports_each_micro_batch_it_takes(patched, monkeypatch):
    counted: list[str] = []
    monkeypatch.setattr(progress, "report_progress", lambda kind, count=1: counted.append(kind))
    micro_batches, _ = transformer_impl.prepare_micro_batches(data=batch_of(6))
    assert len(micro_batches) == 3 and counted == []  # nothing started yet
    for index, micro_batch in enumerate(micro_batches):  # how forward_backward_batch loops
        assert len(counted) == index + 1
        assert micro_batch.batch_size[0] == 2
    assert counted == ["trainer_micro_batches"] * 3


def test_revert_restores_verls_function():
    before = transformer_impl.prepare_micro_batches
    trainer_progress.apply()
    assert transformer_impl.prepare_micro_batches is not before
    trainer_progress.apply()  # idempotent: not a patch of the patch
    patched_once = transformer_impl.prepare_micro_batches
    assert patched_once.__wrapped__ is before
    trainer_progress.revert()
    assert transformer_impl.prepare_micro_batches is before


def test_refused_on_an_unsupported_verl():
    with pytest.raises(Exception, match=r"0\.8\.0"):
        trainer_progress.apply(verl_version="0.8.0")
    assert not trainer_progress.is_applied()


def test_applied_for_the_async_trainer_only(monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cuda")
    assert trainer_progress in patches.enabled_patches({"areal": {"enable": True}})
    assert trainer_progress not in patches.enabled_patches({"areal": {"enable": True, "mode": "sync"}})
    assert trainer_progress not in patches.enabled_patches({"areal": {"enable": False}})
