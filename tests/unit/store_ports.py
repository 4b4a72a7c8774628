"""A port for a test's process-group store that no outbound connection can take before the store binds it.

Binding port 0 draws from the kernel's ephemeral range, which every connection on the box draws from too; with the
unit tier's files running in parallel (pytest-xdist), another worker's Ray or gloo connections can take such a port
between the pick and the store's bind, seconds later where the ranks import torch first.
"""

from __future__ import annotations

from areal_plugins.platforms.ports import LOWEST_PORT, free_port_outside_ephemeral_range


def store_port() -> int:
    port = free_port_outside_ephemeral_range()
    assert port is not None, f"this box has no free port between {LOWEST_PORT} and its ephemeral range"
    return port
