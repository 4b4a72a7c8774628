"""The after-load check with vLLM's own name mapping (needs vLLM: runs in ``.venv-verl-vllm``).

vLLM's Qwen2 maps the trainer's ``q_proj``/``k_proj``/``v_proj`` to ``qkv_proj`` (and ``gate``/``up`` to
``gate_up_proj``) through its ``hf_to_vllm_mapper`` before loading; the check must group the received tensors by
that mapping, or on a GPU every fused parameter would look unheld. The model layout is the unit tests'
(tests/unit/test_loaded_weights.py), with vLLM's real mapper attached.
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import WeightsMapper

from areal_plugins.weight_sync.checksums import check_loaded_reports
from areal_plugins.weight_sync.errors import WeightSyncError
from tests.unit.test_loaded_weights import engine_model, report, trainer_tensors


def qwen2_engine(sent: dict[str, torch.Tensor], mapper: WeightsMapper = Qwen2ForCausalLM.hf_to_vllm_mapper):
    model = engine_model(sent)
    model.hf_to_vllm_mapper = mapper
    model.packed_modules_mapping = Qwen2ForCausalLM.packed_modules_mapping
    return model


def test_qwen2s_mapped_names_are_compared_on_a_gpu():
    sent = trainer_tensors()
    compared = check_loaded_reports([report(qwen2_engine(sent), sent)], "replica 0")
    assert (compared["loaded_compared"], compared["loaded_not_compared"]) == (4, 0)  # embed, qkv, gate_up, norm


def test_a_changed_fused_value_is_named_under_vllms_names():
    sent = trainer_tensors()
    model = qwen2_engine(sent)
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.weight.view(-1)[-1] += 1.0  # in v_proj's rows
    with pytest.raises(WeightSyncError, match=r"parameter model\.layers\.0\.self_attn\.qkv_proj\.weight holds after"):
        check_loaded_reports([report(model, sent)], "replica 0")


def test_a_fused_parameter_missing_one_of_its_parts_is_not_passed():
    sent = trainer_tensors()
    model = qwen2_engine(sent)
    del sent["model.layers.0.self_attn.v_proj.weight"]
    compared = check_loaded_reports([report(model, sent)], "replica 0")
    assert compared["loaded_not_compared_examples"] == ["model.layers.0.self_attn.qkv_proj.weight"]


def test_names_the_model_drops_on_purpose_are_not_taken_for_unknown_ones():
    """Qwen3-Next's mapper drops the multi-token-prediction layers (``mtp.``: None); they are not compared."""
    sent = {**trainer_tensors(), "mtp.fc.weight": torch.ones(4, 8)}
    dropping = WeightsMapper(orig_to_new_prefix={"mtp.": None}) | Qwen2ForCausalLM.hf_to_vllm_mapper
    compared = check_loaded_reports([report(qwen2_engine(sent, dropping), sent)], "replica 0")
    assert (compared["loaded_compared"], compared["loaded_not_compared_examples"]) == (4, ["mtp.fc.weight"])


def test_under_pipeline_parallelism_a_tensor_held_by_another_stage_is_held():
    sent = trainer_tensors()
    first_stage, last_stage = qwen2_engine(sent), qwen2_engine(sent)
    del first_stage.model.norm  # the final norm lives on the last stage only
    reports = [report(first_stage, sent, rank=0), report(last_stage, sent, rank=1)]
    assert check_loaded_reports(reports, "replica 0")["loaded_compared"] == 4
    with pytest.raises(WeightSyncError, match=r"e\.g\. model\.norm\.weight"):
        check_loaded_reports(reports[:1], "replica 0")
