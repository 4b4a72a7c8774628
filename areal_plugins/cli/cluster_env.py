"""The run's environment on a Ray cluster: what travels with the job, joining a running cluster, Ray defaults.

verl starts a local Ray instance unless one is named (``RAY_ADDRESS``, ``ray_kwargs.ray_init.address``);
joining one, the sizes a local instance takes are dropped and the variables the run's processes read go into
the job's ``runtime_env``, so workers on every node see them (docs/cluster.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger("areal_plugins.cli")

#: Ray's GCS keeps an event record (~3.6 KB measured) for each of the last N tasks, N = 100,000 by default
#: (~360 MB). A run makes ~250 actor calls per step, so the GCS grew ~300 MB/h for hours in our soak; 10,000
#: keeps the recent tasks for the dashboard and caps the GCS's share at ~40 MB. A value already set wins.
RAY_ENV_DEFAULTS = {"RAY_task_events_max_num_task_in_gcs": "10000"}


#: What processes of the run read from their environment. They travel in the Ray job's ``runtime_env``, so
#: workers on every node of an existing cluster see them, not only processes started from this shell.
JOB_ENV_VARS = (
    "AREAL_RUN_DIR",
    "AREAL_TINY_DIR",
    "AREAL_DATA_DIR",  # the GPU recipes' data folder, resolved in verl's TaskRunner actor (on any node)
    "VERL_PLATFORM",
    "VERL_FILE_LOGGER_PATH",
)


#: ``ray.init`` refuses these when it joins a running cluster: they size a cluster Ray would start.
LOCAL_CLUSTER_SIZES = ("num_cpus", "num_gpus", "object_store_memory")


def job_env_overrides(env: dict[str, str]) -> list[str]:
    """Hydra overrides that put ``JOB_ENV_VARS`` into the job's runtime environment (verl merges it)."""
    overrides = []
    for name in JOB_ENV_VARS:
        value = env.get(name)
        if value:
            if "'" in value:
                raise SystemExit(f"{name}={value!r}: a quote in this path cannot be passed to the Ray job; rename it")
            overrides.append(f"++ray_kwargs.ray_init.runtime_env.env_vars.{name}='{value}'")
    return overrides


def override_value(overrides: list[str], key: str) -> str | None:
    """The value a Hydra override on the command line gives ``key`` (``key=v``, ``+key=v``, ``++key=v``), if any."""
    for override in overrides:
        name, _, value = override.lstrip("+").partition("=")
        if name == key:
            return value
    return None


def cluster_address(env: dict[str, str], overrides: list[str]) -> str | None:
    """The running Ray cluster this run joins (``ray_kwargs.ray_init.address`` or ``RAY_ADDRESS``), if any."""
    value = override_value(overrides, "ray_kwargs.ray_init.address")
    if value not in (None, "", "null", "None", "local"):
        return value
    address = env.get("RAY_ADDRESS", "").strip()
    if address:
        return address if address != "local" else None
    return running_local_cluster()


def running_local_cluster() -> str | None:
    """The cluster ``ray start`` left running on this machine, which ``ray.init()`` joins unasked."""
    from ray._private import services, utils

    address = utils.read_ray_address()
    return address if address and services.find_gcs_addresses() else None


def join_cluster_overrides(address: str | None, ray_init_keys: Iterable[str] = LOCAL_CLUSTER_SIZES) -> list[str]:
    """Joining ``address``: the recipe's local-cluster sizes are dropped (ray.init would refuse them).

    Only the sizes the composed ``ray_kwargs.ray_init`` has: verl's own node has none of them, so nulling one the
    recipe did not add would be refused by Hydra as an unknown key.
    """
    present = [key for key in LOCAL_CLUSTER_SIZES if key in set(ray_init_keys)]
    if address is None or not present:
        return []
    logger.info(
        "joining the Ray cluster at %s: the recipe's ray_kwargs.ray_init.{%s} size a cluster Ray would start "
        "and are dropped; the cluster's own resources apply",
        address,
        ",".join(present),
    )
    return [f"ray_kwargs.ray_init.{key}=null" for key in present]


def with_ray_defaults(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus our Ray defaults where it does not set them (they reach the Ray head verl starts)."""
    return {**RAY_ENV_DEFAULTS, **env}


def has_accelerator() -> bool:
    import torch

    return bool(torch.cuda.is_available())
