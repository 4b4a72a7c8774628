"""Methods added to every vLLM worker (``--worker-extension-cls``), called through ``/collective_rpc``.

This file runs inside the vLLM environment, which has neither verl nor areal_plugins installed: it
imports only torch and is copied next to the server as a top-level module
(:data:`areal_plugins.rollout.vllm.process.EXTENSION_MODULE`).
"""

from __future__ import annotations

from typing import Any

import torch


def layout_free_checksum(tensors) -> list[float]:
    """[element count, Σx, Σx²] in float64 over ``tensors``.

    vLLM fuses q/k/v and gate/up projections into single parameters; sums over all elements do not
    depend on how tensors are split or concatenated, so the trainer can compute the same numbers
    from its own (unfused) state dict.
    """
    count, total, squares = 0, 0.0, 0.0
    for tensor in tensors:
        values = tensor.detach().to(torch.float64)
        count += values.numel()
        total += float(values.sum())
        squares += float((values * values).sum())
    return [float(count), total, squares]


class ArealWorkerExtension:
    """Weight reload that reports the version and a checksum of every tensor the model loader took.

    The checksum is taken on the way into vLLM's loader, not from the parameters afterwards: on CPU
    vLLM packs linear weights into oneDNN handles and leaves empty parameters behind, so memory
    cannot be summed. A stale or skipped reload reports the old version or another checksum.
    """

    model_runner: Any  # set by vLLM's worker, which this class is mixed into

    def areal_reload(self, weights_path: str, version: int) -> dict:
        from pathlib import Path

        from safetensors import safe_open

        loaded: list = []

        def tensors():
            for path in sorted(Path(weights_path).glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        tensor = handle.get_tensor(name)
                        loaded.append(tensor)
                        yield name, tensor

        self.model_runner.reload_weights(weights_iterator=tensors())
        self.areal_version = version
        self.areal_checksum = layout_free_checksum(loaded)
        self.areal_tensors = len(loaded)
        return self.areal_report()

    def areal_report(self) -> dict:
        return {
            "version": getattr(self, "areal_version", 0),
            "checksum": getattr(self, "areal_checksum", None),
            "tensors": getattr(self, "areal_tensors", 0),
        }
