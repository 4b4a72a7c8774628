"""Records from every node reach the run directory: a Ray actor on the driver's machine writes them.

On one machine every process appends to the run directory itself. On a cluster the run directory exists
on the machine where ``areal-plugins train`` runs (the Ray driver's); a rollout server or trainer worker
on another node would write to a path that is not there. So the trainer starts :class:`RecordSink` on a
node of the driver's machine, and a process on any other node sends its lines to it
(:func:`remote_sink`). Lines from one process arrive in the order it sent them (Ray keeps the order of
one caller's calls to an actor). ``record_sources.jsonl`` says which node first sent lines of which file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SINK_NAME = "areal_run_records"
SOURCES_FILE = "record_sources.jsonl"
#: How often a process that found no sink looks again (processes may start before the trainer makes it).
LOOKUP_INTERVAL_S = 5.0


def append_line(path: Path, line: str) -> None:
    """One ``write()`` of the whole line with O_APPEND: lines of several processes never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class RecordSink:
    """Appends the lines other nodes send to the run directory (a Ray actor on the driver's machine)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sources: set[tuple[str, str]] = set()

    def node_id(self) -> str:
        return this_node()

    def append(self, name: str, line: str, node: str) -> None:
        if (name, node) not in self.sources:
            self.sources.add((name, node))
            source = {"file": name, "node": node, "time": time.time()}
            append_line(self.directory / SOURCES_FILE, json.dumps(source) + "\n")
        append_line(self.directory / name, line)

    def exists(self, name: str) -> bool:
        return (self.directory / name).exists()


def driver_ip() -> str | None:
    """The IP address of this Ray job's driver (the machine ``areal-plugins train`` runs on)."""
    import ray
    from ray._private import state

    job = ray.get_runtime_context().get_job_id()
    for info in state.jobs():
        if info.get("JobID") == job:
            return str(info.get("DriverIPAddress") or "") or None
    return None


def start_record_sink(directory: Path) -> Any:
    """Start (or find) the run's sink on a node of the driver's machine; its handle."""
    import ray

    ip = driver_ip()
    # Every node has a resource "node:<its ip>": a sliver of it places the sink on the driver's machine.
    options: dict[str, Any] = {"name": SINK_NAME, "get_if_exists": True, "num_cpus": 0}
    if ip:
        options["resources"] = {f"node:{ip}": 0.001}
    sink: Any = ray.remote(RecordSink).options(**options).remote(str(directory))
    node = str(ray.get(sink.node_id.remote()))
    here = this_node()
    if node != here:
        logger.warning(
            "areal: verl's trainer (TaskRunner) runs on node %s, not on the driver's machine (%s): the run's "
            "records reach the run directory through the sink, but verl writes its metrics file and checkpoints "
            "from the TaskRunner's node — trainer.default_local_dir must be shared storage",
            here[:8],
            ip,
        )
    _cache.update(handle=sink, remote=node != here, looked=time.monotonic())
    return sink


_cache: dict[str, Any] = {"handle": None, "remote": False, "looked": -float("inf")}


def this_node() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def remote_sink() -> Any | None:
    """The sink to send this process's records to, or None to write them locally (same node, no cluster)."""
    if _cache["handle"] is not None:
        return _cache["handle"] if _cache["remote"] else None
    if time.monotonic() - _cache["looked"] < LOOKUP_INTERVAL_S:
        return None
    _cache["looked"] = time.monotonic()
    try:
        import ray

        if not ray.is_initialized():
            return None
        sink = ray.get_actor(SINK_NAME)
    except Exception:  # not in a Ray job, or the trainer has not started it (yet): write locally
        return None
    node = str(ray.get(sink.node_id.remote()))
    _cache.update(handle=sink, remote=node != this_node())
    return sink if _cache["remote"] else None
