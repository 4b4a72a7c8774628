"""A mixture of experts with LoRA on in a real vLLM CPU engine: vLLM loads no expert of the base update verl sends.

The engine of tests/verl_vllm/test_vllm_moe_check.py with LoRA on (``enable_lora``, as verl starts it for an
adapter-only run). vLLM 0.30 wraps each expert layer for LoRA and then loads a per-expert tensor only under a name
with ``.base_layer`` after the projection (``experts.E.gate_proj.base_layer.weight``); verl 0.9.1 sends the base
weights in the checkpoint's names (``experts.E.gate_proj.weight``, which its ``resolve_weight_name`` keeps), so
vLLM loads none of them and says nothing. The after-load check groups the names either way and stops the update,
naming an expert parameter that still holds the engine's dummy start. (Generating is not tried: vLLM's LoRA kernels
for experts are Triton's, which its CPU build cannot run.)
"""

from __future__ import annotations

import os

import pytest

from areal_plugins.weight_sync.checksums import check_loaded_reports
from areal_plugins.weight_sync.errors import WeightSyncError
from tests.verl_vllm.extension_engine import ExtensionEngine, started
from tests.verl_vllm.test_vllm_moe_check import EXPERT_PARAMETER, MODEL, trainer_update

pytestmark = pytest.mark.skipif(
    not (MODEL / "config.json").exists(),
    reason="build it: areal-plugins build-tiny --workload moe --out .areal/tiny_moe",
)


def test_under_lora_vllm_loads_no_expert_from_verls_names_and_the_check_stops_the_update(monkeypatch):
    from peft import LoraConfig, get_peft_model
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VERL_RAY_JOB_ID", f"moe-lora-{os.getpid()}")  # this test's own socket
    model, _ = trainer_update(seed=1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    state = peft_model.base_model.model.state_dict().items()
    base = dict(unfuse_moe_params(((n, t.detach().clone()) for n, t in state if "lora_" not in n), "qwen2_moe"))
    with started(ExtensionEngine, MODEL, "moe-lora", enable_lora=True, max_loras=1, max_lora_rank=8) as engine:
        report = engine.update(base, peft_model.peft_config["default"].to_dict())
    experts = EXPERT_PARAMETER.format(layer=0, parameter="w13_weight").replace(".experts.", ".experts.base_layer.")
    assert experts in report["loaded"]["entries"] and report["loaded"]["not_held"] == []
    with pytest.raises(WeightSyncError, match=rf"parameter {experts} holds after loading something other"):
        check_loaded_reports([report], "replica 0")
