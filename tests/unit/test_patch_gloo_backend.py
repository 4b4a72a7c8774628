"""The four patch tests of STYLE.md for ``gloo_backend``, against a real gloo process group."""

from __future__ import annotations

import importlib

import pytest
import torch.distributed as dist
from areal_plugins.patches import gloo_backend

from areal_plugins._compat import UnsupportedVerlVersionError
from tests.unit.store_ports import store_port


@pytest.fixture
def single_process_env(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def unpatched():
    """Start from verl as shipped; leave the patch as the session had it."""
    was_applied = gloo_backend.is_applied()
    gloo_backend.revert()
    yield
    gloo_backend.revert()
    if was_applied:
        gloo_backend.apply()


def _targets():
    return [getattr(importlib.import_module(m), a) for m, a in gloo_backend.TARGETS]


def test_unpatched_verl_fails_on_cpu(unpatched, single_process_env):
    import verl.utils.distributed as distributed

    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        distributed.initialize_global_process_group_ray()


def test_applied_initialises_gloo(unpatched, single_process_env):
    gloo_backend.apply()
    assert gloo_backend.is_applied()
    import verl.workers.engine_workers as engine_workers

    engine_workers.initialize_global_process_group_ray(timeout_second=None)
    assert dist.get_backend() == "gloo"


def test_apply_is_idempotent(unpatched):
    originals = _targets()
    gloo_backend.apply()
    first = _targets()
    gloo_backend.apply()
    assert _targets() == first
    gloo_backend.revert()
    assert all(now is orig for now, orig in zip(_targets(), originals, strict=True))


def test_revert_restores_the_same_objects(unpatched):
    originals = _targets()
    gloo_backend.apply()
    assert all(now is not orig for now, orig in zip(_targets(), originals, strict=True))
    gloo_backend.revert()
    assert not gloo_backend.is_applied()
    assert all(now is orig for now, orig in zip(_targets(), originals, strict=True))


def test_refused_on_unsupported_verl(unpatched):
    originals = _targets()
    with pytest.raises(UnsupportedVerlVersionError, match=r"verl 0\.8\.5 is installed"):
        gloo_backend.apply(verl_version="0.8.5")
    assert not gloo_backend.is_applied()
    assert all(now is orig for now, orig in zip(_targets(), originals, strict=True))
