"""Per-tensor weight checksums: computed from what the trainer sent and from what each receiver got (the
``areal_gloo`` broadcast's workers, each vLLM worker), and compared on every update. Pure torch; no verl or vLLM."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from areal_plugins.weight_sync.errors import WeightSyncError

#: Relative tolerance of each sum (float64 sums of the same values may differ in their last bits between the
#: reduction kernels of the sender and the receiver); a changed weight moves them by far more.
RELATIVE_TOLERANCE = 1e-9
#: Absolute tolerance of Σx and Σ wᵢxᵢ per unit of sqrt(n·Σx²), which bounds the sum of their terms' magnitudes
#: (Cauchy-Schwarz): they may cancel to near zero, while their rounding error scales with the terms. float64
#: summation errs by ~1e-16 x log n of that bound; 1e-12 leaves a 100x margin and still names one bf16 value moved
#: by one unit in its last place on a 7B's embedding (5.4e8 values of ~0.02: tolerance 1.1e-5, the change 1.2e-4).
SUMMATION_TOLERANCE = 1e-12


#: Elements reduced at a time: a float64 copy of a whole embedding (1.1 GB in bf16 at 7B) would take 4.4 GB of
#: device memory during the weight update; a chunk's float64 values and position weights take 64 MiB each.
CHUNK_ELEMENTS = 1 << 23


#: The position weight of element ``i`` is ``frac(i·φ) - 0.5`` (φ the golden ratio's fraction): spread evenly over
#: [-0.5, 0.5) without a period, so two elements that trade places change the weighted sum. One float64 multiply and
#: floor per element, exact IEEE operations: every device computes the same weights.
GOLDEN_FRACTION = (math.sqrt(5.0) - 1.0) / 2.0


def position_weights(start: int, count: int, device: torch.device) -> torch.Tensor:
    weights = torch.arange(start, start + count, dtype=torch.float64, device=device)
    return weights.mul_(GOLDEN_FRACTION).frac_().sub_(0.5)  # in place: one chunk-sized tensor


def device_sums(tensor: torch.Tensor, as_dtype: torch.dtype | None = None, positions: bool = True) -> torch.Tensor:
    """``[Σx, Σx², Σ wᵢxᵢ]`` of ``tensor`` (first rounded to ``as_dtype``, if given) in float64, reduced on its own
    device chunk by chunk, left there (no host copy). ``positions=False``: ``[Σx, Σx²]``."""
    flat = tensor.detach().reshape(-1)
    sums = torch.zeros(3 if positions else 2, dtype=torch.float64, device=flat.device)
    start = 0
    for chunk in flat.split(CHUNK_ELEMENTS):
        values = (chunk if as_dtype is None else chunk.to(as_dtype)).to(torch.float64)
        sums[0] += values.sum()
        sums[1] += torch.dot(values, values)
        if positions:
            sums[2] += torch.dot(values, position_weights(start, values.numel(), values.device))
        start += values.numel()
    return sums


def tensor_checksum(tensor: torch.Tensor, as_dtype: torch.dtype | None = None, positions: bool = True) -> list[float]:
    """``[elements, Σx, Σx², Σ wᵢxᵢ]`` of ``tensor`` (:func:`device_sums`, one small host copy). Σx and Σx² do not
    see where a value sits; the position-weighted sum (:func:`position_weights`) does: a transposed or shuffled tensor
    changes it. ``positions=False``: ``[elements, Σx, Σx²]`` only, for comparisons that cannot use positions (after
    loading)."""
    return [float(tensor.numel()), *(float(value) for value in device_sums(tensor, as_dtype, positions).tolist())]


class PendingChecksums:
    """:func:`tensor_checksum` of many tensors, reduced where each lies as it is added and copied to the host
    together in :meth:`resolve`: one host synchronisation per device and update, not one per tensor (a 30B MoE's
    18.9k tensors were 18.9k synchronisations of a rollout GPU per update on each side of the transfer).

    The reductions are queued on the current stream when a tensor is added, so they read it before anything later on
    that stream reuses its memory; verl's nccl receiver synchronises the device before it broadcasts into a buffer
    again (``nccl_checkpoint_engine.py``, ``_receive_weight_chunks``), so a bucket's tensors are reduced before the
    next bucket overwrites them."""

    def __init__(self) -> None:
        # Keys are tensor names, or (name, what) where one tensor has several checksums (the after-load checks).
        self._pending: dict[Any, tuple[int, torch.Tensor]] = {}
        self._resolved: dict[Any, list[float]] = {}

    def add(
        self, key: Hashable, tensor: torch.Tensor, as_dtype: torch.dtype | None = None, positions: bool = True
    ) -> None:
        """Queue :func:`tensor_checksum` ``(tensor, as_dtype, positions)`` under ``key`` (no host copy)."""
        self._pending[key] = (tensor.numel(), device_sums(tensor, as_dtype, positions))

    def resolve(self) -> dict[Any, list[float]]:
        """Every added tensor's checksum (those added since the last call copied to the host, one copy per device)."""
        by_device: dict[torch.device, list[Any]] = {}
        for key, (_, sums) in self._pending.items():
            by_device.setdefault(sums.device, []).append(key)
        for keys in by_device.values():
            values = torch.cat([self._pending[key][1] for key in keys]).tolist()  # rows of 3 or 2 sums
            start = 0
            for key in keys:
                elements, sums = self._pending[key]
                self._resolved[key] = [float(elements), *(float(value) for value in values[start : start + len(sums)])]
                start += len(sums)
        self._pending.clear()
        return dict(self._resolved)


def held_sums(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """``tensor_checksum(tensor, positions=False)`` of each tensor, all read to the host at once
    (:class:`PendingChecksums`): what :func:`recheck_kept` compares later."""
    pending = PendingChecksums()
    for name, tensor in tensors.items():
        pending.add(name, tensor, positions=False)
    return pending.resolve()


#: The most changed parameters a re-check names (the count covers them all).
RECHECK_NAMED = 8


def recheck_kept(parameters: Mapping[str, torch.Tensor], kept: dict[str, list[float]]) -> dict[str, Any]:
    """Each kept checksum (of a parameter right after the load that sent it: :func:`held_sums`, or an after-load
    report's ``held``) against the parameter's now, all read to the host at once: a LoRA base is sent once, then
    only adapters, so nothing else would see it change (a wake from sleep that restores it wrong). Returns
    ``compared``, ``changed`` and up to :data:`RECHECK_NAMED` ``changed_names`` (a parameter gone counts as changed),
    what ``check_base_rechecks`` (weight_sync/adapter_check.py) reads."""
    now = held_sums({name: parameters[name] for name in kept if name in parameters})
    changed = [name for name, held in kept.items() if name not in now or not same_sums(held, now[name])]
    return {"compared": len(kept), "changed": len(changed), "changed_names": sorted(changed)[:RECHECK_NAMED]}


def same_checksum(sent: list[float], received: list[float]) -> bool:
    """The same elements, sums and position-weighted sum, up to float64 summation order."""
    if sent[0] != received[0] or len(sent) != len(received):
        return False
    terms = math.sqrt(sent[0] * abs(sent[2]))  # bounds Σ|x| and Σ|wᵢxᵢ| (|wᵢ| <= 0.5)
    pairs = zip(sent[1:], received[1:], strict=True)
    return all(
        math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE, abs_tol=max(1e-12, SUMMATION_TOLERANCE * terms))
        for a, b in pairs
    )


def check_weight_reports(
    reports: list[dict[str, Any]],
    sent: dict[str, list[float]],
    where: str,
    workers: int | None = None,
    worker_kind: str = "vLLM worker",
) -> None:
    """Raise :class:`WeightSyncError` naming the worker and the tensor where any worker's received weights differ
    from ``sent`` (the trainer's checksums), where a worker lacks a tensor or has one that was not sent, or where
    fewer than ``workers`` workers (the replica's tensor x pipeline x data parallel size) reported."""
    if not reports:
        raise WeightSyncError(f"{where}: no {worker_kind} reported the weights it received")
    ranks = sorted(int(report.get("rank", -1)) for report in reports)
    if workers is not None and ranks != list(range(workers)):
        raise WeightSyncError(
            f"{where}: the replica has {workers} {worker_kind}s, but reports came from ranks {ranks}: a worker that "
            "does not report cannot be checked"
        )
    for report in reports:
        received = report.get("checksums") or {}
        worker = f"{where}, {worker_kind} rank {report.get('rank')}"
        if report.get("name"):
            worker += f" ({report['name']})"
        missing = sorted(set(sent) - set(received))
        if missing:
            raise WeightSyncError(f"{worker}: {len(missing)} of {len(sent)} tensors never arrived, e.g. {missing[0]}")
        extra = sorted(set(received) - set(sent))
        if extra:
            raise WeightSyncError(f"{worker}: received {extra[0]}, which the trainer did not send in this update")
        for name, checksum in sent.items():
            if not same_checksum(checksum, received[name]):
                raise WeightSyncError(
                    f"{worker}: tensor {name} arrived different from what the trainer sent "
                    f"([elements, sum, sum of squares, position-weighted sum] sent {checksum}, "
                    f"received {received[name]}); "
                    "the engine would generate with weights the trainer never had"
                )


#: Names of parameters not compared after loading, kept in each ``update_checked`` record (the count is exact).
NOT_COMPARED_EXAMPLES = 12


def same_sums(expected: list[float], held: list[float]) -> bool:
    """Σx and Σx² equal up to float64 summation order (element counts differ where vLLM pads). No position-weighted
    sum: a parameter fused from several tensors, or split over tensor-parallel ranks, holds the values at other
    positions than the tensors it was loaded from (the after-load checksums are taken with ``positions=False``)."""
    scale = max(1.0, abs(expected[2]))
    return all(
        math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-12 * scale)
        for a, b in zip(expected[1:3], held[1:3], strict=True)
    )


def check_loaded_reports(reports: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """Raise :class:`WeightSyncError` naming the worker and the parameter where what a vLLM worker holds after
    loading differs from what it received (a parameter's sums against its sources'; a sharded parameter's summed
    over the tensor-parallel workers of its data-parallel and pipeline group, which must all hold a shard), where
    a whole parameter holds fewer values than it received, or where a received tensor is held by no parameter; and
    where the check compared nothing: no parameter at all, or none of the fused expert parameters the workers hold
    (``w13_weight``/``w2_weight``) without a stated reason (a check that compares nothing would pass any load).
    Returns how many parameters were compared and how many could not be."""
    loaded = [(report, report.get("loaded")) for report in reports]
    skipped = {item.get("skipped") for _, item in loaded if item and item.get("skipped")}
    if skipped:
        return {"loaded_compared": 0, "loaded_not_compared": skipped.pop()}
    shards: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    expected_of_shard: dict[str, list[float]] = {}
    tensor_parallel_size = 1
    compared: set[str] = set()
    unchecked: set[str] = set()
    for report, item in loaded:
        worker = f"{where}, vLLM worker rank {report.get('rank')}"
        if not item:
            raise WeightSyncError(f"{worker}: no report of the weights it holds after loading")
        unchecked.update(item["unchecked"])
        tensor_parallel_size = int(item.get("tensor_parallel_size", 1))
        group = tuple(item.get("shard_group", (0, 0)))
        for name, entry in item["entries"].items():
            if entry["sharded"]:
                summed = shards.get((name, group), [0.0] * len(entry["held"]))
                shards[(name, group)] = [a + b for a, b in zip(summed, entry["held"], strict=True)]
                holders.setdefault((name, group), []).append(int(report.get("rank", -1)))
                expected_of_shard[name] = entry["expected"]
                continue
            compared.add(name)
            if entry["held"][0] < entry["expected"][0]:
                raise WeightSyncError(
                    f"{worker}: parameter {name} holds {int(entry['held'][0])} values after loading, fewer than the "
                    f"{int(entry['expected'][0])} it received, without tensor parallelism: a part was never loaded"
                )
            if not same_sums(entry["expected"], entry["held"]):
                raise WeightSyncError(
                    f"{worker}: parameter {name} holds after loading something other than what it received "
                    f"([elements, sum, sum of squares] received {entry['expected']}, held {entry['held']}); the "
                    "engine would generate with weights the trainer never had"
                )
    # Held by no worker of the replica (under pipeline parallelism each worker holds only its stage's layers).
    not_held = sorted(set.intersection(*(set(item["not_held"]) for _, item in loaded if item)))
    if not_held:
        raise WeightSyncError(
            f"{where}: received {len(not_held)} tensors that no engine parameter holds after loading, e.g. "
            f"{not_held[0]} (the engine ignored them: a name the model does not know)"
        )
    for (name, group), held in shards.items():
        compared.add(name)
        ranks = sorted(holders[(name, group)])
        if len(ranks) != tensor_parallel_size:
            raise WeightSyncError(
                f"{where}: parameter {name} is sharded, but only vLLM workers {ranks} of a tensor-parallel group of "
                f"{tensor_parallel_size} hold a shard of it (data-parallel and pipeline ranks {list(group)})"
            )
        if not same_sums(expected_of_shard[name], held):
            raise WeightSyncError(
                f"{where}: parameter {name}, summed over the replica's tensor-parallel shards, holds after loading "
                f"something other than what was received (received {expected_of_shard[name]}, held {held})"
            )
    _require_compared(loaded, compared, unchecked, where)
    return {
        "loaded_compared": len(compared),
        "loaded_not_compared": len(unchecked),
        "loaded_not_compared_examples": sorted(unchecked)[:NOT_COMPARED_EXAMPLES],
    }


def _require_compared(
    loaded: list[tuple[dict[str, Any], Any]], compared: set[str], unchecked: set[str], where: str
) -> None:
    """Raise where the replica's after-load check compared nothing it should have (:func:`check_loaded_reports`)."""
    experts = [(item or {}).get("experts") or {} for _, item in loaded]
    held = sum(int(summary.get("parameters", 0)) for summary in experts)
    reasons = sorted({reason for summary in experts for reason in summary.get("not_comparable") or []})
    if held and not sum(int(summary.get("compared", 0)) for summary in experts) and not reasons:
        example = next(summary["example"] for summary in experts if summary.get("example"))
        raise WeightSyncError(
            f"{where}: its vLLM workers hold {held} fused expert parameters (w13_weight/w2_weight, e.g. {example}), "
            "and the after-load check compared none of them: neither vLLM's expert layer nor a module above it has "
            "an expert mapping (get_expert_mapping) that says which received tensor each expert's slot holds, so a "
            "wrong expert load would pass unseen; stopping (this vLLM keeps it elsewhere: "
            "rollout/verl_vllm/loaded_weights.py, expert_mapping)"
        )
    if not compared:
        examples = sorted(unchecked)[:1] or ["none"]
        raise WeightSyncError(
            f"{where}: the after-load check compared none of the {len(unchecked)} parameters its vLLM workers hold "
            f"(each was empty, overlapping or without a received source, e.g. {examples[0]}): it would pass any load; "
            "stopping"
        )
