"""Where the rollout engines run, and what that changes for the async trainer (docs/design.md, Placements).

``areal.placement`` picks one strategy; the trainer asks it instead of comparing the setting's string:

- :class:`Colocated`: verl's hybrid replicas inside the trainer's workers. The engines share the devices,
  so they are interrupted and put to sleep when sampling ends and woken by the weight update.
- :class:`Separate`: verl's standalone replicas on a resource pool of their own, weights through a
  checkpoint engine; the engines generate throughout, and with a staging engine (``areal_gloo``) through the
  transfer too, paused only for the load (weight_sync/staged.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class Placement:
    """What the trainer needs to know of a placement; ``trainer`` is the :class:`ArealAsyncTrainer`."""

    name: str
    #: verl builds engines inside the trainer's workers (``_enable_hybrid_replicas``).
    hybrid_replicas: bool
    #: Who stops admission at a weight update: the weight sync, just before it aborts the engines (True: after a
    #: staged transfer, weight_sync/staged.py ``before_pause``), or the trainer before the sync starts (False).
    sync_pauses_admission: bool = False
    #: Seconds verl took to start this placement's own replicas (``separate``), measured in :meth:`setup`: what a
    #: replica started mid-run is allowed, times a factor (driver/replica_replacement.py). None: none started.
    startup_s: float | None = None

    def setup(self, trainer: Any) -> None:
        """After verl's own setup: build what verl does not for this placement."""

    def rollout_servers(self, trainer: Any) -> Any:
        """The LLM server manager whose replicas generate."""
        raise NotImplementedError

    def weight_sync(self, trainer: Any) -> Any:
        """The checkpoint manager that moves weights to :meth:`rollout_servers`."""
        raise NotImplementedError

    def after_sampling(self, trainer: Any) -> None:
        """The trainer has its batch and is about to compute."""

    def devices(self, trainer_devices: int, rollout_config: Any) -> int:
        """Devices the run holds, for verl's per-device ``perf/throughput``."""
        return trainer_devices


class Colocated(Placement):
    name = "colocated"
    hybrid_replicas = True

    def rollout_servers(self, trainer: Any) -> Any:
        return trainer.llm_server_manager

    def weight_sync(self, trainer: Any) -> Any:
        return trainer.checkpoint_manager

    def after_sampling(self, trainer: Any) -> None:
        # verl's colocated lifecycle: the engines share the devices with training, so they are interrupted
        # and put to sleep (weights and KV caches released under free_cache_engine) until the weight update
        # wakes them with the new weights.
        trainer.rollout_manager.pause()
        with trainer.recorder.span("rollout", "paused_for_training"):
            trainer.checkpoint_manager.abort_replicas()
            trainer.checkpoint_manager.sleep_replicas()
        trainer.rollout_manager.suspend_polling()  # nothing finishes while the engines sleep


class Separate(Placement):
    name = "separate"
    hybrid_replicas = False

    def __init__(self) -> None:
        self.server_manager: Any = None
        self.checkpoint_manager: Any = None

    def setup(self, trainer: Any) -> None:
        """verl's own standalone machinery: replicas on a pool of their own, weights by a checkpoint engine."""
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.rollout.llm_server import LLMServerManager

        from areal_plugins.weight_sync.staged import StagedCheckpointEngineManager

        config = trainer.config
        started = time.monotonic()
        self.server_manager = LLMServerManager.create(config=config, start_rank=0)
        self.startup_s = time.monotonic() - started
        engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
        self.checkpoint_manager = StagedCheckpointEngineManager(
            config=engine_config, actor_wg=trainer.actor_rollout_wg, replicas=self.server_manager.get_replicas()
        )

        # The sync stops admission just before it aborts the engines (after a staged transfer: weight_sync/staged.py),
        # not the trainer before the sync; a replay still stops it first (async_trainer.on_step_end).
        def stop_admission() -> None:  # the rollout manager is built later (on_train_begin); the first sync has none
            if trainer.rollout_manager is not None:
                trainer.rollout_manager.pause()

        self.checkpoint_manager.before_pause = stop_admission
        self.sync_pauses_admission = True
        logger.info(
            "areal_async separate: %d standalone rollout replicas, weights by checkpoint engine %s",
            len(self.server_manager.get_replicas()),
            engine_config.backend,
        )

    def rollout_servers(self, trainer: Any) -> Any:
        return self.server_manager

    def weight_sync(self, trainer: Any) -> Any:
        return self.checkpoint_manager

    def devices(self, trainer_devices: int, rollout_config: Any) -> int:
        # As verl's separate_async: else 6 generating and 2 training GPUs would report 4x the real rate.
        return trainer_devices + int(rollout_config.nnodes) * int(rollout_config.n_gpus_per_node)


PLACEMENTS: dict[str, type[Placement]] = {"colocated": Colocated, "separate": Separate}


def placement_for(name: str) -> Placement:
    """The strategy for ``areal.placement`` (validated by the settings: one of :data:`PLACEMENTS`)."""
    return PLACEMENTS[name]()
