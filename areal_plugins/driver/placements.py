"""Where the rollout engines run, and what that changes for the async trainer (docs/design.md, Placements).

``areal.placement`` picks one strategy; the trainer asks it instead of comparing the setting's string:

- :class:`Colocated`: verl's hybrid replicas inside the trainer's workers. The engines share the devices,
  so they are interrupted and put to sleep when sampling ends and woken by the weight update.
- :class:`Separate`: verl's standalone replicas on a resource pool of their own, weights through a
  checkpoint engine; the engines generate throughout, and with a staging engine (``areal_gloo``) through the
  transfer too, paused only for the load (weight_sync/staged.py).

Either placement meets the requests under way at an update as ``areal.weight_update.in_flight`` says: ``interrupt``
aborts them (they continue under the new weights), ``wait`` stops admission and lets them finish under the old
weights first (:meth:`Placement.finish_in_flight`), the paper's ablation without interruptible generation.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from areal_plugins.hooks.contracts import staleness_controller_of

logger = logging.getLogger(__name__)

#: ``timing_raw`` key (verl logs it as ``timing_s/wait_in_flight``): seconds a step's update waited for the
#: generations under way to finish (``areal.weight_update.in_flight: wait``).
WAIT_IN_FLIGHT_TIMING = "wait_in_flight"


def wait_for_in_flight(
    manager: Any,
    check: Callable[[], None],
    poll_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Stop admission and return once no rollout group is in flight; the seconds it waited.

    The manager's own thread keeps settling the groups that finish (``pause`` stops submitting only), so its
    ``staleness_controller.running`` falls to 0 as the last request under way completes under the weights it started
    with.

    Args:
        manager: the rollout manager (:class:`areal_plugins.hooks.contracts.RolloutManager`).
        check: called each round (the supervisor's check: the stall guard, a stop request, dead actors); raises to
            stop waiting.
        poll_s: seconds between two looks at the count.
        sleep: waits ``poll_s`` (injected for tests).
        clock: monotonic seconds (injected for tests).
    """
    manager.pause()
    started = clock()
    staleness_controller = staleness_controller_of(manager)
    while staleness_controller.running > 0:
        manager.check_alive()
        check()
        sleep(poll_s)
    return clock() - started


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
    #: ``areal.weight_update.in_flight`` and ``areal.poll_interval_s``, set by :func:`placement_for`.
    in_flight: str = "interrupt"
    poll_s: float = 0.05

    def finish_in_flight(self, trainer: Any) -> None:
        """``in_flight: wait``: hold the coming update (colocated: the engines' sleep) until every group under way
        has finished under the current weights; ``interrupt``: nothing (the update aborts them). The wait is added
        to the step's ``timing_s/wait_in_flight``."""
        if self.in_flight != "wait" or trainer.rollout_manager is None:
            return
        manager, check = trainer.rollout_manager, trainer.supervisor.waiting()
        with trainer.recorder.span("rollout", "wait_in_flight"):
            waited = wait_for_in_flight(manager, check, self.poll_s)
        trainer.timing_raw[WAIT_IN_FLIGHT_TIMING] = trainer.timing_raw.get(WAIT_IN_FLIGHT_TIMING, 0.0) + waited

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
        # wakes them with the new weights. With in_flight: wait the requests under way finish first.
        trainer.rollout_manager.pause()
        self.finish_in_flight(trainer)
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
        self.checkpoint_manager.before_pause = functools.partial(self.stop_admission, trainer)
        self.sync_pauses_admission = True
        logger.info(
            "areal_async separate: %d standalone rollout replicas, weights by checkpoint engine %s",
            len(self.server_manager.get_replicas()),
            engine_config.backend,
        )

    def stop_admission(self, trainer: Any) -> None:
        """The sync calls it just before it aborts the engines: no more submissions, and with ``in_flight: wait``
        the requests under way finish first, so the abort finds none. The first sync (before ``on_train_begin``
        builds the rollout manager) has nothing to stop."""
        if trainer.rollout_manager is not None:
            trainer.rollout_manager.pause()
            self.finish_in_flight(trainer)

    def rollout_servers(self, trainer: Any) -> Any:
        return self.server_manager

    def weight_sync(self, trainer: Any) -> Any:
        return self.checkpoint_manager

    def devices(self, trainer_devices: int, rollout_config: Any) -> int:
        # As verl's separate_async: else 6 generating and 2 training GPUs would report 4x the real rate.
        return trainer_devices + int(rollout_config.nnodes) * int(rollout_config.n_gpus_per_node)


PLACEMENTS: dict[str, type[Placement]] = {"colocated": Colocated, "separate": Separate}


def placement_for(name: str, in_flight: str = "interrupt", poll_s: float = 0.05) -> Placement:
    """The strategy for ``areal.placement`` (validated by the settings: one of :data:`PLACEMENTS`), meeting the
    requests under way at an update as ``in_flight`` (``areal.weight_update.in_flight``) says, looking at them
    every ``poll_s`` (``areal.poll_interval_s``) while it waits."""
    placement = PLACEMENTS[name]()
    placement.in_flight, placement.poll_s = in_flight, poll_s
    return placement
