"""Checksums of a weight update copied to the host once, not once per tensor (issue 59: a 30B MoE's 18.9k tensors
were 18.9k host synchronisations of a rollout GPU per update on each side of the transfer)."""

from __future__ import annotations

import torch

from areal_plugins.weight_sync.checksums import PendingChecksums, tensor_checksum

#: Qwen3-30B-A3B's tensor count as verl sends it (48 layers x 128 experts x 3 projections + the dense rest).
TENSORS_30B_A3B = 18_900


def test_pending_checksums_equal_the_per_tensor_ones():
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 5, generator=generator),
        "b": torch.randn(300, generator=generator).to(torch.bfloat16),
        "c": torch.zeros(0),
        "d": torch.randn(3, 4, generator=generator).t(),  # not contiguous
    }
    pending = PendingChecksums()
    for name, tensor in tensors.items():
        pending.add(name, tensor)
    assert pending.resolve() == {name: tensor_checksum(tensor) for name, tensor in tensors.items()}


def test_a_tensor_changed_after_it_was_added_keeps_the_checksum_of_when_it_was_added():
    tensor = torch.ones(4)
    pending = PendingChecksums()
    pending.add("w", tensor)
    tensor += 1  # the transport reusing its buffer for the next bucket
    assert pending.resolve()["w"] == tensor_checksum(torch.ones(4))


def test_an_update_of_a_30b_moe_is_one_host_copy_instead_of_one_per_tensor(monkeypatch):
    """Emulated on the CPU: host copies of checksum values counted (``Tensor.tolist``, the one copy each path takes)."""
    copies = 0
    tolist = torch.Tensor.tolist

    def counted(self):
        nonlocal copies
        copies += 1
        return tolist(self)

    tensors = [torch.full((2,), float(i)) for i in range(TENSORS_30B_A3B)]
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    for tensor in tensors:
        tensor_checksum(tensor)
    per_tensor, copies = copies, 0
    pending = PendingChecksums()
    for index, tensor in enumerate(tensors):
        pending.add(str(index), tensor)
    resolved = pending.resolve()
    assert (per_tensor, copies) == (TENSORS_30B_A3B, 1)
    assert resolved["7"] == [2.0, 14.0, 98.0, tensor_checksum(tensors[7])[3]]


def test_checksums_without_positions_or_rounded_are_read_with_the_others():
    """The after-load checks queue ``[elements, Σx, Σx²]`` (no positions) and a float32 tensor's sums rounded to the
    engine's dtype beside the transfer's four numbers, under keys of their own; one read gives each its own."""
    tensor = torch.tensor([1.0, 2.0 + 2**-10, -3.0])  # 2 + 2^-10 rounds to 2 in bfloat16 (7 mantissa bits)
    pending = PendingChecksums()
    pending.add("w", tensor)
    pending.add(("w", "rounded"), tensor, torch.bfloat16, positions=False)
    pending.add(("w", "held"), tensor, positions=False)
    resolved = pending.resolve()
    assert resolved["w"] == tensor_checksum(tensor)
    assert resolved[("w", "rounded")] == [3.0, 0.0, 14.0]  # 1 + 2 - 3, 1 + 4 + 9
    assert resolved[("w", "held")] == [3.0, 2**-10, 1.0 + (2.0 + 2**-10) ** 2 + 9.0]
