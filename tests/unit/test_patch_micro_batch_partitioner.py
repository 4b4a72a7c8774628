"""FFD micro-batching inside verl's engine: verl's own ``prepare_micro_batches`` packs by Algorithm 1."""

from __future__ import annotations

import json

import pytest
import torch
from areal_plugins.patches import micro_batch_partitioner
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine import utils as engine_utils

from areal_plugins import patches
from tests.unit.store_ports import store_port


@pytest.fixture
def patched():
    micro_batch_partitioner.apply()
    yield
    micro_batch_partitioner.revert()


def padded_batch(lengths, width=10):
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    ids = torch.arange(len(lengths)).unsqueeze(1).expand(-1, width).clone()  # row i holds token i
    data = TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(lengths)])
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=10)
    return data


def test_verl_splits_by_the_papers_algorithm(patched, tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_RUN_DIR", str(tmp_path))
    # Hand-worked in test_microbatch: lengths 5,3,8,2,2 with budget 10 -> [[2, 3], [0, 1, 4]].
    micro_batches, indices = engine_utils.prepare_micro_batches(padded_batch([5, 3, 8, 2, 2]))
    assert indices == [[2, 3], [0, 1, 4]]
    assert [mb["input_ids"][:, 0].tolist() for mb in micro_batches] == [[2, 3], [0, 1, 4]]
    record = json.loads((tmp_path / "micro_batches.jsonl").read_text())
    assert record["tokens"] == [10, 10] and record["padded_tokens"] == [16, 15] and record["capacity"] == 10


def test_where_verl_pads_it_cuts_runs_of_like_length_within_the_padded_budget(patched, tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_RUN_DIR", str(tmp_path))
    # Lengths 5,3,8,2,2, budget 10, verl padding each micro-batch: sorted 8(i2) 5(i0) 3(i1) 2(i3) 2(i4);
    # 10 // 8 = 1, 10 // 5 = 2, 10 // 2 = 5 for the rest -> [[2], [0, 1], [3, 4]], padded 8 + 10 + 4.
    data = padded_batch([5, 3, 8, 2, 2])
    tu.assign_non_tensor(data, use_remove_padding=False)
    micro_batches, indices = engine_utils.prepare_micro_batches(data)
    assert indices == [[2], [0, 1], [3, 4]]
    assert [mb["input_ids"][:, 0].tolist() for mb in micro_batches] == [[2], [0, 1], [3, 4]]
    record = json.loads((tmp_path / "micro_batches.jsonl").read_text())
    assert record["strategy"] == "padded_runs" and record["padded_tokens"] == [8, 10, 4]


def test_verl_would_partition_differently(patched):
    # Lengths 4,4,3,3,3,3, budget 10. FFD: 4,4 share G0 (8); the 3s do not fit there: G1 = 3,3,3 (9),
    # the last 3 opens G2. verl: ceil(20/10) = 2 micro-batches balancing sum of squares 68 -> {4,3,3} twice.
    data = padded_batch([4, 4, 3, 3, 3, 3])
    _, ffd_indices = engine_utils.prepare_micro_batches(data)
    assert ffd_indices == [[0, 1], [2, 3, 4], [5]]
    original = micro_batch_partitioner.PATCH.original("verl.workers.engine.utils", "rearrange_micro_batches")
    _, verl_indices = original(padded_batch([4, 4, 3, 3, 3, 3]), max_token_len=10)
    assert len(verl_indices) == 2 and all(sorted(g)[0] in (0, 1) and len(g) == 3 for g in verl_indices)


def test_revert_restores_verls_partitioner():
    before = engine_utils.rearrange_micro_batches
    micro_batch_partitioner.apply()
    assert engine_utils.rearrange_micro_batches is not before
    micro_batch_partitioner.revert()
    assert engine_utils.rearrange_micro_batches is before


def test_apply_is_idempotent():
    before = engine_utils.rearrange_micro_batches
    try:
        micro_batch_partitioner.apply()
        first = engine_utils.rearrange_micro_batches
        micro_batch_partitioner.apply()
        assert engine_utils.rearrange_micro_batches is first  # not a patch of the patch
    finally:
        micro_batch_partitioner.revert()
    assert engine_utils.rearrange_micro_batches is before


def test_refused_on_unsupported_verl():
    from areal_plugins._compat import UnsupportedVerlVersionError

    before = engine_utils.rearrange_micro_batches
    with pytest.raises(UnsupportedVerlVersionError, match=r"verl 0\.10\.0 is installed"):
        micro_batch_partitioner.apply(verl_version="0.10.0")
    assert not micro_batch_partitioner.is_applied() and engine_utils.rearrange_micro_batches is before


def test_a_patch_that_fails_on_its_second_target_changes_nothing():
    import types

    from areal_plugins.patches._base import AttributePatch
    from packaging.specifiers import SpecifierSet

    first, second = types.ModuleType("areal_test_first"), types.ModuleType("areal_test_second")
    first.target = "original"
    import sys

    sys.modules.update({"areal_test_first": first, "areal_test_second": second})  # second lacks "target"
    try:
        patch = AttributePatch(
            "two_targets",
            (("areal_test_first", "target"), ("areal_test_second", "target")),
            lambda original: "patched",
            SpecifierSet(">=0"),
        )
        with pytest.raises(AttributeError):
            patch.apply()
        assert first.target == "original" and not patch.is_applied()
    finally:
        del sys.modules["areal_test_first"], sys.modules["areal_test_second"]


def test_grouped_samples_keep_verls_partitioner(patched):
    data = padded_batch([5, 3, 8, 2])
    tu.assign_non_tensor(data, force_group_size=2)
    _, indices = engine_utils.prepare_micro_batches(data)
    assert all(len(group) % 2 == 0 for group in indices)  # verl's grouped split, whole pairs


def test_enabled_only_by_the_setting():
    assert micro_batch_partitioner not in patches.enabled_patches({"areal": {"enable": True}})
    on = {"areal": {"enable": True, "micro_batch": {"max_tokens": 512}}}
    assert micro_batch_partitioner in patches.enabled_patches(on)
    off = {"areal": {"enable": False, "micro_batch": {"max_tokens": 512}}}
    assert micro_batch_partitioner not in patches.enabled_patches(off)


def _agree(rank, port, lengths, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results[rank] = micro_batch_partitioner.ffd_partition_agreed(lengths[rank], 10, 1, dp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_agree_on_the_count():
    # Rank 0: 8 and 8 need two micro-batches; rank 1: 2 and 2 fit one, so it re-packs with min_groups=2.
    import torch.multiprocessing as mp

    port = store_port()
    results = mp.Manager().dict()
    mp.start_processes(_agree, args=(port, [[8, 8], [2, 2]], results), nprocs=2, start_method="fork")
    assert results[0] == [[0], [1]] and results[1] == [[0], [1]]


def test_the_count_is_all_reduced_on_verls_device(monkeypatch):
    """verl's own partitioner all-reduces on ``get_device_name()``; with sequence parallelism the data-parallel
    group is a CUDA mesh, where a CPU tensor fails. The tensor goes to the device verl names, whatever it is."""
    import torch.distributed as dist
    import verl.utils.device as verl_device

    asked: list[object] = []
    make = torch.tensor

    def tensor(*args, device=None, **kwargs):
        asked.append(device)
        return make(*args, **kwargs)  # built on CPU: this box has no such device

    monkeypatch.setattr(verl_device, "get_device_name", lambda: "npu")  # a device no CPU default gives
    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: None)  # one rank: all agree
    micro_batch_partitioner.ffd_partition_agreed([5, 3, 8, 2, 2], 10, 1, dp_group=object())
    assert asked == ["npu"]
