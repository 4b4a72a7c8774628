"""patches/vllm_lora_mapper.py: verl 0.9.1's LoRA loader finds ``get_unstacked_mapper`` on vLLM 0.30's mapper.

Needs vLLM (runs in ``.venv-verl-vllm``); no engine is started.
"""

from __future__ import annotations

import pytest
from areal_plugins.patches import vllm_lora_mapper
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import WeightsMapper

from areal_plugins._compat import UnsupportedVerlVersionError


@pytest.fixture
def unpatched():
    vllm_lora_mapper.revert()
    yield
    vllm_lora_mapper.revert()


def test_unpatched_vllm_lacks_what_verls_lora_loader_calls(unpatched):
    # verl/utils/vllm/utils.py hijack__load_adapter: hf_to_vllm_mapper.get_unstacked_mapper() for vLLM >= 0.25
    assert not hasattr(Qwen2ForCausalLM.hf_to_vllm_mapper, "get_unstacked_mapper")


def test_applied_the_old_name_gives_vllms_rename_mapper(unpatched):
    vllm_lora_mapper.apply()
    assert vllm_lora_mapper.is_applied()
    mapper = WeightsMapper(
        orig_to_new_prefix={"model.": "language_model.model."}, orig_to_new_stacked={".q_proj": (".qkv_proj", "q")}
    )
    unstacked = mapper.get_unstacked_mapper()
    assert unstacked == mapper.get_rename_mapper()
    assert unstacked._map_name("model.layers.0.q_proj.weight") == "language_model.model.layers.0.q_proj.weight"


def test_applying_twice_changes_nothing(unpatched):
    vllm_lora_mapper.apply()
    alias = WeightsMapper.__dict__["get_unstacked_mapper"]
    vllm_lora_mapper.apply()
    assert WeightsMapper.__dict__["get_unstacked_mapper"] is alias


def test_reverted_the_class_is_vllms_again(unpatched):
    vllm_lora_mapper.apply()
    vllm_lora_mapper.revert()
    assert not vllm_lora_mapper.is_applied()
    assert "get_unstacked_mapper" not in WeightsMapper.__dict__


def test_refused_on_an_unsupported_verl(unpatched):
    with pytest.raises(UnsupportedVerlVersionError, match=r"verl 0\.10\.0 is installed"):
        vllm_lora_mapper.apply(verl_version="0.10.0")
    assert not vllm_lora_mapper.is_applied()
