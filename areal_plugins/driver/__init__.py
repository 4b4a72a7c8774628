"""Runs in verl's driver (the TaskRunner process): our trainer modes, registered through verl's ``register_trainer``
seam, and what runs beside them there (admission, supervision, replicas, checkpoints, per-step metrics).

- ``areal_async`` (:mod:`.async_trainer`): verl's V1 PPO trainer run the AReaL way — continuous
  admission bounded by the staleness η (:mod:`.admission`), interruptible generation
  (:mod:`areal_plugins.agent_loop.llm_client`), per-token versions, the oldest samples first (docs/design.md).
- ``areal_sync`` (:mod:`.hooked`): verl's synchronous trainer plus our lifecycle hooks.

``areal.enable: true`` routes ``trainer.v1.trainer_mode`` to one of them (:mod:`areal_plugins.config.routing`).
The decoupled objective is registered as verl policy losses by the trainer workers
(:mod:`areal_plugins.trainer_workers.policy_loss`).
"""

from __future__ import annotations

from areal_plugins.config.routing import ASYNC_MODE, SYNC_MODE

__all__ = ["ASYNC_MODE", "SYNC_MODE", "register_trainers"]


def register_trainers() -> None:
    """Register ``areal_async`` and ``areal_sync`` with verl (idempotent)."""
    from verl.trainer.ppo.v1 import get_trainer_cls, register_trainer
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from areal_plugins.driver.hooked import HookedTrainerMixin

    if SYNC_MODE not in TRAINER_REGISTRY:
        base = get_trainer_cls("sync")
        register_trainer(SYNC_MODE)(type(f"Areal{base.__name__}", (HookedTrainerMixin, base), {}))
    # The module registers its class where it defines it (as verl's trainers do): a plain import, so that
    # verl's V1 package finishing its import half way through ours (ours imports it first) still registers it.
    import areal_plugins.driver.async_trainer  # noqa: F401
