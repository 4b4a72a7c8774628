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
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from areal_plugins.rollout.base import RolloutServer, record_weight_sync
from areal_plugins.rollout.server_slots import UNBOUNDED_SLOTS, server_concurrency
from areal_plugins.weight_sync.checksums import tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError

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


ADAPTER_FQN = f"{__name__}.ArealServerAdapter"
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


def _replica_class() -> type:
    from verl.workers.rollout.replica import RolloutMode, RolloutReplica

    class ArealRolloutReplica(RolloutReplica):
        """A replica of one server actor of the backend ``config.name`` (no accelerator needed)."""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self) -> None:
            backend = str(self.config.name)
            check_capabilities(self.config)
            options = engine_options(self.config)
            model_path = getattr(self.model_config, "local_path", None) or self.model_config.path
            name = server_actor_name(backend, self.replica_rank, self.name_suffix)
            cls = server_class(backend)
            server_cls: Any = ray.remote(cls)
            placement: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            if "routed_experts" in cls.capabilities:  # router replay: asked of backends that declare it
                extra["routed_experts"] = bool(self.config.get("enable_rollout_routing_replay", False))
            if "lora_adapter_check" in cls.capabilities:  # adapter-only updates: sleep keeps the base weights
                extra["lora_adapter"] = sends_lora_adapter(self.model_config)
            if self.workers:  # on the node of this replica's workers (its devices), as verl's vLLM replica does
                node = str(ray.get(self.workers[0].__ray_call__.remote(_node_id)))
                placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                if cls.uses_reserved_gpus:
                    devices = ray.get([w.__ray_call__.remote(_cuda_devices) for w in self.workers])
                    hybrid = self.rollout_mode == RolloutMode.HYBRID
                    gpu = gpu_settings(self.config, [d for ds in devices for d in ds], hybrid)
                    if gpu is not None:
                        extra["gpu"] = gpu
            server: Any = server_cls.options(
                name=name,
                num_cpus=SERVER_NUM_CPUS,
                max_concurrency=server_concurrency(self.max_concurrency, when_unbounded=UNBOUNDED_SLOTS),
                **placement,
            ).remote(
                model_path=model_path,
                response_length=self.config.response_length,
                max_model_len=self.config.max_model_len or (self.config.prompt_length + self.config.response_length),
                max_batch_size=int(options.get("max_batch_size", self.config.max_num_seqs)),
                num_threads=int(options.get("num_threads", 2)),
                seed=self.config.seed + self.replica_rank,
                replica_rank=self.replica_rank,
                free_cache_engine=bool(self.config.free_cache_engine),
                ignore_eos=bool(self.config.get("ignore_eos", False)),
                batch_invariant=bool(options.get("batch_invariant", False)),
                **{key: value for key, value in options.items() if key not in ENGINE_OPTIONS},  # a backend's own
                **extra,
            )
            await server.get_version.remote()  # surfaces constructor errors here, not at first use
            self.servers = [server]
            self._server_handle = server
            self._server_address = name

    return ArealRolloutReplica


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


def _adapter_class() -> type:
    from verl.workers.rollout.base import BaseRollout

    class ArealServerAdapter(BaseRollout):
        """Trainer-side end of the weight sync: gathers full tensors, ships them, verifies the reply.

        ``resume``/``release`` are verl's wake-up and sleep calls of a colocated engine; they reach
        the server, which acts on them when ``free_cache_engine`` is true (as verl's vLLM adapter does).
        """

        def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, model_config, device_mesh)
            rollout_world = (
                self.config.tensor_model_parallel_size
                * self.config.data_parallel_size
                * self.config.pipeline_model_parallel_size
            )
            self.replica_rank, self.is_leader_rank = replica_position(
                process_rank(), rollout_world, kwargs.get("replica_rank", -1)
            )
            self.server_cls = server_class(self.config.name)
            self._server: Any = None

        def _server_handle(self) -> Any:
            if self._server is None:
                self._server = ray.get_actor(server_actor_name(self.config.name, self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]) -> None:
            if self.is_leader_rank:
                await self._server_handle().wake_up.remote(tags=tags)

        async def release(self) -> None:
            if self.is_leader_rank:
                await self._server_handle().sleep.remote()

        async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
            """verl's ``peft_config`` and ``base_sync_done`` (colocated LoRA, ``engine_workers.update_weights``): with
            both, the tensors are the adapter alone, loaded by the server's ``update_adapter`` and checked tensor by
            tensor; with ``peft_config`` alone they are the base weights (sent once), loaded and checked as full
            weights."""
            if wire_format != "named_tensors":
                raise ValueError(f"the {self.config.name} backend takes full named tensors, not {wire_format!r}")
            # Every rank must drain the generator: producing full tensors is a collective. Checkpoint
            # engines hand weights over as a generator, some (verl's nccl) as an async one.
            if hasattr(weights, "__aiter__"):
                state = {name: tensor.detach().to("cpu", copy=True) async for name, tensor in weights}
            else:
                state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
            peft_config = kwargs.get("peft_config")
            version = int(kwargs.get("global_steps") or 0)
            if sends_lora_adapter(self.model_config) and not peft_config:
                # verl's checkpoint-engine path (placement: separate) sends the base weights without the adapter
                # (verl issue #7495: the engines sampled from the initial policy for the whole run). Startup refuses
                # that setup (builtin/validation.py); raised after the drain, so no rank of a transport is left waiting.
                raise WeightSyncError(
                    f"rollout replica {self.replica_rank}, update {version}: the trainer trains a LoRA adapter "
                    f"(actor_rollout_ref.model.lora_rank={self.model_config.lora_rank}) but this update carries no "
                    "adapter, only base weights: the engines would sample from the base model, not the policy. "
                    "areal_async sends the adapter with areal.placement=colocated only (docs/design.md, LoRA)"
                )
            if not self.is_leader_rank:
                return
            where = f"rollout replica {self.replica_rank}"
            if peft_config and kwargs.get("base_sync_done", False):  # verl's adapter-only update
                sent = {name: tensor_checksum(tensor) for name, tensor in state.items()}
                reply = await self._server_handle().update_adapter.remote(state, dict(peft_config), version)
                checked = self.server_cls.verify_adapter(reply, sent, version, where)
                record_weight_sync(self.replica_rank, version, {**checked, "adapter_only": True}, "update_checked")
                return
            reply = await self._server_handle().update_weights.remote(state, version)
            self.server_cls.verify_weights(reply, state, version, where)

    return ArealServerAdapter


def __getattr__(name: str) -> Any:
    # verl imports the adapter by its fully qualified name; build the classes on first use so that
    # importing this module does not import verl's worker stack.
    makers = {"ArealServerAdapter": _adapter_class, "ArealRolloutReplica": _replica_class}
    if name in globals():  # built already (the registry's loader calls this function directly)
        return globals()[name]
    if name in makers:
        cls = makers[name]()
        globals()[name] = cls
        return cls
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
