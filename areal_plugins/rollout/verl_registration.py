"""Register our rollout backends with verl's rollout registries.

``areal_cpu``: the in-process transformers engine (zero setup). ``areal_vllm``: a real vLLM server
process from its own environment (``areal_plugins.rollout.vllm``). Select one with verl's own
``actor_rollout_ref.rollout.name``.

verl 0.9.1 resolves a rollout backend by ``actor_rollout_ref.rollout.name`` in two places:
``RolloutReplicaRegistry`` (the driver-side replica that launches server actors) and
``verl.workers.rollout.base._ROLLOUT_REGISTRY`` (the trainer-side adapter that pushes weights to
the servers). Both are registries meant for extension; we add one entry per backend to each.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import torch

from areal_plugins.rollout.cpu.server import CPURolloutServer, weights_checksum

logger = logging.getLogger(__name__)

BACKEND_NAME = "areal_cpu"
VLLM_BACKEND_NAME = "areal_vllm"
ADAPTER_FQN = "areal_plugins.rollout.verl_registration.CPUServerAdapter"
VLLM_ADAPTER_FQN = "areal_plugins.rollout.verl_registration.VLLMServerAdapter"
#: CPU share Ray reserves for each server actor: fractional so that it never starves verl's own
#: actors on a 2-core machine (DESIGN.md §4); torch threads are set separately.
SERVER_NUM_CPUS = 0.1


def server_actor_name(replica_rank: int, name_suffix: str = "", backend: str = BACKEND_NAME) -> str:
    return f"{backend}_server_{replica_rank}{name_suffix}"


def _server_class(backend: str) -> type:
    if backend == VLLM_BACKEND_NAME:
        from areal_plugins.rollout.vllm.server import VLLMRolloutServer

        return VLLMRolloutServer
    return CPURolloutServer


def engine_options(rollout_config: Any, backend: str = BACKEND_NAME) -> dict[str, Any]:
    """Our knobs inside ``rollout.engine_kwargs.<backend>`` (num_threads, max_batch_size)."""
    kwargs = getattr(rollout_config, "engine_kwargs", None) or {}
    options = dict(kwargs.get(backend, {}) or {})
    unknown = set(options) - {"num_threads", "max_batch_size"}
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.{backend} has unknown keys {sorted(unknown)}; "
            "valid keys: num_threads, max_batch_size"
        )
    return options


def _make_replica_class(backend: str = BACKEND_NAME) -> type:
    from verl.workers.rollout.replica import RolloutReplica

    class ArealRolloutReplica(RolloutReplica):
        """A replica of one server actor of ``backend`` (no accelerator needed)."""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self) -> None:
            options = engine_options(self.config, backend)
            model_path = getattr(self.model_config, "local_path", None) or self.model_config.path
            name = server_actor_name(self.replica_rank, self.name_suffix, backend)
            server_cls: Any = ray.remote(_server_class(backend))
            server: Any = server_cls.options(
                name=name, num_cpus=SERVER_NUM_CPUS, max_concurrency=self.max_concurrency
            ).remote(
                model_path=model_path,
                response_length=self.config.response_length,
                max_model_len=self.config.max_model_len or (self.config.prompt_length + self.config.response_length),
                max_batch_size=int(options.get("max_batch_size", self.config.max_num_seqs)),
                num_threads=int(options.get("num_threads", 2)),
                seed=self.config.seed + self.replica_rank,
                replica_rank=self.replica_rank,
            )
            await server.get_version.remote()  # surfaces constructor errors here, not at first use
            self.servers = [server]
            self._server_handle = server
            self._server_address = name

    ArealRolloutReplica.__name__ = f"{'VLLM' if backend == VLLM_BACKEND_NAME else 'CPU'}RolloutReplica"
    return ArealRolloutReplica


def _make_adapter_class(backend: str = BACKEND_NAME) -> type:
    from verl.workers.rollout.base import BaseRollout

    class CPUServerAdapter(BaseRollout):
        """Trainer-side end of the weight sync: gathers full tensors, ships them to the server."""

        def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, model_config, device_mesh)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            rollout_world = (
                self.config.tensor_model_parallel_size
                * self.config.data_parallel_size
                * self.config.pipeline_model_parallel_size
            )
            replica_rank = kwargs.get("replica_rank", -1)
            self.replica_rank = rank // rollout_world if replica_rank == -1 else replica_rank
            self.rollout_rank = rank % rollout_world
            self.is_leader_rank = self.rollout_rank == 0
            self._server: Any = None

        async def resume(self, tags: list[str]) -> None:
            return None

        async def release(self) -> None:
            return None

        async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
            if wire_format != "named_tensors":
                raise ValueError(f"the {BACKEND_NAME} backend takes full named tensors, not {wire_format!r}")
            # Every rank must drain the generator: producing full tensors is a collective.
            state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
            if not self.is_leader_rank:
                return
            if self._server is None:
                self._server = ray.get_actor(server_actor_name(self.replica_rank, backend=backend))
            version = int(kwargs.get("global_steps") or 0)
            reply = await self._server.update_weights.remote(state, version)
            if backend == VLLM_BACKEND_NAME:
                from areal_plugins.rollout.vllm.server import check_sync, expected_checksum

                check_sync(reply, version, expected_checksum(state), f"rollout replica {self.replica_rank}")
                return
            expected = weights_checksum(state)
            if reply["version"] != version or reply["checksum"] != expected:
                raise RuntimeError(
                    f"weight sync to rollout replica {self.replica_rank} failed: the server reports version "
                    f"{reply['version']} checksum {reply['checksum']}, the trainer sent version {version} "
                    f"checksum {expected}. The rollout would keep sampling stale weights; stopping."
                )

    return CPUServerAdapter


def __getattr__(name: str) -> Any:
    # verl imports the adapter by its fully qualified name; build the class on first use so
    # that importing this module does not import verl's worker stack.
    makers = {
        "CPUServerAdapter": lambda: _make_adapter_class(BACKEND_NAME),
        "VLLMServerAdapter": lambda: _make_adapter_class(VLLM_BACKEND_NAME),
        "CPURolloutReplica": lambda: _make_replica_class(BACKEND_NAME),
        "VLLMRolloutReplica": lambda: _make_replica_class(VLLM_BACKEND_NAME),
    }
    if name in makers:
        cls = makers[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def register_rollout_backend() -> None:
    """Add ``areal_cpu`` to both verl rollout registries (idempotent)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    base._ROLLOUT_REGISTRY[(BACKEND_NAME, "async")] = ADAPTER_FQN
    base._ROLLOUT_REGISTRY[(VLLM_BACKEND_NAME, "async")] = VLLM_ADAPTER_FQN
    RolloutReplicaRegistry.register(BACKEND_NAME, lambda: __getattr__("CPURolloutReplica"))
    RolloutReplicaRegistry.register(VLLM_BACKEND_NAME, lambda: __getattr__("VLLMRolloutReplica"))
