"""Patch: vLLM 0.30's CPU build packs a mixture-of-experts layer's expert weights again when they are reloaded.

*Why*: on the CPU platform vLLM packs each layer's fused expert parameters (``w13_weight``, ``w2_weight``) into its
grouped-GEMM kernel's layout (``CPUUnquantizedExperts.process_weights_after_loading``), called from
``UnquantizedFusedMoEMethod._setup_kernel`` on the first load only. A reload (``reload_weights``, which our worker
extension uses for every update on the CPU platform) calls ``_setup_kernel`` again, which copies the new weights in
checkpoint layout and skips the packing: the kernel reads them in the wrong order. On the tiny Qwen2-MoE every
update left greedy tokens and log-probs different from transformers' with the same weights. The values are the
same, only in the wrong order, so their sums match and the after-load check cannot see it. The patch packs them
after ``_setup_kernel`` on a reload too, as the first load does; other backends and the first load are unchanged.
Applied by our vLLM worker extension (rollout/verl_vllm/worker_extension.py) on the CPU platform, before it reloads an
update into a model with fused experts.
*Upstream*: no seam (vLLM 0.30.0 ``model_executor/layers/fused_moe/unquantized_fused_moe_method.py``,
``_setup_kernel``: its ``is_weight_update`` branch).
*Remove when*: vLLM packs the CPU experts on a reload itself; this patch would pack them twice, so it refuses vLLM
versions it was not checked on. Watch vLLM issue #42821 (open: ``model.load_weights`` corrupts the MoE forward on a
second load, through the same ``_setup_kernel``).
"""

from __future__ import annotations

import logging
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)

#: vLLM versions whose CPU build skips the packing on a reload (read in 0.30.0 and checked with it).
SUPPORTED_VLLM = SpecifierSet(">=0.30.0,<0.31")


def _method_class() -> Any:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return UnquantizedFusedMoEMethod


def is_applied() -> bool:
    return hasattr(_method_class().__dict__.get("_setup_kernel"), "_areal_original")


def apply(vllm_version: str | None = None) -> None:
    """Pack the CPU experts after ``_setup_kernel`` on a reload; raise on a vLLM this was not checked with."""
    if is_applied():
        return
    if vllm_version is None:
        import vllm

        vllm_version = vllm.__version__
    if Version(vllm_version) not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"areal_plugins: vLLM {vllm_version}'s CPU build is not known to pack reloaded expert weights correctly "
            f"(patches/vllm_cpu_moe_reload.py is checked with vLLM {SUPPORTED_VLLM}); a mixture-of-experts model "
            "on verl's vllm rollout on CPU needs vLLM 0.30, or use rollout.name=areal_cpu"
        )
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedMoeBackend

    cls = _method_class()
    original = cls.__dict__["_setup_kernel"]

    def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        reloading = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if reloading and self.unquantized_backend == UnquantizedMoeBackend.CPU:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    _setup_kernel._areal_original = original  # type: ignore[attr-defined]
    cls._setup_kernel = _setup_kernel
    logger.info("areal_plugins: applied patch vllm_cpu_moe_reload (CPU experts packed on reload)")


def revert() -> None:
    if is_applied():
        cls = _method_class()
        cls._setup_kernel = cls.__dict__["_setup_kernel"]._areal_original
