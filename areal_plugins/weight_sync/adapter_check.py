"""The per-update check of a LoRA adapter: what each engine rank holds after loading against what the trainer sent.

Under LoRA verl sends the adapter only (peft's ``lora_A``/``lora_B`` tensors; docs/design.md, LoRA). An engine
that loads it keeps its own copies: vLLM registers the adapter (``lora_B`` multiplied by ``lora_alpha / r`` in the
engine's dtype, ``LoRALayerWeights.optimize``) and writes each tensor-parallel rank's part of it into its LoRA
layers. Each rank reports, under the trainer's tensor names, three checksums per tensor (``[elements, Σx, Σx²,
Σ wᵢxᵢ]``, weight_sync/checksums.py), each compared position by position:

* ``received``: the tensor as it arrived, compared with what the trainer sent (a transposed or shuffled tensor is
  named);
* ``expected``: what the rank should hold of it, computed on the rank from what it received by the engine's own
  operations (the scaling, the cast, and under tensor parallelism the layer's own cut of this rank's part), so no
  tolerance has to guess the rounding; absent where the engine holds the tensor as received;
* ``held``: what the rank holds, compared with ``expected`` (each rank on its own: no sum over ranks).

Each way an adapter goes wrong stops the run naming the replica, the rank and the tensor:

* it never arrives: a rank holds no adapter at all, or lacks some of its tensors (verl issue #7495: in
  disaggregated mode the engines sampled from the initial policy for the whole run);
* it arrives partly: a rank holds fewer values of a tensor than it should;
* it is loaded under the wrong name: a rank holds a tensor the trainer did not send; when its values are those of a
  sent tensor that is missing, the error names both (an adapter for one module applied to another);
* it arrives or is loaded different: its values differ from what was sent, or from what the engine should hold.

Pure: no verl, vLLM or Ray; the ranks' reports are plain dictionaries.
"""

from __future__ import annotations

from typing import Any

from areal_plugins.weight_sync.checksums import same_checksum
from areal_plugins.weight_sync.errors import WeightSyncError


def check_adapter_reports(
    sent: dict[str, list[float]], reports: list[dict[str, Any]], version: int, ranks_per_replica: int | None = None
) -> dict[str, int]:
    """Raise :class:`WeightSyncError` where any engine rank's adapter differs from ``sent``; return how many tensors
    and ranks were compared.

    Args:
        sent: the trainer's checksum of every adapter tensor of update ``version``, by name.
        reports: one per engine rank: ``replica``, ``rank`` (within its replica) and ``adapter``: trainer tensor
            name -> ``{"received", "held", "expected" (optional)}``, or None when the rank holds no adapter.
        version: the policy version of the update (named in the errors).
        ranks_per_replica: the engine ranks of each replica; a replica with fewer reports cannot be checked.
    """
    if not sent:
        raise WeightSyncError(f"update {version}: the trainer sent no adapter tensors, so no engine can hold one")
    by_replica: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        by_replica.setdefault(str(report.get("replica", "?")), []).append(report)
    if not by_replica:
        raise WeightSyncError(f"update {version}: no engine rank reported the LoRA adapter it holds")
    for replica, replica_reports in sorted(by_replica.items()):
        _check_replica(sent, replica, sorted(replica_reports, key=_rank), version, ranks_per_replica)
    return {"adapter_tensors": len(sent), "adapter_ranks": len(reports)}


def _rank(report: dict[str, Any]) -> int:
    return int(report.get("rank", -1))


def _check_replica(
    sent: dict[str, list[float]],
    replica: str,
    reports: list[dict[str, Any]],
    version: int,
    ranks_per_replica: int | None,
) -> None:
    where = f"rollout replica {replica}, update {version}"
    ranks = [_rank(report) for report in reports]
    if ranks_per_replica is not None and ranks != list(range(ranks_per_replica)):
        raise WeightSyncError(
            f"{where}: the replica has {ranks_per_replica} engine ranks, but adapter reports came from ranks {ranks}: "
            "a rank that does not report cannot be checked"
        )
    for report in reports:
        rank_where = f"rollout replica {replica}, engine rank {_rank(report)}, update {version}"
        adapter = report.get("adapter")
        if not adapter:
            raise WeightSyncError(
                f"{rank_where}: holds no LoRA adapter after the update (the trainer sent {len(sent)} adapter tensors, "
                f"e.g. {min(sent)}): the engine would sample from the base model, not the policy"
            )
        _check_names(sent, adapter, rank_where)
        for name, entry in sorted(adapter.items()):
            if not same_checksum(sent[name], entry["received"]):
                raise WeightSyncError(
                    f"{rank_where}: adapter tensor {name} arrived different from what the trainer sent "
                    f"([elements, sum, sum of squares, position-weighted sum] sent {sent[name]}, received "
                    f"{entry['received']})"
                )
            expected = entry.get("expected") or entry["received"]
            held = entry["held"]
            if held[0] < expected[0]:
                raise WeightSyncError(
                    f"{rank_where}: adapter tensor {name} arrived partly: the engine holds {int(held[0])} of the "
                    f"{int(expected[0])} values it should hold"
                )
            if not same_checksum(expected, held):
                raise WeightSyncError(
                    f"{rank_where}: adapter tensor {name} is held as other values than it arrived as (should hold "
                    f"{expected}, holds {held}): the engine would sample with an adapter the trainer never had"
                )


def _check_names(sent: dict[str, list[float]], adapter: dict[str, Any], where: str) -> None:
    missing = sorted(set(sent) - set(adapter))
    for name in sorted(set(adapter) - set(sent)):
        twins = [m for m in missing if same_checksum(sent[m], adapter[name]["received"])]
        if twins:
            raise WeightSyncError(
                f"{where}: adapter tensor {twins[0]} was loaded under the name {name}: the engine applies it to "
                "another module than the trainer trained it for"
            )
        raise WeightSyncError(
            f"{where}: holds adapter tensor {name}, which the trainer did not send in this update (a stale or "
            "misnamed adapter)"
        )
    if missing:
        raise WeightSyncError(
            f"{where}: {len(missing)} of {len(sent)} adapter tensors never arrived, e.g. {missing[0]}"
        )


def check_base_rechecks(
    reports: list[dict[str, Any]], where: str, version: int, worker_kind: str = "vLLM worker"
) -> int:
    """Raise :class:`WeightSyncError` where an engine rank's LoRA base weights changed since the load that sent them
    (each report's ``base_recheck``: weight_sync/checksums.py ``recheck_kept``, from rollout/verl_vllm/
    loaded_weights.py's ``recheck_held`` or rollout/cpu/lora.py's ``recheck_base``), or where a rank re-checked none
    (it kept no checksums from that load: nothing would be seen). Returns the parameters re-checked per rank."""
    compared = 0
    for report in reports:
        rank_where = f"{where}, {worker_kind} rank {report.get('rank')}, update {version}"
        recheck = report.get("base_recheck") or {}
        if not recheck.get("compared"):
            raise WeightSyncError(
                f"{rank_where}: re-checked none of the LoRA base weights (no checksums kept from the load that sent "
                "them): a base the engine restored wrong after sleeping would go unseen"
            )
        if recheck["changed"]:
            raise WeightSyncError(
                f"{rank_where}: {recheck['changed']} LoRA base parameter(s) changed since the load that sent them "
                f"(e.g. {', '.join(recheck['changed_names'])}); the base is sent once, so the engine now samples from "
                "other weights than the trainer's"
            )
        compared = max(compared, int(recheck["compared"]))
    return compared
