"""Replicas started mid-run (``placement: separate``): replacements for replicas that died
(``areal.replace_dead_replicas``) and new ones when the cluster grows (``areal.max_rollout_replicas``).

When the replica pool drops a dead replica (replica_pool.py), the processes it left on its nodes are ended (Ray ends
a dead actor's children and process group; a descendant in a session of its own outlives it and keeps its GPU's
memory): the trainer records each replica's process trees while it serves. Then its
placement group is removed so that its devices are free again, and a replacement of the same class starts in the
background through verl's own ``RolloutReplica.init_standalone`` (a placement group of its own, its
checkpoint-engine workers, its server).

A replica's placement group packs its GPUs on one node (verl's ``STRICT_PACK``, one group per node it spans), so a
replacement starts only once one node has them all free, as Ray's per-node view says (:func:`placement_shortfall`;
the cluster's total would count two half-free nodes as one free one, and Ray would then wait forever). It waits
for that at most :attr:`ReplicaReplacer.start_timeout_s`, and its start is given the same time: a start that has
not finished by then is abandoned (its placement group removed, which ends verl's wait for it), recorded in
``replica_events.jsonl`` and logged, and the run goes on with the replicas left.

A started replacement serves nothing until it holds the current weights. It joins the replica list before the next
weight sync, so the sync's process group includes it and it receives the new version like every other replica, with
the same checks (the transport's and the engine's checksums); only after that sync is it added to verl's load
balancer. Every token it generates therefore carries the version it was generated under: the staleness accounting
does not change.

With ``areal.max_rollout_replicas`` above the recipe's count, the trainer looks at each step's end whether one node
of Ray's has the devices for one more replica (a node joined); if so one starts the same way and joins the same
way; if not, why not is logged and recorded once. The admission bound counts prompt groups, not engines, so it
needs no change: more engines drain it faster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import ray

from areal_plugins.driver.replica_lists import ReplicaLists
from areal_plugins.records.writer import RunRecorder

logger = logging.getLogger(__name__)

#: Seconds between two looks at the nodes' free devices while a replacement waits for its own.
WAIT_FOR_DEVICES_S = 2.0
#: verl's standalone pool reserves this many CPUs with each device (``init_standalone``: ``max_colocate_count=2``,
#: one ``{"CPU": 2, "GPU": 1}`` bundle per device; verl 0.9.1 ``workers/rollout/replica.py``).
CPUS_PER_DEVICE = 2.0
#: Without ``areal.replica_start_timeout_s``, a start may take this many times the run's own measured start of its
#: replicas (all of them at once, at startup; one alone needs no more, on a node as fast).
START_TIMEOUT_FACTOR = 3.0
#: How long the processes a dead replica left on its nodes get to be ended, before its devices are freed anyway.
END_LEFTOVERS_TIMEOUT_S = 30.0
#: verl's name for a standalone replica's placement groups (``RayResourcePool.get_placement_groups``, verl 0.9.1):
#: ``rollout_pool_<rank><suffix>verl_group_<counts>:<i>``.
PLACEMENT_GROUP_NAME = "rollout_pool_{rank}{suffix}verl_group_"


class ReplicaNotPlacedError(RuntimeError):
    """No node of the cluster has the devices a replica needs, within the start's time."""


def device_resource(node: dict[str, float]) -> str:
    return "NPU" if "NPU" in node and "GPU" not in node else "GPU"


def free_per_node() -> dict[str, dict[str, float]]:
    """Ray's free resources of each live node (the view verl's own resource-pool check reads)."""
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def placement_shortfall(
    free: dict[str, dict[str, float]], devices_per_node: int, nodes: int, cpus_per_device: float = CPUS_PER_DEVICE
) -> str | None:
    """Why a replica of ``nodes`` placement groups, each ``devices_per_node`` devices (and ``cpus_per_device`` CPUs
    each) packed on one node, cannot be placed on nodes with ``free`` resources now; None when it can. A node can
    hold as many of the groups as both its free devices and its free CPUs allow."""
    if devices_per_node <= 0:
        return None  # nothing to place (a stand-in replica without devices)
    fits = 0
    for resources in free.values():
        devices = resources.get(device_resource(resources), 0.0)
        cpus = resources.get("CPU", 0.0)
        by_cpu = int(cpus // (cpus_per_device * devices_per_node)) if cpus_per_device > 0 else nodes
        fits += min(int(devices // devices_per_node), by_cpu)
    if fits >= nodes:
        return None
    shown = ", ".join(
        f"{node[:8]}: {resources.get(device_resource(resources), 0.0):g} {device_resource(resources)}, "
        f"{resources.get('CPU', 0.0):g} CPU"
        for node, resources in sorted(free.items())
    )
    need = f"{devices_per_node} free devices and {devices_per_node * cpus_per_device:g} free CPUs on one node"
    return (
        f"a replica needs {need}" + (f", on each of {nodes} nodes" if nodes > 1 else "")
        + f" (a tensor-parallel group is packed on one node), and Ray has {fits} such place(s) now; free per node: "
        + (shown or "no live node")
    )  # fmt: skip


def wait_for_placement(
    devices_per_node: int,
    nodes: int,
    timeout_s: float | None,
    free: Callable[[], dict[str, dict[str, float]]] = lambda: free_per_node(),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Until a node (``nodes`` of them) has a replica's devices free: the dead replica's show up a moment after its
    placement group goes, a new node's when it joins. Raises :class:`ReplicaNotPlacedError` after ``timeout_s``."""
    deadline = None if timeout_s is None else clock() + timeout_s
    while (why := placement_shortfall(free(), devices_per_node, nodes)) is not None:
        if deadline is not None and clock() >= deadline:
            raise ReplicaNotPlacedError(f"not placed within {timeout_s:.0f} s: {why}")
        sleep(WAIT_FOR_DEVICES_S)


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


def remove_pending_groups(replica: Any) -> int:
    """Remove the placement groups verl made for ``replica`` that are not placed yet (verl keeps them only once
    placed): its start stops waiting for them (``TaskPlacementGroupRemoved``). How many."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    prefix = PLACEMENT_GROUP_NAME.format(rank=replica.replica_rank, suffix=getattr(replica, "name_suffix", ""))
    removed = 0
    for group_id, group in placement_group_table().items():
        if str(group.get("name", "")).startswith(prefix) and group.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
                removed += 1
            except Exception as error:
                logger.info("areal: placement group %s of replica %d not removed: %s", group_id, replica.replica_rank,
                            error)  # fmt: skip
    return removed


# ---------------------------------------------------------------- a replica's processes, and what a dead one leaves


def process_tree(_actor: Any = None) -> dict[str, Any]:
    """This process and its descendants (pid, start time) on this node; run inside a replica's actor through
    Ray's ``__ray_call__``. The start time tells a process from a later one that reuses its pid."""
    import psutil

    me = psutil.Process()
    processes = [me, *me.children(recursive=True)]
    return {"node": ray.get_runtime_context().get_node_id(), "processes": [[p.pid, p.create_time()] for p in processes]}


def leftovers(recorded: list[list[float]], alive: dict[int, float]) -> list[int]:
    """Of the ``recorded`` processes of a dead replica, those still alive: the same pid with the same start time
    (``alive``: pid -> start time of this node's processes); a reused pid is another program's."""
    return [int(pid) for pid, started in recorded if int(pid) in alive and abs(alive[int(pid)] - started) < 1e-3]


def end_processes(recorded: list[list[float]]) -> int:
    """SIGKILL, on this node, the ``recorded`` processes still alive (:func:`leftovers`); how many."""
    import psutil

    alive: dict[int, float] = {}
    for pid, _ in recorded:
        try:
            alive[int(pid)] = psutil.Process(int(pid)).create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    ended = 0
    for pid in leftovers(recorded, alive):
        try:
            psutil.Process(pid).kill()
            ended += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ended


def replica_processes(replica: Any, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Where each of a serving ``replica``'s actors (servers, checkpoint-engine workers) runs, with its process
    tree (a vLLM server's engine core and workers are its children); what could not be asked is left out."""
    handles = [*getattr(replica, "servers", []), *getattr(replica, "workers", [])]
    calls = [handle.__ray_call__.remote(process_tree) for handle in handles]
    deadline = time.monotonic() + timeout_s
    trees = []
    for call in calls:
        try:
            trees.append(ray.get(call, timeout=max(0.1, deadline - time.monotonic())))
        except Exception as error:  # a stand-in actor, or one busy past the limit: its processes are not tracked
            logger.info("areal: the processes of replica %s were not recorded: %s", replica.replica_rank, error)
    return trees


def end_leftovers(trees: list[dict[str, Any]], timeout_s: float = END_LEFTOVERS_TIMEOUT_S) -> int:
    """End the recorded processes of a dead replica still alive on their nodes, one task per node (a lost node's
    task fails: nothing of it is left to end); how many were ended."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    by_node: dict[str, list[list[float]]] = {}
    for tree in trees:
        by_node.setdefault(tree["node"], []).extend(tree["processes"])
    task = ray.remote(num_cpus=0)(end_processes)
    calls = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(processes)
        for node, processes in by_node.items()
    ]
    ended = 0
    for call in calls:
        try:
            ended += ray.get(call, timeout=timeout_s)
        except Exception as error:
            logger.info("areal: a dead replica's leftover processes were not looked for on a node: %s", error)
    return ended


class ReplicaReplacer:
    """Starts a replacement per dropped replica; :meth:`join` and :meth:`serve` bring it in around a weight sync.

    Only the trainer's thread calls :meth:`replace`, :meth:`grow`, :meth:`join` and :meth:`serve` (they change the
    lists verl's checkpoint manager iterates); the replacements start in threads of their own. ``start_timeout_s``
    bounds each start (waiting for a node with the devices, then verl's start): ``areal.replica_start_timeout_s``,
    else :data:`START_TIMEOUT_FACTOR` times the run's measured start of its replicas (set once it is measured).
    """

    def __init__(
        self,
        lists: ReplicaLists,
        recorder: RunRecorder,
        enabled: bool,
        start_timeout_s: float | None = None,
    ) -> None:
        self.lists = lists
        self.recorder = recorder
        self.enabled = enabled
        self.start_timeout_s = start_timeout_s
        # (the dead rank it replaces or None for growth, its rank, the started replica, when it started, the replica)
        self._starting: list[tuple[int | None, int, Future, float, Any]] = []
        self._joined: list[tuple[int | None, Any]] = []  # (dead rank or None, replica) in the sync list, not serving
        self._next_rank: int | None = None
        self._processes: dict[int, list[dict[str, Any]]] = {}  # replica rank -> its actors' process trees
        self._growth_blocked: str | None = None  # why the last look could not grow (logged and recorded once)
        self.replaced = 0  # replacements serving
        self.grown = 0  # replicas added beyond the recipe's, serving
        self.clock: Callable[[], float] = time.monotonic

    def start_timeout_from(self, configured: float | None, measured_start_s: float | None) -> float | None:
        """Set :attr:`start_timeout_s` from the recipe (``areal.replica_start_timeout_s``), else from the run's
        measured start of its replicas; returns it (None: neither, the start is not bounded)."""
        if configured is not None:
            self.start_timeout_s = float(configured)
        elif measured_start_s is not None:
            self.start_timeout_s = START_TIMEOUT_FACTOR * float(measured_start_s)
        return self.start_timeout_s

    def track(self, replicas: list[Any]) -> None:
        """Record where each serving replica's processes run, so that a dead one's leftovers can be ended."""
        if not self.enabled:
            return
        for replica in replicas:
            trees = replica_processes(replica)
            if trees:
                self._processes[replica.replica_rank] = trees

    def replace(self, dead: Any) -> None:
        """End what ``dead`` left running, free its devices and start its replacement (a new replica rank: Ray's
        actor names stay unique)."""
        if not self.enabled:
            return
        ended = end_leftovers(self._processes.pop(dead.replica_rank, []))
        freed = free_devices(dead)
        rank = self._start(dead.replica_rank, extra_ranks=[dead.replica_rank])
        self._event("replacing", dead.replica_rank, replica=rank, placement_groups_freed=freed, processes_ended=ended)
        logger.warning(
            "areal: starting replica %d to replace replica %d (%d process(es) it left ended); it takes requests after "
            "the weight sync that follows its start",
            rank,
            dead.replica_rank,
            ended,
        )

    def grow(self, max_replicas: int | None) -> bool:
        """At a step's end: start one more replica if fewer than ``max_replicas`` serve or start and one node of Ray's
        has the devices for it now (a node joined). Returns whether one started."""
        if max_replicas is None:
            return False
        manager = self.lists.server_manager
        # One at a time: Ray counts a device as free until the new replica's placement group holds it.
        if self.pending or len(manager.rollout_replicas) >= max_replicas:
            return False
        config = manager.rollout_config
        per_replica = (
            config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size
        )
        per_node = min(int(config.n_gpus_per_node), per_replica)
        why = placement_shortfall(free_per_node(), per_node, max(1, per_replica // per_node))
        if why is not None:
            if self._growth_blocked is None:  # once per stretch without room, not at every step's end
                replicas = len(manager.rollout_replicas)
                self._event("growth_blocked", None, replicas=replicas, reason=why)
                logger.warning("areal: not growing beyond %d rollout replica(s) for now: %s", replicas, why)
            self._growth_blocked = why
            return False
        self._growth_blocked = None
        rank = self._start(None)
        self._event("growing", None, replica=rank, replicas=len(manager.rollout_replicas), max_replicas=max_replicas)
        logger.warning(
            "areal: a node of Ray's has the devices for another rollout replica: starting replica %d (up to %d); it "
            "takes requests after the weight sync that follows its start",
            rank,
            max_replicas,
        )
        return True

    def _start(self, dead: int | None, extra_ranks: list[int] | None = None) -> int:
        """Start a replica of the run's class in the background under a new rank; the rank."""
        manager = self.lists.server_manager
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
        timeout_s = self.start_timeout_s

        def start() -> None:
            try:
                wait_for_placement(replica.gpus_per_replica_node, replica.nnodes, timeout_s)
                asyncio.run(replica.init_standalone())
            except BaseException as error:  # not placed, failed, or its placement group removed (abandoned)
                with contextlib.suppress(InvalidStateError):
                    started.set_exception(error)
                return
            try:
                started.set_result(replica)
            except InvalidStateError:  # abandoned (join) while it started: what it started holds devices for nothing
                stop_replica(replica)

        threading.Thread(target=start, name=f"areal-start-replica-{rank}", daemon=True).start()
        self._starting.append((dead, rank, started, self.clock(), replica))
        return rank

    def join(self) -> int:
        """Before a weight sync: add each replacement that has started to the replicas the sync updates (not yet to
        the load balancer); abandon each start past its time. Returns how many joined."""
        manager, still, joined = self.lists.server_manager, [], 0
        for dead, rank, started, since, replica in self._starting:
            if not started.done():
                waited = self.clock() - since
                if self.start_timeout_s is not None and waited > self.start_timeout_s and started.cancel():
                    self._abandon(dead, rank, replica, waited)
                    continue
                still.append((dead, rank, started, since, replica))
                continue
            error = started.exception()
            if error is not None:
                self._event("start_failed", dead, replica=rank, reason=repr(error)[:400])
                logger.error(
                    "areal: rollout replica %d failed to start (%s); running with the %d replica(s) left",
                    rank,
                    error,
                    len(manager.rollout_replicas),
                )
                continue
            replica = started.result()
            self.lists.add(replica)  # the server manager's lists and the weight sync's (verl's add_replicas), together
            self._joined.append((dead, replica))
            joined += 1
        self._starting = still
        return joined

    def _abandon(self, dead: int | None, rank: int, replica: Any, waited: float) -> None:
        """A start past its time: its pending placement groups removed (verl's wait for them ends), what it started
        stopped; recorded and logged. Growth looks again at the next step's end."""
        removed = remove_pending_groups(replica)
        stop_replica(replica)
        why = (
            f"replica {rank} did not start within {self.start_timeout_s:.0f} s (areal.replica_start_timeout_s, or "
            f"{START_TIMEOUT_FACTOR:g}x the run's measured replica start)"
        )
        self._event("start_timed_out", dead, replica=rank, waited_s=round(waited, 1), reason=why,
                    placement_groups_removed=removed)  # fmt: skip
        logger.error(
            "areal: %s: abandoned, %d pending placement group(s) removed; running with the %d replica(s) left",
            why,
            removed,
            len(self.lists.replicas),
        )

    def serve(self, version: int) -> None:
        """After a weight sync to ``version`` succeeded: the replicas it brought in take requests."""
        if not self._joined:
            return
        manager = self.lists.server_manager
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
        self.track([replica for _, replica in self._joined if id(replica) in serving])
        self._joined = []
        from areal_plugins.driver.placement_report import record_ray_placement

        record_ray_placement("separate")  # where the new replicas landed (ray_actors.jsonl, appended)

    @property
    def pending(self) -> int:
        """Replacements started or joined that do not serve yet."""
        return len(self._starting) + len(self._joined)

    def _event(self, event: str, dead: int | None, **fields: Any) -> None:
        self.recorder.write("replica_events.jsonl", {"time": time.time(), "event": event, "replaces": dead, **fields})


def stop_replica(replica: Any) -> None:
    """Kill what a replica's start made (its server and workers) and remove its placement groups."""
    for handle in [*(getattr(replica, "servers", None) or []), *(getattr(replica, "workers", None) or [])]:
        try:
            ray.kill(handle, no_restart=True)
        except Exception as error:
            logger.info("areal: an actor of abandoned replica %d not killed: %s", replica.replica_rank, error)
    free_devices(replica)
