"""The LoRA adapter check against a real vLLM CPU engine (needs vLLM: runs in ``.venv-verl-vllm``).

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, no Ray) on the tiny Qwen2, with LoRA on and our worker
extension, started from dummy weights as verl starts it (``rollout.load_format: dummy``). Every update goes the way
verl's colocated sync sends it: verl's ``BucketedWeightSender`` over shared memory (here from a thread) into
``update_weights_from_ipc`` on the worker, first the base weights once (peft's ``.base_layer`` names, as
``engine_workers.update_weights`` sends them with ``base_sync_done=False``), then adapters only. The check is
weight_sync/adapter_check.py on the worker's report (rollout/verl_vllm/loaded_adapter.py), as our server adapter
calls it; the faults are injected on the receiving side (the worker's fault-injection variables).

The adapter: peft's ``get_peft_model`` over all 7 linear modules of both layers, rank 4, alpha 8 (vLLM scales
``lora_B`` by 2), values drawn from a fixed seed: 2 x 7 x 2 = 28 tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from areal_plugins.testing import faults
from areal_plugins.weight_sync.adapter_check import check_adapter_reports, check_base_rechecks
from areal_plugins.weight_sync.checksums import check_loaded_reports, check_weight_reports, tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError
from tests.verl_vllm.extension_engine import ExtensionEngine, started

MODEL = Path(__file__).resolve().parents[2] / ".areal" / "tiny" / "model"
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_TENSORS = 2 * 7 * 2
PREFIX = "base_model.model.model.layers"

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="build it: areal-plugins build-tiny")


def peft_adapter(target_modules: list[str], seed: int) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    tensors = {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(peft_model).items()}
    return peft_model, tensors, peft_model.peft_config["default"].to_dict()


class Engine(ExtensionEngine):
    """The tiny model with LoRA on, as verl's vLLM server starts it for an adapter."""

    def __init__(self, model: Path) -> None:
        super().__init__(model, enable_lora=True, max_loras=1, max_lora_rank=8)

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME, VLLM_LORA_PATH
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(lora_name=VLLM_LORA_NAME, lora_int_id=VLLM_LORA_INT_ID, lora_path=VLLM_LORA_PATH)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": prompt}], params, lora_request=lora, use_tqdm=False)
        return list(outputs[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def engine():
    with started(Engine, MODEL, "lora-check") as engine:
        peft_model, _, peft_config = peft_adapter(LINEAR, seed=0)
        base = {k: v.detach().clone() for k, v in peft_model.base_model.model.state_dict().items() if "lora_" not in k}
        report = engine.update(base, peft_config, adapter_only=False)  # the base, once, under LoRA's names
        check_weight_reports([report], {name: tensor_checksum(t) for name, t in base.items()}, "replica 0", 1)
        check_loaded_reports([report], "replica 0")
        yield engine


def checked(report: dict, tensors: dict[str, torch.Tensor], version: int = 1) -> dict[str, int]:
    sent = {name: tensor_checksum(tensor) for name, tensor in tensors.items()}
    return check_adapter_reports(sent, [{**report, "replica": 0}], version, ranks_per_replica=1)


def peft_greedy(peft_model: Any, prompt: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(tokens):
            next_id = peft_model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_every_adapter_tensor_is_held_as_sent_and_the_engine_samples_with_it(engine, monkeypatch):
    peft_model, tensors, peft_config = peft_adapter(LINEAR, seed=1)
    report = engine.update(tensors, peft_config, adapter_only=True)
    assert report["loaded"] is None  # no full-weight load: the base layers were left as they were
    assert checked(report, tensors) == {"adapter_tensors": ADAPTER_TENSORS, "adapter_ranks": 1}
    # The base, sent once, re-checked on this adapter update against its checksums kept from that load.
    assert report["base_recheck"]["changed"] == 0 and check_base_rechecks([report], "replica 0", 1) > 0
    lora_b = report["adapter"][f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
    assert lora_b["held"][1] == pytest.approx(2 * lora_b["received"][1])  # alpha / r = 2, merged into lora_B
    # What the slots hold is what the engine samples with: greedy tokens equal peft's own forward with the adapter,
    # and differ from the base model's (the adapter matters).
    prompt = [16384, 5, 7, 9]
    with_adapter = peft_greedy(peft_model, prompt, 8)
    assert engine.greedy(prompt, 8) == with_adapter
    with peft_model.disable_adapter():
        assert peft_greedy(peft_model, prompt, 8) != with_adapter


def test_a_value_changed_in_the_engines_lora_slot_is_named(engine, monkeypatch):
    _, tensors, peft_config = peft_adapter(LINEAR, seed=2)
    name = f"{PREFIX}.1.mlp.down_proj.lora_A.weight"
    monkeypatch.setenv(faults.CORRUPT_LOADED_ENV, name)
    report = engine.update(tensors, peft_config, adapter_only=True)
    with pytest.raises(
        WeightSyncError,
        match=rf"rollout replica 0, engine rank 0, update 1: adapter tensor {name} is held as other values",
    ):
        checked(report, tensors)


def test_a_tensor_corrupted_on_arrival_is_named(engine, monkeypatch):
    _, tensors, peft_config = peft_adapter(LINEAR, seed=3)
    name = f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"
    monkeypatch.setenv(faults.CORRUPT_RECEIVED_ENV, name)
    report = engine.update(tensors, peft_config, adapter_only=True)
    with pytest.raises(WeightSyncError, match=rf"engine rank 0, update 1: adapter tensor {name} arrived different"):
        checked(report, tensors)


def test_a_tensor_dropped_on_arrival_stops_the_update_naming_it(engine, monkeypatch):
    _, tensors, peft_config = peft_adapter(LINEAR, seed=4)
    name = f"{PREFIX}.1.self_attn.k_proj.lora_B.weight"
    monkeypatch.setenv(faults.DROP_RECEIVED_ENV, name)
    with pytest.raises(Exception, match=rf"adapter tensor {name} never arrived, though .*k_proj\.lora_A\.weight did"):
        engine.update(tensors, peft_config, adapter_only=True)


def test_a_module_whose_adapter_never_arrived_is_named(engine, monkeypatch):
    _, tensors, peft_config = peft_adapter(LINEAR, seed=5)
    lost = [f"{PREFIX}.0.mlp.up_proj.lora_A.weight", f"{PREFIX}.0.mlp.up_proj.lora_B.weight"]
    monkeypatch.setenv(faults.DROP_RECEIVED_ENV, ",".join(lost))
    report = engine.update(tensors, peft_config, adapter_only=True)
    with pytest.raises(
        WeightSyncError, match=rf"2 of {ADAPTER_TENSORS} adapter tensors never arrived, e\.g\. {lost[0]}"
    ):
        checked(report, tensors)


def test_an_adapter_loaded_under_another_modules_name_is_named(engine, monkeypatch):
    _, tensors, peft_config = peft_adapter(["q_proj", "v_proj"], seed=6)  # k_proj (v_proj's shape) has no adapter
    v, k = f"{PREFIX}.0.self_attn.v_proj", f"{PREFIX}.0.self_attn.k_proj"
    renames = [f"{v}.lora_{half}.weight={k}.lora_{half}.weight" for half in "AB"]
    monkeypatch.setenv(faults.RENAME_RECEIVED_ENV, ",".join(renames))
    report = engine.update(tensors, peft_config, adapter_only=True)
    with pytest.raises(WeightSyncError, match=rf"adapter tensor {v}\.lora_A\.weight was loaded under the name {k}"):
        checked(report, tensors)


def _set_final_norm_value(worker, value: float | None) -> float:
    """In the engine's worker: set one value of a base parameter (None: add 1, as a wake that restored it wrong
    would); its value before."""
    with torch.no_grad():
        flat = dict(worker.model_runner.model.named_parameters())["model.norm.weight"].view(-1)
        before = float(flat[0])
        flat[0] = before + 1.0 if value is None else value
    return before


def test_a_base_weight_changed_after_the_base_load_is_named_on_the_next_adapter_update(engine):
    _, tensors, peft_config = peft_adapter(LINEAR, seed=5)
    original = engine.llm.collective_rpc(_set_final_norm_value, args=(None,))[0]
    try:
        report = engine.update(tensors, peft_config, adapter_only=True)
    finally:
        engine.llm.collective_rpc(_set_final_norm_value, args=(original,))
    checked(report, tensors)  # the adapter itself arrived and is held right: its own check cannot see this
    with pytest.raises(WeightSyncError, match=r"1 LoRA base parameter\(s\) changed .*model\.norm\.weight"):
        check_base_rechecks([report], "replica 0", 1)
    # Restored: the next update's re-check passes again.
    report = engine.update(tensors, peft_config, adapter_only=True)
    assert check_base_rechecks([report], "replica 0", 2) > 0


def test_a_rank_that_kept_no_base_checksums_is_refused():
    with pytest.raises(WeightSyncError, match="re-checked none of the LoRA base weights"):
        check_base_rechecks([{"rank": 0, "base_recheck": {"compared": 0, "changed": 0}}], "replica 0", 1)
