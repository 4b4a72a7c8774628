"""Per-tensor weight checksums: computed by the trainer from what it sent, by each vLLM worker from what it
received, and compared after every update. Pure torch; no verl or vLLM."""

from __future__ import annotations

import math
from typing import Any

import torch

from areal_plugins.rollout.base import WeightSyncError

#: Relative tolerance of Σx and Σx² (float64 sums of the same values may differ in their last bits between the
#: reduction kernels of the sender and the receiver); a changed weight moves them by far more.
RELATIVE_TOLERANCE = 1e-9


#: Elements reduced at a time: a float64 copy of a whole embedding (1.1 GB in bf16 at 7B) would take 4.4 GB of
#: device memory during the weight update; a chunk takes 128 MiB.
CHUNK_ELEMENTS = 1 << 24


def tensor_checksum(tensor: torch.Tensor) -> list[float]:
    """``[elements, Σx, Σx²]`` of ``tensor`` in float64, reduced on its own device chunk by chunk (one 2-number
    host copy at the end)."""
    flat = tensor.detach().reshape(-1)
    sums = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for chunk in flat.split(CHUNK_ELEMENTS):
        values = chunk.to(torch.float64)
        sums[0] += values.sum()
        sums[1] += values.square().sum()
    total, squares = sums.tolist()
    return [float(flat.numel()), float(total), float(squares)]


def _same(sent: list[float], received: list[float]) -> bool:
    if sent[0] != received[0]:
        return False
    pairs = zip(sent[1:], received[1:], strict=True)
    return all(math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-12) for a, b in pairs)


def check_weight_reports(reports: list[dict[str, Any]], sent: dict[str, list[float]], where: str) -> None:
    """Raise :class:`WeightSyncError` naming the worker and the tensor where any worker's received weights differ
    from ``sent`` (the trainer's checksums), or where a worker lacks a tensor or has one that was not sent."""
    if not reports:
        raise WeightSyncError(f"{where}: no vLLM worker reported the weights it received")
    for report in reports:
        received = report.get("checksums") or {}
        worker = f"{where}, vLLM worker rank {report.get('rank')}"
        missing = sorted(set(sent) - set(received))
        if missing:
            raise WeightSyncError(f"{worker}: {len(missing)} of {len(sent)} tensors never arrived, e.g. {missing[0]}")
        extra = sorted(set(received) - set(sent))
        if extra:
            raise WeightSyncError(f"{worker}: received {extra[0]}, which the trainer did not send in this update")
        for name, checksum in sent.items():
            if not _same(checksum, received[name]):
                raise WeightSyncError(
                    f"{worker}: tensor {name} arrived different from what the trainer sent "
                    f"([elements, sum, sum of squares] sent {checksum}, received {received[name]}); "
                    "the engine would generate with weights the trainer never had"
                )
