"""The worker's GPU loading path run on the CPU (needs vLLM: runs in ``.venv-verl-vllm``).

On a GPU our worker extension loads each bucket as it arrives through verl's own loading (``update_weights_from_ipc``:
the model's ``load_weights`` per bucket, then ``process_weights_after_loading``), with our checksums of what arrived
and of what each parameter holds after loading. On the CPU platform it gathers the buckets and calls the model
runner's ``reload_weights`` instead (worker_extension.py, ``_update_weights_on_cpu``): vLLM's CPU build moves its
linear layers' weights into its kernels' state (oneDNN, or the SGL kernel for small layers), leaving parameters
without a ``weight_loader`` that a second ``load_weights`` fails on. vLLM's fallback kernel (torch's ``linear``) keeps
the weights where they are, as a GPU's layers keep theirs; with it, the test-only switch
``ArealVLLMWorkerExtension.areal_load_in_place`` takes the GPU path on the CPU, so the code a GPU runs for a full
update runs here.

The tiny Qwen2 (2 layers, tied embeddings): vLLM holds 17 parameters, per layer ``qkv_proj`` weight and bias,
``o_proj``, ``gate_up_proj``, ``down_proj`` and two norms (7), the final norm, the embedding and its tied
``lm_head`` under its own module. The tied ``lm_head.weight`` is not sent: vLLM 0.30's ``load_weights`` refuses it in
a call without the embedding (``AutoWeightsLoader._check_skipped_aliases``), and the two (8.4 MB each in float32) do
not fit one 16 MB bucket. So 16 are compared after loading, every one that has a source (9 where the CPU build moved
the 8 linear weights away: docs/backends.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from areal_plugins.rollout.verl_vllm.worker_extension import ArealVLLMWorkerExtension
from areal_plugins.testing import faults
from areal_plugins.weight_sync.checksums import check_loaded_reports, check_weight_reports, tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError
from tests.verl_vllm.extension_engine import ExtensionEngine, started

MODEL = Path(__file__).resolve().parents[2] / ".areal" / "tiny" / "model"
COMPARED = 2 * 7 + 2  # all but the tied lm_head, not sent

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="build it: areal-plugins build-tiny")


@pytest.fixture(scope="module")
def engine() -> Iterator[ExtensionEngine]:
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    patch = pytest.MonkeyPatch()
    patch.setattr(_custom_ops, "_supports_onednn", False)  # vLLM's CPU GEMM dispatch: torch's linear, weights kept
    patch.setattr(utils, "check_cpu_sgl_kernel", lambda *args: False)
    patch.setattr(ArealVLLMWorkerExtension, "areal_load_in_place", True)
    patch.setattr(ArealVLLMWorkerExtension, "_update_weights_on_cpu", cpu_path_taken)
    try:
        with started(ExtensionEngine, MODEL, "gpu-load-path") as engine:
            yield engine
    finally:
        patch.undo()


def cpu_path_taken(*args, **kwargs) -> None:
    raise AssertionError("the worker took its CPU loading path (_update_weights_on_cpu), not the GPU one")


def trainer_weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    return {
        name: tensor.detach().clone() * scale for name, tensor in model.state_dict().items() if name != "lm_head.weight"
    }


def checked(report: dict, sent: dict[str, torch.Tensor]) -> dict:
    check_weight_reports([report], {name: tensor_checksum(t) for name, t in sent.items()}, "replica 0", 1)
    return check_loaded_reports([report], "replica 0")


def test_every_parameter_is_compared_on_each_update_through_verls_loading(engine):
    for scale in (1.0, 0.5):  # a second load_weights into the same parameters: what the CPU build cannot do
        sent = trainer_weights(scale)
        report = engine.update(sent)
        assert checked(report, sent)["loaded_compared"] == COMPARED


def test_a_value_changed_after_loading_is_named(engine, monkeypatch):
    monkeypatch.setenv(faults.CORRUPT_LOADED_ENV, "model.layers.1.mlp.down_proj.weight")
    sent = trainer_weights(0.25)
    report = engine.update(sent)
    with pytest.raises(WeightSyncError, match=r"parameter model\.layers\.1\.mlp\.down_proj\.weight holds after"):
        checked(report, sent)
