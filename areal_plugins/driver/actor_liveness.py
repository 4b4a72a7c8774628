"""Stop the run when any Ray actor it depends on dies, naming it, instead of waiting on its work forever.

verl's agent-loop and reward-loop workers, TransferQueue's controller and storage, the request load
balancer and the rollout servers are actors of this Ray job; when one dies mid-run its requests are never
answered and nothing raises where the trainer waits (measured: a killed agent-loop worker left the run
silent until the watchdog). Every few seconds (from the trainer's batch wait, and from the stall guard
while the trainer is away from it) Ray's state API says whether an actor seen alive has died since.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: What Ray's state API reads before any address it is given (ray.dashboard.utils.get_address_for_submission_client).
API_SERVER_VARIABLE = "RAY_API_SERVER_ADDRESS"

CHECK_INTERVAL_S = 5.0
#: Deaths the program asked for (an actor handle dropped, ``ray.kill``) are not faults.
DELIBERATE_DEATHS = ("OUT_OF_SCOPE", "RAY_KILL")


#: What each actor class is to the run, for the error a user reads (the class name alone says little).
ROLES = (
    ("RolloutServer", "rollout server"),
    ("HttpServer", "rollout server"),
    ("AgentLoopWorker", "agent-loop worker"),
    ("RewardLoopWorker", "reward-loop worker"),
    ("RequestLoadBalancer", "request load balancer"),
    ("TransferQueueController", "TransferQueue controller"),
    ("StorageUnit", "TransferQueue storage unit"),
    ("WorkerDict", "trainer worker"),
    ("TaskRunner", "driver actor"),
)


def describe_actor(class_name: str, pid: Any, node_id: Any) -> str:
    """``the rollout server CPURolloutServer (pid 7, node 1a2b3c4d)``: role, class and where it ran."""
    short = class_name.rsplit(".", 1)[-1]  # verl's fused workers: create_colocated_worker_cls.<locals>.WorkerDict
    role = next((role for marker, role in ROLES if marker in short), "actor")
    return f"the {role} {short} (pid {pid}, node {str(node_id)[:8]})"


class RunActorDiedError(RuntimeError):
    """An actor of the run died; the run cannot continue without it."""


def _death_reason(actor: Any) -> tuple[str, str]:
    context = (actor.death_cause or {}).get("actor_died_error_context") or {}
    lines = str(context.get("error_message", "")).splitlines()
    return str(context.get("reason", "UNKNOWN")), lines[0] if lines else ""


def list_job_actors(*filters: tuple[str, str, str], **options: Any) -> list[Any]:
    """The actors of this Ray job with their details (Ray's state API), narrowed by further ``filters``."""
    import ray
    from ray.util.state import list_actors

    context = ray.get_runtime_context()
    _pin_state_api_to(context.gcs_address)
    return list_actors(filters=[("job_id", "=", context.get_job_id()), *filters], detail=True, limit=10_000, **options)


def _pin_state_api_to(gcs_address: str) -> None:
    """Point Ray's state API in this process at this job's cluster. Given no address, or ``RAY_ADDRESS=local``
    (which overrides any address it is given), it guesses, and refuses when another Ray instance runs on the same
    machine ("Found multiple active Ray instances"); ``RAY_API_SERVER_ADDRESS`` is the one setting it reads first."""
    global _pinned_for
    if os.environ.get(API_SERVER_VARIABLE) and _pinned_for in (None, gcs_address):
        return  # the user's own setting, or ours for this cluster
    from ray.dashboard.utils import ray_address_to_api_server_url

    os.environ[API_SERVER_VARIABLE] = ray_address_to_api_server_url(gcs_address)  # the cluster's dashboard, by GCS
    _pinned_for = gcs_address


#: The GCS address this process pinned the state API to (another cluster joined later is pinned again).
_pinned_for: str | None = None


def _list_job_actors() -> list[Any]:
    return list_job_actors(raise_on_missing_output=False)


class ActorLiveness:
    """Watches every actor of the job it has seen alive; a look raises (or reports) if one has died."""

    def __init__(
        self,
        list_actors: Callable[[], list[Any]] = _list_job_actors,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        survivable: Callable[[str], bool] = lambda actor_id: False,
    ) -> None:
        self.list_actors = list_actors
        self.survivable = survivable  # a death the run survives (a rollout replica of several: replica_pool.py)
        self.interval_s = interval_s
        self.clock = clock
        self.watched: dict[str, str] = {}  # actor id -> what to call it
        self.unavailable: str | None = None
        self._last = -float("inf")
        self._lock = threading.Lock()  # the trainer's wait and the stall guard's thread both look

    def explain(self, settle_s: float = 30.0, sleep=time.sleep) -> None:  # type: ignore[no-untyped-def]
        """Another error stopped the run: name a dead actor behind it if there is one. Ray reports a death
        to the caller before its state API marks the actor dead (tens of seconds on a loaded machine), so
        look for up to ``settle_s``."""
        deadline = self.clock() + settle_s
        while True:
            self.check(force=True)
            if self.clock() >= deadline or self.unavailable is not None:
                return
            sleep(1.0)

    def check(self, force: bool = False) -> None:
        """Raise :class:`RunActorDiedError` if a watched actor died; ``force`` looks now, not on schedule."""
        death = self.dead_actor(force)
        if death is not None:
            raise RunActorDiedError(death)

    def dead_actor(self, force: bool = False) -> str | None:
        """The report on a watched actor that died, or None (also between looks and without a state API)."""
        with self._lock:
            now = self.clock()
            if self.unavailable is not None or (now - self._last < self.interval_s and not force):
                return None
            self._last = now
            try:
                actors = self.list_actors()
            except Exception as error:  # no dashboard (ray.init(include_dashboard=False)): the watchdog remains
                self.unavailable = f"{type(error).__name__}: {error}"
                logger.warning(
                    "areal: Ray's state API is unavailable (%s); dead actors are left to the watchdog", error
                )
                return None
            # Every actor seen alive is watched from then on: verl creates some (the agent-loop workers)
            # after training began.
            self.watched.update(
                (a.actor_id, describe_actor(a.class_name, a.pid, a.node_id)) for a in actors if a.state == "ALIVE"
            )
            for actor in actors:
                if actor.actor_id not in self.watched or actor.state != "DEAD":
                    continue
                reason, message = _death_reason(actor)
                if reason in DELIBERATE_DEATHS or self.survivable(actor.actor_id):
                    continue
                return (
                    f"areal: {self.watched[actor.actor_id]} died ({reason}{': ' + message if message else ''}); "
                    "the run cannot continue without it and verl does not restart it. Stopping; resume from the last "
                    "checkpoint (trainer.resume_mode=auto) once the cause (memory? a kill? a lost node?) is fixed"
                )
            return None
