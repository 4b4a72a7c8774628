"""Where a rollout replica leaves or joins the run (``placement: separate``): one place for both of verl's lists.

Two verl objects hold the replicas the trainer uses: the server manager (``LLMServerManager``: three aligned lists,
``rollout_replicas``, ``server_handles``, ``server_addresses``, which our pool, statistics and replacer read) and
the checkpoint manager (``CheckpointEngineManager.replicas``, whose checkpoint-engine workers every weight sync
builds its group from: verl's ``update_weights`` and ours, weight_sync/staged.py ``_rollout_group``). At the start
they are one list object (``replicas=server_manager.get_replicas()``, driver/placements.py).

verl's checkpoint manager has seams for elastic replicas, ``add_replicas`` / ``remove_replicas``
(verl/checkpoint_engine/base.py:449-464), and its server manager has none. The two seams treat the list
differently: ``add_replicas`` extends ``self.replicas`` in place (base.py:455) while ``remove_replicas`` binds a new
list (base.py:464). So an edit of the server manager's list in place next to the seams is wrong both ways: an
addition lands twice while the list is still shared, and after the first removal the two managers no longer share
one. :class:`ReplicaLists` therefore rebuilds the server manager's lists (new objects), calls verl's seam for the
checkpoint manager, and checks after every change that both hold the same replicas in the same order; the drop of a
dead replica and the join of a replacement both go through it, so neither half can be forgotten (the dead replica's
worker would otherwise stay in the staged sync's group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ReplicaListsDivergedError(RuntimeError):
    """verl's server manager and checkpoint manager no longer hold the same replicas."""


class ReplicaLists:
    """The replicas of a run, changed in verl's server manager and checkpoint manager together (module docstring).

    Args:
        server_manager: returns verl's ``LLMServerManager`` whose replicas generate (built after the trainer).
        checkpoint_manager: returns verl's ``CheckpointEngineManager`` that syncs their weights.

    Only the trainer's thread calls :meth:`remove` and :meth:`add`, between weight syncs.
    """

    def __init__(self, server_manager: Callable[[], Any], checkpoint_manager: Callable[[], Any]) -> None:
        self._server_manager = server_manager
        self._checkpoint_manager = checkpoint_manager

    @property
    def server_manager(self) -> Any:
        """verl's ``LLMServerManager`` (its load balancer, replica class and config are read from it)."""
        return self._server_manager()

    @property
    def replicas(self) -> list[Any]:
        """The replicas serving, in the server manager's order."""
        return list(self._server_manager().get_replicas())

    def synced(self) -> list[Any]:
        """The replicas whose checkpoint-engine workers the next weight sync sends to."""
        return list(self._checkpoint_manager().replicas)

    def remove(self, replica: Any) -> str:
        """Take ``replica`` out of the server manager's three lists and out of the weight sync (verl's
        ``remove_replicas``); returns its server address (for the load balancer)."""
        self._check_aligned(f"before replica {replica.replica_rank} is removed")  # an outside change: none of ours
        manager = self._server_manager()
        index = next(i for i, held in enumerate(manager.rollout_replicas) if held is replica)
        address: str = manager.server_addresses[index]
        keep = [i for i in range(len(manager.rollout_replicas)) if i != index]
        manager.rollout_replicas = [manager.rollout_replicas[i] for i in keep]
        manager.server_handles = [manager.server_handles[i] for i in keep]
        manager.server_addresses = [manager.server_addresses[i] for i in keep]
        self._checkpoint_manager().remove_replicas([replica])
        self._check_aligned(f"after replica {replica.replica_rank} was removed")
        return address

    def add(self, replica: Any) -> None:
        """Append a started ``replica`` to the server manager's three lists and to the weight sync (verl's
        ``add_replicas``); the load balancer is told only after its first sync (driver/replica_replacement.py)."""
        self._check_aligned(f"before replica {replica.replica_rank} is added")
        manager = self._server_manager()
        # New lists first: while verl's checkpoint manager still holds the server manager's very list, its
        # add_replicas (an in-place extend) would otherwise add the replica to both at once, and this a second time.
        manager.rollout_replicas = [*manager.rollout_replicas, replica]
        manager.server_handles = [*manager.server_handles, replica._server_handle]
        manager.server_addresses = [*manager.server_addresses, replica._server_address]
        self._checkpoint_manager().add_replicas([replica])
        self._check_aligned(f"after replica {replica.replica_rank} was added")

    def _check_aligned(self, when: str) -> None:
        serving, synced = self.replicas, self.synced()
        if [id(r) for r in serving] != [id(r) for r in synced]:
            ranks = lambda replicas: [getattr(r, "replica_rank", "?") for r in replicas]  # noqa: E731
            raise ReplicaListsDivergedError(
                f"{when}, verl's server manager serves replicas {ranks(serving)} but its checkpoint manager "
                f"syncs {ranks(synced)}: a weight sync would send to a replica that is gone or miss one that "
                "serves. Something changed one of verl's lists outside driver/replica_lists.py; change both there"
            )
