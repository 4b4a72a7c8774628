"""The four patch tests of STYLE.md for ``master_port``: verl's port choice, run as a plain function (no Ray)."""

from __future__ import annotations

import importlib
import socket

import pytest
from areal_plugins.patches import master_port

from areal_plugins._compat import UnsupportedVerlVersionError


@pytest.fixture
def unpatched():
    """Start from verl as shipped; leave the patch as the session had it."""
    importlib.import_module(master_port.MODULE)  # importing verl loads our plugin, which applies the CPU patches
    was_applied = master_port.is_applied()
    master_port.revert()
    yield
    master_port.revert()
    if was_applied:
        master_port.apply()


def _target():
    return importlib.import_module(master_port.MODULE).get_master_addr_port


def _port_chosen() -> int:
    return int(_target()._function(None)[1])  # the function behind the Ray task, called here


def test_unpatched_verl_hands_out_an_ephemeral_port(unpatched):
    low, high = master_port.ephemeral_range()
    assert low <= _port_chosen() <= high  # the range outbound connections draw from: the race


def test_applied_hands_out_a_free_port_below_the_ephemeral_range_and_keeps_a_given_range(unpatched):
    master_port.apply()
    low, _ = master_port.ephemeral_range()
    ports = {_port_chosen() for _ in range(20)}
    assert all(master_port.LOWEST_PORT <= port < low for port in ports), ports
    with socket.socket() as taken:  # a port someone holds is never handed out
        taken.bind(("", 0))
        busy = taken.getsockname()[1]
        assert master_port.port_outside_ephemeral_range(busy, busy + 1, tries=5) is None
    assert master_port.port_outside_ephemeral_range(20000, 15000) is None  # a node whose ephemeral range is low
    # A range of the caller's own: verl's choice (the first free port in it).
    with socket.socket() as probe:
        probe.bind(("", 0))
        free = probe.getsockname()[1]
    assert int(_target()._function([free, free + 1])[1]) == free


def test_apply_is_idempotent(unpatched):
    original = _target()
    master_port.apply()
    first = _target()
    master_port.apply()
    assert _target() is first
    master_port.revert()
    assert _target() is original


def test_revert_restores_the_same_object(unpatched):
    original = _target()
    master_port.apply()
    assert _target() is not original
    master_port.revert()
    assert not master_port.is_applied()
    assert _target() is original


def test_refused_on_unsupported_verl(unpatched):
    original = _target()
    with pytest.raises(UnsupportedVerlVersionError, match=r"verl 0\.8\.5 is installed"):
        master_port.apply(verl_version="0.8.5")
    assert not master_port.is_applied()
    assert _target() is original
