"""Where Ray put the run's actors: ``ray_actors.jsonl`` (class, name, node, placement group, resources).

Written once after verl built its resource pools, so the placement a run really had can be checked
afterwards (tests, a user comparing with the recipe): in ``separate`` the trainer's workers and the
rollout pool's workers hold different placement groups; in ``colocated`` they are the same workers.
"""

from __future__ import annotations

import logging
from typing import Any

from areal_plugins.records.writer import append_record

logger = logging.getLogger(__name__)


def record_ray_placement(placement: str) -> int:
    """Append one line per live actor of this Ray job to ``ray_actors.jsonl``; how many were recorded."""
    from areal_plugins.driver.actor_liveness import list_job_actors
    from areal_plugins.records.writer import run_dir

    if run_dir() is None:  # nowhere to write: no state-API query at start-up for nothing
        return 0
    actors = list_job_actors(("state", "=", "ALIVE"))
    for actor in actors:
        record: dict[str, Any] = {
            "placement": placement,
            "job_id": actor.job_id,
            "class_name": actor.class_name,
            "name": actor.name,
            "node_id": actor.node_id,
            "placement_group_id": actor.placement_group_id,
            "required_resources": dict(actor.required_resources or {}),
            "pid": actor.pid,
        }
        append_record("ray_actors.jsonl", record)
    logger.info("areal_async: recorded the placement of %d Ray actors (ray_actors.jsonl)", len(actors))
    return len(actors)
