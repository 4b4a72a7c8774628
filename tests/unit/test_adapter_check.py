"""The per-update LoRA adapter check (weight_sync/adapter_check.py): what each engine rank holds against what the
trainer sent. The ranks' holdings are built here the way vLLM builds them, independently of the code under test:
the registered adapter whole, with ``lora_B`` multiplied by ``lora_alpha / r`` (``LoRALayerWeights.optimize``),
and under tensor parallelism each rank its part of it (``lora_B`` of a column-parallel layer by output rows, its
``lora_A`` whole), which the rank compares with the same cut of what it received. Each test changes one thing on the
receiving side, as a fault would, and the error must name the replica, the rank and the tensor."""

from __future__ import annotations

import pytest
import torch

from areal_plugins.weight_sync.adapter_check import check_adapter_reports
from areal_plugins.weight_sync.checksums import tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
V_A = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
V_B = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
SCALING = 16 / 6  # lora_alpha / r, not a power of two: the scaled values round


def adapter() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rank, hidden = 6, 16
    return {
        Q_A: torch.randn(rank, hidden, generator=generator),
        Q_B: torch.randn(hidden, rank, generator=generator),
        V_A: torch.randn(rank, hidden, generator=generator),
        V_B: torch.randn(hidden // 2, rank, generator=generator),
    }


def sent_of(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {name: tensor_checksum(tensor) for name, tensor in tensors.items()}


def engine_copy(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor * SCALING if ".lora_B." in name else tensor.clone()


def whole(received: dict[str, torch.Tensor], replica: int = 0, held: dict | None = None) -> dict:
    """One rank: what arrived, what it should hold of it (the engine's operation on it) and what it holds."""
    held = held or {name: engine_copy(name, tensor) for name, tensor in received.items()}
    entries = {
        name: {
            "received": tensor_checksum(tensor),
            "expected": tensor_checksum(engine_copy(name, tensor)),
            "held": tensor_checksum(held[name]),
        }
        for name, tensor in received.items()
    }
    return {"replica": replica, "rank": 0, "tensor_parallel_size": 1, "adapter": entries}


def rank_part(name: str, tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """What ``rank`` of ``ranks`` holds of a column-parallel layer's tensor: ``lora_B``'s rows, ``lora_A`` whole."""
    return tensor.chunk(ranks, dim=0)[rank] if ".lora_B." in name else tensor


def sliced(received: dict[str, torch.Tensor], ranks: int, replica: int = 0) -> list[dict]:
    """Each rank: what arrived (whole), its part of what the engine should hold, and that part held."""
    reports = []
    for rank in range(ranks):
        entries = {}
        for name, tensor in received.items():
            part = tensor_checksum(rank_part(name, engine_copy(name, tensor), rank, ranks))
            entries[name] = {"received": tensor_checksum(tensor), "expected": part, "held": part}
        reports.append({"replica": replica, "rank": rank, "tensor_parallel_size": ranks, "adapter": entries})
    return reports


def test_an_adapter_held_as_sent_passes_whole_and_in_slices():
    tensors = adapter()
    assert check_adapter_reports(sent_of(tensors), [whole(tensors)], version=3, ranks_per_replica=1) == {
        "adapter_tensors": 4,
        "adapter_ranks": 1,
    }
    check_adapter_reports(sent_of(tensors), sliced(tensors, ranks=2), version=3, ranks_per_replica=2)


def test_an_adapter_that_never_arrived_names_the_replica_and_rank():
    tensors = adapter()
    reports = [whole(tensors, replica=0), {"replica": 1, "rank": 0, "adapter": None}]
    with pytest.raises(WeightSyncError, match=r"rollout replica 1, engine rank 0, update 5: holds no LoRA adapter"):
        check_adapter_reports(sent_of(tensors), reports, version=5)


def test_an_empty_adapter_report_compares_nothing_and_stops_naming_what_was_sent():
    """A rank that holds an adapter but reads no slot of it (no LoRA layer found) reports nothing to compare."""
    tensors = adapter()
    with pytest.raises(
        WeightSyncError, match=rf"engine rank 0, update 2: holds no LoRA adapter .*sent 4 adapter tensors, e\.g\. {Q_A}"
    ):
        check_adapter_reports(sent_of(tensors), [{"replica": 0, "rank": 0, "adapter": {}}], version=2)


def test_a_tensor_that_never_arrived_is_named():
    tensors = adapter()
    report = whole(tensors, replica=2)
    del report["adapter"][V_B]
    with pytest.raises(WeightSyncError, match=rf"rollout replica 2, engine rank 0, update 1: 1 of 4 .*e\.g\. {V_B}"):
        check_adapter_reports(sent_of(tensors), [report], version=1)


def test_a_tensor_held_short_is_a_partial_arrival():
    tensors = adapter()
    held = {name: engine_copy(name, tensor) for name, tensor in tensors.items()}
    held[Q_A] = held[Q_A][:3]  # half its rows
    with pytest.raises(
        WeightSyncError, match=rf"engine rank 0, update 1: adapter tensor {Q_A} arrived partly: .* 48 of"
    ):
        check_adapter_reports(sent_of(tensors), [whole(tensors, held=held)], version=1)


def test_a_slice_held_short_on_one_rank_is_a_partial_arrival():
    tensors = adapter()
    reports = sliced(tensors, ranks=2)
    short = engine_copy(Q_B, tensors[Q_B]).chunk(2, dim=0)[1][:4]  # rank 1 holds half of its slice of q's lora_B
    reports[1]["adapter"][Q_B]["held"] = tensor_checksum(short)
    with pytest.raises(
        WeightSyncError, match=rf"engine rank 1, update 1: adapter tensor {Q_B} arrived partly: .* 24 of the 48"
    ):
        check_adapter_reports(sent_of(tensors), reports, version=1)


def test_a_rank_that_does_not_report_cannot_be_checked():
    tensors = adapter()
    with pytest.raises(WeightSyncError, match=r"2 engine ranks, but adapter reports came from ranks \[0\]"):
        check_adapter_reports(sent_of(tensors), sliced(tensors, ranks=2)[:1], version=1, ranks_per_replica=2)


def test_a_tensor_loaded_under_another_name_names_both():
    tensors = adapter()
    report = whole(tensors)
    other = Q_A.replace("layers.0.", "layers.1.")
    report["adapter"][other] = report["adapter"].pop(Q_A)
    with pytest.raises(WeightSyncError, match=rf"adapter tensor {Q_A} was loaded under the name {other}"):
        check_adapter_reports(sent_of(tensors), [report], version=1)


def test_a_stale_tensor_the_trainer_did_not_send_is_named():
    tensors = adapter()
    report = whole(tensors)
    stale = tensor_checksum(torch.ones(3))
    report["adapter"]["base_model.model.lm_head.lora_A.weight"] = {"received": stale, "held": stale}
    with pytest.raises(
        WeightSyncError, match=r"holds adapter tensor base_model\.model\.lm_head\.lora_A\.weight, which"
    ):
        check_adapter_reports(sent_of(tensors), [report], version=1)


def test_a_value_changed_in_transit_is_named():
    tensors = adapter()
    received = {name: tensor.clone() for name, tensor in tensors.items()}
    received[V_A][3, 5] += 1e-3
    with pytest.raises(WeightSyncError, match=rf"engine rank 0, update 1: adapter tensor {V_A} arrived different"):
        check_adapter_reports(sent_of(tensors), [whole(received)], version=1)


def test_two_rows_trading_places_in_transit_are_named():
    tensors = adapter()
    received = {name: tensor.clone() for name, tensor in tensors.items()}
    received[Q_A] = received[Q_A][[1, 0, 2, 3, 4, 5]]
    with pytest.raises(WeightSyncError, match=rf"adapter tensor {Q_A} arrived different"):
        check_adapter_reports(sent_of(tensors), [whole(received)], version=1)


def test_a_value_changed_after_loading_is_named():
    tensors = adapter()
    held = {name: engine_copy(name, tensor) for name, tensor in tensors.items()}
    held[V_B][0, 0] += 1e-3
    with pytest.raises(WeightSyncError, match=rf"adapter tensor {V_B} is held as other values than it arrived as"):
        check_adapter_reports(sent_of(tensors), [whole(tensors, held=held)], version=1)


def test_an_unscaled_lora_b_is_not_what_the_engine_should_hold():
    tensors = adapter()
    held = {name: engine_copy(name, tensor) for name, tensor in tensors.items()}
    held[Q_B] = tensors[Q_B].clone()  # registered without lora_alpha / r
    with pytest.raises(WeightSyncError, match=rf"adapter tensor {Q_B} is held as other values"):
        check_adapter_reports(sent_of(tensors), [whole(tensors, held=held)], version=1)


def test_a_slice_changed_on_one_rank_is_named_with_its_rank():
    tensors = adapter()
    reports = sliced(tensors, ranks=2)
    part = engine_copy(V_B, tensors[V_B]).chunk(2, dim=0)[1].clone()
    part[0, 0] += 0.5
    reports[1]["adapter"][V_B]["held"] = tensor_checksum(part)
    with pytest.raises(WeightSyncError, match=rf"engine rank 1, update 1: adapter tensor {V_B} is held as other"):
        check_adapter_reports(sent_of(tensors), reports, version=1)


def test_an_update_without_adapter_tensors_is_refused():
    with pytest.raises(WeightSyncError, match=r"update 4: the trainer sent no adapter tensors"):
        check_adapter_reports({}, [], version=4)


def test_two_rows_of_a_slice_trading_places_on_one_rank_are_named():
    """Each rank's part is compared position by position: values in other places are not the same part."""
    tensors = adapter()
    reports = sliced(tensors, ranks=2)
    part = engine_copy(Q_B, tensors[Q_B]).chunk(2, dim=0)[0]
    reports[0]["adapter"][Q_B]["held"] = tensor_checksum(part[[1, 0, *range(2, 8)]])
    with pytest.raises(WeightSyncError, match=rf"engine rank 0, update 1: adapter tensor {Q_B} is held as other"):
        check_adapter_reports(sent_of(tensors), reports, version=1)
