"""Rollout replicas that die mid-run (``placement: separate``): dropped while another replica serves.

A standalone replica's server can die alone (its process killed, its node lost) while the trainer and the
other replicas live on. Its requests continue on the survivors (our client, agent_loop/llm_client.py); this
pool takes it out of what the trainer addresses every step: the load balancer, the weight sync's process
group, the statistics and the actor watch. The run stops only when no replica is left, naming the servers.
Colocated engines share the trainer's workers: their death is the trainer's, which automatic resume covers
(``--max-restarts``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from areal_plugins.driver.replica_lists import ReplicaLists
from areal_plugins.records.writer import RunRecorder

logger = logging.getLogger(__name__)

#: How long a living server may take to answer the probe (its control slots are kept free of requests).
PROBE_TIMEOUT_S = 30.0


class RolloutServerDiedError(RuntimeError):
    """A rollout server actor is gone and nothing replaces it."""


def actor_id(handle: Any) -> str:
    return handle._actor_id.hex()


def weight_group_rebuilt_each_sync(rollout_config: Any) -> bool:
    """Whether the checkpoint engine builds its process group anew for every weight sync, so that a sync after a
    replica was dropped has only the living in it: ``areal_gloo`` always; verl's ``nccl``/``hccl``/``kimi`` only
    with their ``rebuild_group`` (``checkpoint_engine.engine_kwargs.<backend>.rebuild_group: true``)."""
    engine = rollout_config.checkpoint_engine
    if engine.backend == "areal_gloo":
        return True
    kwargs = (engine.get("engine_kwargs") or {}).get(engine.backend) or {}
    return bool(kwargs.get("rebuild_group", False))


class ReplicaPool:
    """The replicas of ``lists`` (verl's server and checkpoint managers, built after the trainer) still serving.

    ``survives`` is False where a dead server must stop the run (colocated engines, or a checkpoint engine that
    keeps its process group across syncs). Thread-safe marks (:meth:`survivable`) come from any thread;
    :meth:`prune` changes the lists the trainer and verl's checkpoint manager iterate (through ``lists``), so only
    the trainer's thread calls it, between their uses.
    """

    def __init__(self, lists: ReplicaLists, recorder: RunRecorder, survives: bool, backend: str) -> None:
        self.lists = lists
        self.recorder = recorder
        self.survives = survives
        self.backend = backend
        self.lost: list[int] = []  # replica ranks dropped so far
        self.on_drop: Callable[[Any], None] | None = None  # told of each dropped replica (its replacement starts)
        self._suspects: set[str] = set()  # actor ids of replicas' parts reported dead, not yet dropped
        self._dropped: set[str] = set()  # actor ids of the dropped replicas' parts (servers and workers)
        self._lock = threading.Lock()

    @property
    def replicas(self) -> list[Any]:
        return self.lists.replicas

    def servers(self) -> list[tuple[int, Any]]:
        """(replica rank, server handle) of every replica still in the pool."""
        return [(replica.replica_rank, server) for replica in self.replicas for server in replica.servers]

    def _parts(self) -> dict[str, int]:
        """Actor id -> replica rank, for every server and checkpoint-engine worker of the replicas in the pool."""
        return {
            actor_id(handle): replica.replica_rank
            for replica in self.replicas
            for handle in [*replica.servers, *getattr(replica, "workers", [])]
        }

    def survivable(self, dead_actor_id: str) -> bool:
        """Whether the death of actor ``dead_actor_id`` costs only its replica: it is a server or worker of one and
        another replica still serves. Marks it for :meth:`prune`."""
        with self._lock:
            if dead_actor_id in self._dropped:
                return True
            if not self.survives:
                return False
            parts = self._parts()
            if dead_actor_id not in parts:
                return False
            suspected = {parts[a] for a in self._suspects if a in parts} | {parts[dead_actor_id]}
            if not set(parts.values()) - suspected:
                return False
            self._suspects.add(dead_actor_id)
            return True

    @property
    def has_suspects(self) -> bool:
        return bool(self._suspects)

    def prune(self) -> list[int]:
        """Drop every replica whose server is dead; return their ranks. Raises :class:`RolloutServerDiedError`
        when no replica would be left, or when this placement cannot lose one."""
        if not self.survives and not self.has_suspects:
            return []  # a dead server is the trainer's own failure here, reported where it is met
        with self._lock:
            suspected = {rank for a, rank in self._parts().items() if a in self._suspects}
        deaths = self._deaths()
        for rank in suspected - set(deaths):  # a worker died, its server lives: the replica cannot take weights
            deaths[rank] = "a checkpoint-engine worker of the replica died"
        if not deaths:
            with self._lock:
                self._suspects.clear()  # a slow answer, not a death
            return []
        ranks = sorted(deaths)
        alive = {replica.replica_rank for replica in self.replicas} - set(ranks)
        if not self.survives or not alive:
            raise RolloutServerDiedError(
                f"the rollout server of {self.backend} replica(s) {ranks} died ({deaths[ranks[0]]}) and "
                + ("no other replica is left" if self.survives else "this run cannot drop a replica")
                + ". Stopping the run; resume from the last checkpoint (trainer.resume_mode=auto, or "
                "areal-plugins train --max-restarts N) once the cause (memory? a kill? a lost node?) is fixed"
            )
        for rank in ranks:
            self._drop(rank, deaths[rank])
        with self._lock:
            self._suspects.clear()
        return ranks

    def _deaths(self) -> dict[int, str]:
        """Replica rank -> why, for each replica with a dead server. Every server is asked at once, one deadline:
        a slow server is taken for alive (only Ray's word that an actor died drops a replica)."""
        servers = self.servers()
        probes = [(rank, server.__ray_ready__.remote()) for rank, server in servers]
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        deaths: dict[int, str] = {}
        for rank, probe in probes:
            try:
                ray.get(probe, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.ActorDiedError as error:
                deaths.setdefault(rank, str(error).splitlines()[0])
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                continue  # busy or briefly unreachable: not dead
        return deaths

    def _drop(self, rank: int, why: str) -> None:
        replica = next(replica for replica in self.lists.replicas if replica.replica_rank == rank)
        parts = [*replica.servers, *getattr(replica, "workers", [])]
        with self._lock:
            self._dropped.update(actor_id(handle) for handle in parts)
        address = self.lists.remove(replica)  # from the servers and from the weight sync's group, together
        ray.get(self.lists.server_manager.global_load_balancer.remove_servers.remote([address]))
        # Every part still alive goes too: a server left with hung requests would hold their admission slots (its
        # callers fail over when it dies), and the workers hold devices for nothing.
        for handle in parts:
            ray.kill(handle, no_restart=True)
        self.lost.append(rank)
        if self.on_drop is not None:
            self.on_drop(replica)
        left = len(self.lists.replicas)
        self.recorder.write(
            "replica_events.jsonl",
            {"time": time.time(), "event": "lost", "replica": rank, "reason": why, "replicas_left": left},
        )
        logger.warning(
            "areal: rollout replica %d (%s) died (%s): dropped; its requests continue on the %d replica(s) left",
            rank,
            address,
            why,
            left,
        )
