"""The run's environment on a Ray cluster: what travels with the job, joining a running cluster, Ray defaults.

verl starts a local Ray instance unless one is named (``RAY_ADDRESS``, ``ray_kwargs.ray_init.address``);
joining one, the sizes a local instance takes are dropped and the variables the run's processes read go into
the job's ``runtime_env``, so workers on every node see them (docs/cluster.md).
"""

from __future__ import annotations

import logging
import os
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


def declared_cluster_address(env: dict[str, str], overrides: list[str]) -> str | None:
    """The Ray cluster named for this run (``ray_kwargs.ray_init.address``, else ``RAY_ADDRESS``), if any."""
    value = override_value(overrides, "ray_kwargs.ray_init.address")
    if value not in (None, "", "null", "None", "local"):
        return value
    address = env.get("RAY_ADDRESS", "").strip()
    return address if address and address != "local" else None


def cluster_address(env: dict[str, str], overrides: list[str]) -> str | None:
    """The running Ray cluster this run joins: the one named (:func:`declared_cluster_address`), else one ``ray
    start`` left running on this machine (unless ``RAY_ADDRESS=local``), if any."""
    declared = declared_cluster_address(env, overrides)
    if declared is not None or env.get("RAY_ADDRESS", "").strip() == "local":
        return declared
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


# ---------------------------------------------------------------- who can reach the cluster

#: Ray's switch for token authentication (``RAY_AUTH_MODE=token``; Ray 2.60 turns it on by itself only for a local
#: cluster ``ray.init()`` starts, not for one ``ray start`` makes). Its token: ``RAY_AUTH_TOKEN``,
#: ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``.
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_ENV_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
#: Asks the GCS at ``argv[1]`` for its keys as a client with no token; prints OPEN, TOKEN (it refused) or UNREACHABLE.
_PROBE = """
import sys
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", None, timeout=float(sys.argv[2]))
    print("OPEN")
except AuthenticationError:
    print("TOKEN")
except Exception as error:
    print("UNREACHABLE", type(error).__name__)
"""
#: Seconds the probe of a cluster's GCS may take: it starts a Python that imports Ray (~1 s here); a GCS that does not
#: answer (a wrong address) costs all of it.
PROBE_TIMEOUT_S = 10.0


def gcs_address(address: str) -> str | None:
    """The GCS ``host:port`` of a cluster address (``auto``: the one ``ray start`` left on this machine); None for
    a Ray Client address (``ray://``), which reaches the cluster through its own server."""
    if address.startswith("ray://"):
        return None
    if address == "auto":
        from ray._private import utils

        return utils.read_ray_address()
    return address


def accepts_without_token(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the cluster at ``address`` answers a client that sends no token (in a process of its own, with
    ``RAY_AUTH_MODE=disabled`` and none of this shell's token settings): True, anyone who reaches its GCS can run
    code on every node; False, it refused (token authentication is on); None, not asked or not reached."""
    import subprocess
    import sys

    gcs = gcs_address(address)
    if not gcs:
        return None
    env = {k: v for k, v in os.environ.items() if k not in AUTH_ENV_VARS}
    env[AUTH_MODE_ENV] = "disabled"
    try:
        answer = subprocess.run(
            [sys.executable, "-c", _PROBE, gcs, str(timeout_s / 2)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        ).stdout.split()
    except subprocess.TimeoutExpired:
        return None
    verdict = answer[-1] if answer and answer[-1] in ("OPEN", "TOKEN") else (answer[0] if answer else "")
    return {"OPEN": True, "TOKEN": False}.get(verdict)


def auth_warning(address: str, open_to_anyone: bool | None, env: dict[str, str]) -> str | None:
    """What ``areal-plugins check`` warns about the cluster at ``address``: reached without a token, or this shell
    set up to join it without one; None when it asks for a token and this shell has one set."""
    fix = (
        f"start every node with {AUTH_MODE_ENV}=token (`{AUTH_MODE_ENV}=token ray start ...`, the same token on "
        "every node: ~/.ray/auth_token or RAY_AUTH_TOKEN) and set it here too; docs/cluster.md, Who can reach the "
        "cluster"
    )
    if open_to_anyone:
        return (
            f"the Ray cluster at {address} accepts a client that sends no token: anyone who can reach its GCS port "
            f"can run code on every node of it; {fix}"
        )
    if open_to_anyone is False and env.get(AUTH_MODE_ENV, "").lower() != "token":
        return (
            f"the Ray cluster at {address} asks for a token, and this shell does not set {AUTH_MODE_ENV}=token: the "
            f"run would be refused when it joins; set {AUTH_MODE_ENV}=token (and the cluster's token) here"
        )
    return None
