"""The trainer-side adapter of our rollout backends finds its replica from ``RANK``, as verl's vLLM adapter does.

verl's ``CheckpointEngineWorker`` builds the adapter before its process group exists: read from
``torch.distributed`` there, every rank is 0, and with tensor parallel 2 both ranks of a replica would lead it
and send the same weights to one server at once.
"""

from __future__ import annotations

import pytest
import torch

from areal_plugins.rollout.verl_registration import process_rank, replica_position


def test_rank_comes_from_the_environment_before_any_process_group(monkeypatch):
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "3")
    assert process_rank() == 3


def test_without_rank_a_single_process_is_rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert process_rank() == 0


@pytest.mark.parametrize(
    ("rank", "replica", "leads"),
    # Tensor parallel 2: ranks 0,1 form replica 0 (rank 0 leads), ranks 2,3 replica 1 (rank 2 leads).
    [(0, 0, True), (1, 0, False), (2, 1, True), (3, 1, False)],
)
def test_tensor_parallel_two_has_one_leader_per_replica(monkeypatch, rank, replica, leads):
    monkeypatch.setenv("RANK", str(rank))
    assert replica_position(process_rank(), rollout_world=2) == (replica, leads)


def test_an_explicit_replica_rank_wins():
    assert replica_position(5, rollout_world=2, replica_rank=7) == (7, False)
