"""Replicas started mid-run (``placement: separate``): replacements for replicas that died
(``areal.replace_dead_replicas``) and new ones when the cluster grows (``areal.max_rollout_replicas``).

When the replica pool drops a dead replica (replica_pool.py), its placement group is removed so that its devices are
free again, and a replacement of the same class starts in the background through verl's own
``RolloutReplica.init_standalone`` (a placement group of its own, its checkpoint-engine workers, its server). Ray
places it where it can: on the freed devices, or on a node that joins the cluster later; until then it waits, and the
run goes on with the replicas left.

A started replacement serves nothing until it holds the current weights. It joins the replica list before the next
weight sync, so the sync's process group includes it and it receives the new version like every other replica, with
the same checks (the transport's and the engine's checksums); only after that sync is it added to verl's load
balancer. Every token it generates therefore carries the version it was generated under: the staleness accounting
does not change.

With ``areal.max_rollout_replicas`` above the recipe's count, the trainer looks at each step's end whether Ray has
the devices for one more replica (a node joined); if so one starts the same way and joins the same way. The
admission bound counts prompt groups, not engines, so it needs no change: more engines drain it faster.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray

from areal_plugins.records.writer import RunRecorder

logger = logging.getLogger(__name__)

#: Seconds between two looks at the cluster's free devices while a replacement waits for its own.
WAIT_FOR_DEVICES_S = 2.0


def free_device_count() -> float:
    """Devices Ray has free now (GPUs, or NPUs on Ascend), counted as verl's resource-pool check counts them."""
    available = ray.available_resources()
    return float(available.get("GPU", available.get("NPU", 0.0)))


def wait_for_devices(needed: int) -> None:
    """Until Ray has ``needed`` devices free (verl's ``init_standalone`` refuses at once when it has not): the freed
    devices of the dead replica show up a moment after its placement group goes, a new node's when it joins."""
    while free_device_count() < needed:
        time.sleep(WAIT_FOR_DEVICES_S)


def free_devices(replica: Any) -> int:
    """Remove the placement groups of a dead ``replica`` (its devices are reserved until then); how many."""
    from ray.util.placement_group import remove_placement_group

    groups = list(getattr(getattr(replica, "resource_pool", None), "pgs", None) or [])
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception as error:  # already gone with its node
            logger.info("areal: placement group of a dead replica not removed: %s", error)
    return len(groups)


class ReplicaReplacer:
    """Starts a replacement per dropped replica; :meth:`join` and :meth:`serve` bring it in around a weight sync.

    Only the trainer's thread calls :meth:`replace`, :meth:`join` and :meth:`serve` (they change the lists verl's
    checkpoint manager iterates); the replacements start in threads of their own.
    """

    def __init__(self, server_manager: Callable[[], Any], recorder: RunRecorder, enabled: bool) -> None:
        self._server_manager = server_manager
        self.recorder = recorder
        self.enabled = enabled
        # (the dead rank it replaces or None for growth, its rank, the started replica)
        self._starting: list[tuple[int | None, int, Future]] = []
        self._joined: list[tuple[int | None, Any]] = []  # (dead rank or None, replica) in the sync list, not serving
        self._next_rank: int | None = None
        self.replaced = 0  # replacements serving
        self.grown = 0  # replicas added beyond the recipe's, serving

    def replace(self, dead: Any) -> None:
        """Free ``dead``'s devices and start its replacement (a new replica rank: Ray's actor names stay unique)."""
        if not self.enabled:
            return
        freed = free_devices(dead)
        rank = self._start(dead.replica_rank, extra_ranks=[dead.replica_rank])
        self._event("replacing", dead.replica_rank, replica=rank, placement_groups_freed=freed)
        logger.warning(
            "areal: starting replica %d to replace replica %d; it takes requests after the weight sync that follows "
            "its start",
            rank,
            dead.replica_rank,
        )

    def grow(self, max_replicas: int | None) -> bool:
        """At a step's end: start one more replica if fewer than ``max_replicas`` serve or start and Ray has the
        devices for it now (a node joined). Returns whether one started."""
        if max_replicas is None:
            return False
        manager = self._server_manager()
        # One at a time: Ray counts a device as free until the new replica's placement group holds it.
        if self.pending or len(manager.rollout_replicas) >= max_replicas:
            return False
        config = manager.rollout_config
        per_replica = (
            config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size
        )
        if free_device_count() < per_replica:
            return False
        rank = self._start(None)
        self._event("growing", None, replica=rank, replicas=len(manager.rollout_replicas), max_replicas=max_replicas)
        logger.warning(
            "areal: Ray has the devices for another rollout replica: starting replica %d (up to %d); it takes "
            "requests after the weight sync that follows its start",
            rank,
            max_replicas,
        )
        return True

    def _start(self, dead: int | None, extra_ranks: list[int] | None = None) -> int:
        """Start a replica of the run's class in the background under a new rank; the rank."""
        manager = self._server_manager()
        if self._next_rank is None:
            ranks = [replica.replica_rank for replica in manager.rollout_replicas] + (extra_ranks or [])
            self._next_rank = max(ranks, default=-1) + 1
        rank, self._next_rank = self._next_rank, self._next_rank + 1
        replica = manager.rollout_replica_class(
            replica_rank=rank,
            config=manager.rollout_config,
            model_config=manager.model_config,
            gpus_per_node=manager.rollout_config.n_gpus_per_node,
        )
        started: Future = Future()

        def start() -> None:
            try:
                wait_for_devices(replica.gpus_per_replica_node * replica.nnodes)
                asyncio.run(replica.init_standalone())
                started.set_result(replica)
            except BaseException as error:
                started.set_exception(error)

        threading.Thread(target=start, name=f"areal-start-replica-{rank}", daemon=True).start()
        self._starting.append((dead, rank, started))
        return rank

    def join(self) -> int:
        """Before a weight sync: add each replacement that has started to the replicas the sync updates (not yet to
        the load balancer). Returns how many joined."""
        manager, still, joined = self._server_manager(), [], 0
        for dead, rank, started in self._starting:
            if not started.done():
                still.append((dead, rank, started))
                continue
            error = started.exception()
            if error is not None:
                self._event("start_failed", dead, replica=rank, reason=repr(error)[:400])
                logger.error("areal: rollout replica %d failed to start (%r); running without it", rank, error)
                continue
            replica = started.result()
            # In place, the three lists aligned: verl's checkpoint manager iterates ``rollout_replicas`` itself.
            manager.rollout_replicas.append(replica)
            manager.server_handles.append(replica._server_handle)
            manager.server_addresses.append(replica._server_address)
            self._joined.append((dead, replica))
            joined += 1
        self._starting = still
        return joined

    def serve(self, version: int) -> None:
        """After a weight sync to ``version`` succeeded: the replicas it brought in take requests."""
        if not self._joined:
            return
        manager = self._server_manager()
        serving = {id(replica) for replica in manager.rollout_replicas}
        servers = {
            replica._server_address: replica._server_handle for _, replica in self._joined if id(replica) in serving
        }
        if servers:
            ray.get(manager.global_load_balancer.add_servers.remote(servers))
        for dead, replica in self._joined:
            if id(replica) not in serving:
                continue  # it died before it served
            if dead is None:
                self.grown += 1
            else:
                self.replaced += 1
            self._event("joined", dead, replica=replica.replica_rank, version=version, address=replica._server_address)
            logger.warning(
                "areal: rollout replica %d (%s) serves version %d from now on",
                replica.replica_rank,
                "a new one" if dead is None else f"replacing replica {dead}",
                version,
            )
        self._joined = []
        from areal_plugins.driver.placement_report import record_ray_placement

        record_ray_placement("separate")  # where the new replicas landed (ray_actors.jsonl, appended)

    @property
    def pending(self) -> int:
        """Replacements started or joined that do not serve yet."""
        return len(self._starting) + len(self._joined)

    def _event(self, event: str, dead: int | None, **fields: Any) -> None:
        self.recorder.write("replica_events.jsonl", {"time": time.time(), "event": event, "replaces": dead, **fields})
