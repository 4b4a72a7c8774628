"""Both sides of the package's branches on the device that a CPU machine would otherwise run one side of (issue 59,
item 2; the list of every branch and what runs each side: docs/backends.md, Device branches)."""

from __future__ import annotations

from types import SimpleNamespace

import ray
import torch

from areal_plugins.rollout import verl_registration


def test_a_workers_gpus_are_rays_assignment_where_cuda_exists_and_none_elsewhere(monkeypatch):
    """``_cuda_devices`` (run in each engine worker by ``ArealRolloutReplica``): on a GPU, the ids Ray assigned; on
    the CPU platform Ray schedules verl's workers on fake ``GPU`` slots, whose ids are no devices."""
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3, 1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    devices = verl_registration._cuda_devices(None)
    assert devices == ["3", "1"]
    config = SimpleNamespace(name="areal_cpu", gpu_memory_utilization=0.5, tensor_model_parallel_size=2, dtype="bf16")
    assert verl_registration.gpu_settings(config, [*devices, "10"], hybrid=False) == {
        "devices": "1,3,10",
        "gpu_memory_utilization": 0.5,
        "tensor_parallel_size": 2,
        "dtype": "bf16",
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert verl_registration._cuda_devices(None) == []
    assert verl_registration.gpu_settings(config, [], hybrid=False) is None
