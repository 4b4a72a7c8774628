"""Register our rollout backends with verl's two rollout registries, one generic class per side.

verl 0.9.1 resolves a rollout backend by ``actor_rollout_ref.rollout.name`` in two places:
``RolloutReplicaRegistry`` (the driver-side replica that launches server actors) and
``verl.workers.rollout.base._ROLLOUT_REGISTRY`` (the trainer-side adapter that pushes weights to
the servers). Both are registries meant for extension. One replica class and one adapter class
serve every backend of :data:`BACKENDS`: each reads the backend from its rollout config's ``name``
and asks the server class what it needs to know (capabilities, how to verify a weight sync).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

import ray
import torch

from areal_plugins.rollout.base import RolloutServer

logger = logging.getLogger(__name__)

#: ``actor_rollout_ref.rollout.name`` -> ``module:Class`` of its server (imported on first use). Ours; another
#: package adds its own with :func:`register_backend`.
BACKENDS = {
    "areal_cpu": "areal_plugins.rollout.cpu.server:CPURolloutServer",
}


def backends() -> dict[str, str]:
    """The rollout backends known in this process: ours and those added by :func:`register_backend`."""
    return dict(BACKENDS)


def register_backend(name: str, server: str) -> None:
    """Serve rollout backend ``name`` (``actor_rollout_ref.rollout.name``) with ``server``, ``module:Class`` of a
    :class:`~areal_plugins.rollout.base.RolloutServer` subclass, in this process; idempotent.

    Every process that builds a replica or an adapter must know the backend: verl's driver, its TaskRunner, the
    trainer workers. A module that calls this and is named in ``VERL_USE_EXTERNAL_MODULES`` (in the Ray job's
    ``runtime_env``) runs in each of them at ``import verl``, before verl's registries are read; a registry imported
    already is told here.

    Raises:
        ValueError: ``name`` served by another class already.
    """
    known = BACKENDS.get(name)
    if known is not None and known != server:
        raise ValueError(f"rollout backend {name!r} is served by {known} already; pick another name than {server}'s")
    BACKENDS[name] = server
    adapters = getattr(sys.modules.get("verl.workers.rollout.base"), "_ROLLOUT_REGISTRY", None)
    if adapters is not None:
        adapters[(name, "async")] = ADAPTER_FQN
    replicas = getattr(sys.modules.get("verl.workers.rollout.replica"), "RolloutReplicaRegistry", None)
    if replicas is not None:
        replicas.register(name, lambda: __getattr__("ArealRolloutReplica"))


ADAPTER_FQN = "areal_plugins.rollout.verl_adapter.ArealServerAdapter"
#: CPU share Ray reserves for each server actor: fractional so that it never starves verl's own
#: actors on a 2-core machine; torch threads are set separately (``engine_kwargs.<backend>.num_threads``).
SERVER_NUM_CPUS = 0.1
#: ``engine_kwargs.<backend>`` keys of ``areal_cpu`` (a server class may declare its own, ``engine_options``).
ENGINE_OPTIONS = ("num_threads", "max_batch_size", "batch_invariant")


def server_class(backend: str) -> type[RolloutServer]:
    """The server class of ``backend`` (one of :data:`BACKENDS`)."""
    known = backends()
    if backend not in known:
        raise ValueError(
            f"unknown areal rollout backend {backend!r}; known in this process: {', '.join(known)} (a backend of "
            "another package is known where its module called register_backend: name that module in "
            "VERL_USE_EXTERNAL_MODULES for every process of the run)"
        )
    module, _, name = known[backend].partition(":")
    return getattr(importlib.import_module(module), name)


def server_actor_name(backend: str, replica_rank: int, name_suffix: str = "") -> str:
    return f"{backend}_server_{replica_rank}{name_suffix}"


def engine_options(rollout_config: Any) -> dict[str, Any]:
    """Our knobs inside ``rollout.engine_kwargs.<backend>`` (num_threads, max_batch_size, batch_invariant)."""
    backend = rollout_config.name
    kwargs = getattr(rollout_config, "engine_kwargs", None) or {}
    options = dict(kwargs.get(backend, {}) or {})
    valid = getattr(server_class(backend), "engine_options", ENGINE_OPTIONS)
    unknown = set(options) - set(valid)
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.{backend} has unknown keys {sorted(unknown)}; "
            f"valid keys: {', '.join(valid)}"
        )
    if not isinstance(options.get("batch_invariant", False), bool):  # a quoted "false" would read as true
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.{backend}.batch_invariant must be true or false, "
            f"got {options['batch_invariant']!r}"
        )
    return options


def check_capabilities(rollout_config: Any) -> None:
    """Refuse, before any server starts, a setting the backend cannot honour."""
    from areal_plugins.hooks.contracts import BackendCapabilities, require_contract

    cls = server_class(rollout_config.name)
    require_contract(cls, BackendCapabilities, f"rollout backend {rollout_config.name} (its server class)")
    if "lora_adapter_check" in cls.capabilities and cls.update_adapter is RolloutServer.update_adapter:
        raise ValueError(
            f"rollout backend {rollout_config.name} declares lora_adapter_check, but its server class "
            f"{cls.__name__} does not implement update_adapter (the adapter-only update that reports what each "
            "adapter tensor holds): implement it, or drop lora_adapter_check from its capabilities"
        )
    if rollout_config.free_cache_engine and not cls.releases_memory_on_sleep:
        raise ValueError(
            f"actor_rollout_ref.rollout.free_cache_engine=true asks the {rollout_config.name} servers to release "
            "their memory on sleep, which this backend cannot do: set "
            "actor_rollout_ref.rollout.free_cache_engine=false"
        )


def _node_id(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _cuda_devices(_actor: Any) -> list[str]:
    """The GPUs Ray assigned this worker, as physical ids (none without a GPU, fake slots included).

    Ray's assignment, not the worker's CUDA_VISIBLE_DEVICES, which verl may leave unset (all devices)."""
    if not torch.cuda.is_available():
        return []
    return [str(i) for i in ray.get_gpu_ids()]


def gpu_settings(rollout_config: Any, devices: list[str], hybrid: bool) -> dict[str, Any] | None:
    """The ``gpu`` argument of a server that uses its replica's reserved GPUs; None without GPUs.

    Raises:
        ValueError: engines sharing the trainer's GPUs (hybrid) that cannot release their memory.
    """
    if not devices:
        return None
    cls = server_class(rollout_config.name)
    if hybrid and not cls.releases_memory_on_sleep:
        raise ValueError(
            f"the {rollout_config.name} servers would keep gpu_memory_utilization="
            f"{rollout_config.gpu_memory_utilization} of the trainer's GPUs while it trains (no sleep mode through "
            "this backend): set areal.placement=separate to give them GPUs of their own"
        )
    return {
        "devices": ",".join(sorted(set(devices), key=lambda d: (len(d), d))),
        "gpu_memory_utilization": float(rollout_config.gpu_memory_utilization),
        "tensor_parallel_size": int(rollout_config.tensor_model_parallel_size),
        "dtype": str(rollout_config.dtype),
    }


def sends_lora_adapter(model_config: Any) -> bool:
    """Whether verl's trainer sends a LoRA adapter alone on each update: FSDP's ``lora_rank > 0`` without
    ``lora.merge`` (verl 0.9.1's ``engine_workers.update_weights``; merged, it sends full weights)."""
    rank = int(getattr(model_config, "lora_rank", 0) or 0)
    merge = bool((getattr(model_config, "lora", None) or {}).get("merge", False))
    return rank > 0 and not merge


def process_rank() -> int:
    """This worker's global rank: ``RANK`` as verl's worker sets it (verl's own adapter reads it there).

    ``torch.distributed`` is not a source: verl's ``CheckpointEngineWorker`` builds the adapter before its
    process group exists, where every rank would read 0 and each of a TP group's ranks would act as the leader.
    """
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def replica_position(rank: int, rollout_world: int, replica_rank: int = -1) -> tuple[int, bool]:
    """``(replica, leads it)`` of global ``rank`` with ``rollout_world`` ranks per replica (-1: derived)."""
    replica = rank // rollout_world if replica_rank == -1 else replica_rank
    return replica, rank % rollout_world == 0


#: Our verl classes, each in a module that imports verl's rollout base at its top: imported by name on first use, so
#: that importing this module does not import verl's worker stack (and they, which import this one, close no cycle).
CLASS_MODULES = {
    "ArealServerAdapter": "areal_plugins.rollout.verl_adapter",
    "ArealRolloutReplica": "areal_plugins.rollout.verl_replica",
}


def __getattr__(name: str) -> Any:
    if name in CLASS_MODULES:
        return getattr(importlib.import_module(CLASS_MODULES[name]), name)
    raise AttributeError(name)


VERL_VLLM_ADAPTER_FQN = "areal_plugins.rollout.verl_vllm.adapter.ArealServerAdapter"


def register_rollout_adapters() -> None:
    """Name our trainer-side adapters in verl's ``_ROLLOUT_REGISTRY`` (by import path: nothing is imported)."""
    from verl.workers.rollout import base

    # verl's own vllm: its adapter plus the received-weights check, active only with our server (areal_async).
    base._ROLLOUT_REGISTRY[("vllm", "async")] = VERL_VLLM_ADAPTER_FQN
    for backend in backends():
        base._ROLLOUT_REGISTRY[(backend, "async")] = ADAPTER_FQN


def register_rollout_replicas() -> None:
    """Add every backend of :data:`BACKENDS` to verl's ``RolloutReplicaRegistry`` (the class is built on first use)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    for backend in backends():
        RolloutReplicaRegistry.register(backend, lambda: __getattr__("ArealRolloutReplica"))


def register_rollout_backends() -> None:
    """Add every backend of :data:`BACKENDS` to both verl rollout registries (idempotent).

    The plugin calls the two halves separately, each once verl has imported its registry (verl_plugin.py).
    """
    register_rollout_adapters()
    register_rollout_replicas()
