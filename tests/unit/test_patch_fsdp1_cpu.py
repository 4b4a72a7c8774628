"""The four patch tests of STYLE.md for ``fsdp1_cpu``, against a real gloo process group on the CPU platform (tests/
conftest.py): torch's FSDP1 as verl builds it (``sync_module_states=True``) refuses a CPU module unpatched and, patched,
wraps it with rank 0's weights broadcast (a one-rank group: the weights stay as they were) and trains it; verl's
staging of FSDP1's flat parameters, patched, leaves them on the CPU."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from areal_plugins.patches import fsdp1_cpu

from areal_plugins._compat import UnsupportedVerlVersionError
from tests.unit.store_ports import store_port


@pytest.fixture
def gloo_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def unpatched():
    """Start from torch as shipped; leave the patch as the session had it."""
    was_applied = fsdp1_cpu.is_applied()
    fsdp1_cpu.revert()
    yield
    fsdp1_cpu.revert()
    if was_applied:
        fsdp1_cpu.apply()


def _targets():
    return [getattr(importlib.import_module(m), a) for m, a in fsdp1_cpu.TARGETS]


def _fsdp1(module: torch.nn.Module):
    """FSDP1 with the arguments of verl's ``_build_fsdp_module`` that matter here (sync on, the CPU as device)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(
        module, sync_module_states=True, device_id=torch.device("cpu"), use_orig_params=False
    )


def test_unpatched_torch_refuses_verls_fsdp1_on_cpu(unpatched, gloo_group):
    with pytest.raises(ValueError, match="CPU parameters or buffers when `sync_module_states=True`"):
        _fsdp1(torch.nn.Linear(4, 2))


def test_applied_wraps_and_trains_a_cpu_module_over_gloo(unpatched, gloo_group):
    fsdp1_cpu.apply()
    assert fsdp1_cpu.is_applied()
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 2)
    weights = {name: value.clone() for name, value in plain.state_dict().items()}
    wrapped = _fsdp1(plain)
    with wrapped.summon_full_params(wrapped):
        assert all(torch.equal(wrapped.state_dict()[name], value) for name, value in weights.items())
    loss = wrapped(torch.ones(3, 4)).sum()
    loss.backward()
    torch.optim.SGD(wrapped.parameters(), lr=0.1).step()
    with wrapped.summon_full_params(wrapped):
        # d(sum of outputs)/d(bias) = 3 per output (3 rows): the bias moved by exactly lr x 3.
        assert torch.allclose(wrapped.state_dict()["bias"], weights["bias"] - 0.3)


def test_applied_verls_staging_of_fsdp1_leaves_it_on_the_cpu(unpatched, gloo_group):
    """Unpatched, verl's staging builds the device ``"cpu:cpu"`` here (``get_device_name()``, ``get_device_id()`` of
    the CPU platform): the first observed run on FSDP1 stopped on it ("Invalid device string: 'cpu:cpu'")."""
    import verl.utils.fsdp_utils as fsdp_utils

    fsdp1_cpu.apply()
    wrapped = _fsdp1(torch.nn.Linear(4, 2))
    fsdp_utils.load_fsdp_model_to_gpu(wrapped)  # patched: nothing moves
    assert all(p.device == torch.device("cpu") for p in wrapped.parameters())
    fsdp_utils.offload_fsdp_model_to_cpu(wrapped)  # verl's round trip around the weight export
    fsdp_utils.load_fsdp_model_to_gpu(wrapped)
    assert wrapped(torch.ones(1, 4)).shape == (1, 2)


def test_an_fsdp2_module_still_goes_to_verls_staging(unpatched, monkeypatch):
    import verl.utils.fsdp_utils as fsdp_utils

    fsdp1_cpu.apply()
    moved = []
    monkeypatch.setattr(fsdp_utils, "load_fsdp2_model_to_gpu", moved.append)
    module = torch.nn.Linear(4, 2)  # fsdp_version 0: verl's FSDP2 branch
    fsdp_utils.load_fsdp_model_to_gpu(module)
    assert moved == [module]


def test_without_gloo_torchs_check_still_refuses(unpatched):
    fsdp1_cpu.apply()
    check = _targets()[0]
    with pytest.raises(ValueError, match="CPU parameters or buffers"):
        check([torch.zeros(1)])  # no process group: the original check decides


def test_apply_is_idempotent(unpatched):
    originals = _targets()
    fsdp1_cpu.apply()
    first = _targets()
    fsdp1_cpu.apply()
    assert _targets() == first
    fsdp1_cpu.revert()
    assert all(now is orig for now, orig in zip(_targets(), originals, strict=True))


def test_revert_restores_the_same_objects(unpatched):
    originals = _targets()
    fsdp1_cpu.apply()
    assert all(now is not orig for now, orig in zip(_targets(), originals, strict=True))
    fsdp1_cpu.revert()
    assert not fsdp1_cpu.is_applied()
    assert all(now is orig for now, orig in zip(_targets(), originals, strict=True))


def test_refused_on_unsupported_verl(unpatched):
    originals = _targets()
    with pytest.raises(UnsupportedVerlVersionError, match=r"verl 0\.8\.5 is installed"):
        fsdp1_cpu.apply(verl_version="0.8.5")
    assert not fsdp1_cpu.is_applied()
    assert all(now is orig for now, orig in zip(_targets(), originals, strict=True))
