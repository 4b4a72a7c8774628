"""Ports for a process group's store, chosen outside the kernel's ephemeral range.

Binding port 0 draws from the ephemeral range, the same range every outbound connection on the node draws from
(Ray's own connections included). A port picked that way and bound again seconds later by another process can be
taken in between, and the store fails with ``EADDRINUSE`` (seen in CI on two busy cores, for verl's trainer port
and for areal_gloo's group, which is built again at every weight update). A port below the ephemeral range is
never handed out to a connection.

The CPU platform's process groups take their ports here: verl's trainer group (patches/master_port.py) and
``areal_gloo``'s weight-sync store (weight_sync/gloo.py), which run on machines without GPUs.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Above Ray's default worker ports (10002-19999).
LOWEST_PORT = 20000
TRIES = 200


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The node's ephemeral port range (Linux's default when it cannot be read)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def port_outside_ephemeral_range(low: int, high: int, tries: int = TRIES) -> int | None:
    """A port in ``[low, high)`` that binds now, or None after ``tries`` random attempts (or for an empty range:
    a node whose ephemeral range starts at or below ``low``)."""
    if high <= low:
        return None
    for _ in range(tries):
        port = random.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    return None


def free_port_outside_ephemeral_range() -> int | None:
    """A port that binds now, between :data:`LOWEST_PORT` and the node's ephemeral range (None if there is none)."""
    return port_outside_ephemeral_range(LOWEST_PORT, ephemeral_range()[0])
