"""Patch: give vLLM's ``WeightsMapper`` the ``get_unstacked_mapper`` that verl 0.9.1's LoRA loader calls.

*Why*: verl loads a LoRA adapter from tensors through its own ``LRUCacheWorkerLoRAManager._load_adapter``
(``verl/utils/vllm/utils.py``, ``VLLMHijack``), which for vLLM >= 0.25 calls
``model.hf_to_vllm_mapper.get_unstacked_mapper()``. vLLM 0.30 (the CPU build verl's vllm rollout runs on here) names
that method ``get_rename_mapper`` (the same mapper: renames kept, stacking and deletions dropped), so every adapter
update of a model with a mapper (Qwen2 has one) fails with ``AttributeError`` inside ``add_lora``. The patch adds the
old name as an alias of the new method; it changes nothing where the old name exists (verl's own vLLM pin, 0.24).
Applied by our vLLM worker extension (rollout/verl_vllm/worker_extension.py) in vLLM's worker processes, only when
the engine serves LoRA: nothing else imports vLLM's model code.
*Upstream*: no seam (verl 0.9.1 ``verl/utils/vllm/utils.py`` ``hijack__load_adapter``; vLLM renamed the method in
``vllm/model_executor/models/utils.py``).
*Remove when*: verl calls ``get_rename_mapper`` (or supports vLLM >= 0.30), or verl's vLLM pin is the CPU build's;
watch verl PR #7453 (merged: verl's LoRA sync maps names through vLLM's unstacked mapper, the method vLLM 0.29
renamed ``get_rename_mapper``).
"""

from __future__ import annotations

import logging
from typing import Any

from areal_plugins._compat import SUPPORTED_VERL, check_verl_version

logger = logging.getLogger(__name__)

#: The class patched and the name added (vLLM's ``vllm/model_executor/models/utils.py``).
TARGET = "vllm.model_executor.models.utils:WeightsMapper"
OLD_NAME = "get_unstacked_mapper"
NEW_NAME = "get_rename_mapper"


def _mapper_class() -> Any:
    from vllm.model_executor.models.utils import WeightsMapper

    return WeightsMapper


def is_applied() -> bool:
    return bool(getattr(_mapper_class().__dict__.get(OLD_NAME), "_areal_alias", False))


def apply(verl_version: str | None = None) -> None:
    """Alias ``get_unstacked_mapper`` to ``get_rename_mapper`` where vLLM has only the latter; else nothing."""
    if is_applied():
        return
    check_verl_version(verl_version, SUPPORTED_VERL)
    cls = _mapper_class()
    if hasattr(cls, OLD_NAME) or not hasattr(cls, NEW_NAME):
        return

    def get_unstacked_mapper(self: Any) -> Any:
        return getattr(self, NEW_NAME)()

    get_unstacked_mapper._areal_alias = True  # type: ignore[attr-defined]
    setattr(cls, OLD_NAME, get_unstacked_mapper)
    logger.info("areal_plugins: applied patch vllm_lora_mapper (WeightsMapper.%s -> %s)", OLD_NAME, NEW_NAME)


def revert() -> None:
    if is_applied():
        delattr(_mapper_class(), OLD_NAME)
