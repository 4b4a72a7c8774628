"""Run one small task on every alive node of a Ray cluster the CLI joins (cleanup after a run, storage checks before).

The CLI's own process joins the cluster for the call and leaves it after (``ray.shutdown``) unless Ray was already
initialised here. A node whose task does not answer in time is reported with the error, never waited on for ever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeAnswer:
    """One node's answer: its id and address (as ``ray.nodes()`` names them), and the task's result or error."""

    node_id: str
    address: str
    result: Any = None
    error: str | None = None

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


def alive_nodes(nodes: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(node id, address) of every node Ray reports alive, head and CPU-only nodes included."""
    return [
        (str(node["NodeID"]), str(node.get("NodeManagerAddress", "?")))
        for node in nodes
        if node.get("Alive") and node.get("NodeID")
    ]


def on_every_node(address: str, function: Callable[..., Any], *args: Any, timeout_s: float) -> list[NodeAnswer]:
    """``function(*args)`` once on every alive node of the cluster at ``address``, all within ``timeout_s``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    joined = not ray.is_initialized()
    if joined:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        task = ray.remote(num_cpus=0, max_retries=0)(function)
        calls = [
            (
                node,
                where,
                task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args),
            )
            for node, where in alive_nodes(ray.nodes())
        ]
        deadline = time.monotonic() + timeout_s
        answers = []
        for node, where, call in calls:
            try:
                answers.append(NodeAnswer(node, where, ray.get(call, timeout=max(0.1, deadline - time.monotonic()))))
            except Exception as error:  # the node went meanwhile, or is too busy to answer in time
                answers.append(NodeAnswer(node, where, error=f"{type(error).__name__}: {error}"))
        return answers
    finally:
        if joined:
            ray.shutdown()
