"""``ArealRolloutReplica``: verl's rollout replica for our backends (one server actor per replica, no accelerator).

verl finds it through ``RolloutReplicaRegistry`` (rollout/verl_registration.py registers a loader that imports this
module by name): the module imports verl's replica base at its top, so nothing imports it before verl asks.
Helpers are read from :mod:`.verl_registration` at call time, where the tests replace them.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from areal_plugins.rollout import verl_registration as registration
from areal_plugins.rollout.server_slots import UNBOUNDED_SLOTS, server_concurrency


class ArealRolloutReplica(RolloutReplica):
    """A replica of one server actor of the backend ``config.name`` (no accelerator needed)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        backend = str(self.config.name)
        registration.check_capabilities(self.config)
        options = registration.engine_options(self.config)
        own_options = registration.ENGINE_OPTIONS
        model_path = getattr(self.model_config, "local_path", None) or self.model_config.path
        name = registration.server_actor_name(backend, self.replica_rank, self.name_suffix)
        cls = registration.server_class(backend)
        server_cls: Any = ray.remote(cls)
        placement: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if "routed_experts" in cls.capabilities:  # router replay: asked of backends that declare it
            extra["routed_experts"] = bool(self.config.get("enable_rollout_routing_replay", False))
        if "lora_adapter_check" in cls.capabilities:  # adapter-only updates: sleep keeps the base weights
            extra["lora_adapter"] = registration.sends_lora_adapter(self.model_config)
        if "images" in cls.capabilities:  # a vision-language model's processor may be the model folder's own code
            extra["trust_remote_code"] = bool(getattr(self.model_config, "trust_remote_code", False))
        if self.workers:  # on the node of this replica's workers (its devices), as verl's vLLM replica does
            node = str(ray.get(self.workers[0].__ray_call__.remote(registration._node_id)))
            placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            if cls.uses_reserved_gpus:
                devices = ray.get([w.__ray_call__.remote(registration._cuda_devices) for w in self.workers])
                hybrid = self.rollout_mode == RolloutMode.HYBRID
                gpu = registration.gpu_settings(self.config, [d for ds in devices for d in ds], hybrid)
                if gpu is not None:
                    extra["gpu"] = gpu
        server: Any = server_cls.options(
            name=name,
            num_cpus=registration.SERVER_NUM_CPUS,
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
            **{key: value for key, value in options.items() if key not in own_options},  # a backend's own
            **extra,
        )
        await server.get_version.remote()  # surfaces constructor errors here, not at first use
        self.servers = [server]
        self._server_handle = server
        self._server_address = name
