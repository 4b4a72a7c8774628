from __future__ import annotations

import torch


def test_plugin_loaded_by_verl_entry_point():
    import subprocess
    import sys

    # A fresh process that imports verl and nothing of ours: verl's entry point must load the plugin.
    probe = (
        "import sys, verl; plugin = sys.modules.get('areal_plugins.verl_plugin'); "
        "print('loaded' if plugin is not None and plugin.LOADED else 'missing')"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "loaded", result.stderr[-2000:]


def test_cpu_platform_selected_and_complete():
    from verl.plugin.platform import get_platform
    from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device

    platform = get_platform()
    assert platform.device_name == get_device_name() == "cpu"
    assert get_nccl_backend() == "gloo"
    device = get_torch_device()
    # torch.device accepts what current_device() returns: verl moves tensors with it.
    assert torch.zeros(1).to(device.current_device()).device.type == "cpu"
    assert device.get_device_name() == "CPU"
    free, total = device.mem_get_info()
    assert 0 < free <= total


def test_rollout_backend_registered_in_both_registries():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    assert get_rollout_class("areal_cpu", "async").__name__ == "ArealServerAdapter"
    assert get_rollout_replica_class("areal_cpu").__name__ == "ArealRolloutReplica"


def test_each_backend_declares_its_server_and_capabilities(monkeypatch):
    import sys
    from types import ModuleType, SimpleNamespace

    import pytest

    from areal_plugins.rollout import verl_registration
    from areal_plugins.rollout.verl_registration import check_capabilities, server_class

    assert server_class("areal_cpu").__name__ == "CPURolloutServer"
    with pytest.raises(ValueError, match="unknown areal rollout backend 'vllm'"):
        server_class("vllm")
    check_capabilities(SimpleNamespace(name="areal_cpu", free_cache_engine=True))
    # A backend whose server keeps its memory while asleep is refused free_cache_engine before any server starts.
    module = ModuleType("sleepless_backend")
    module.SleeplessServer = type("SleeplessServer", (server_class("areal_cpu"),), {"releases_memory_on_sleep": False})
    monkeypatch.setitem(sys.modules, "sleepless_backend", module)
    monkeypatch.setitem(verl_registration.BACKENDS, "sleepless", "sleepless_backend:SleeplessServer")
    check_capabilities(SimpleNamespace(name="sleepless", free_cache_engine=False))
    with pytest.raises(ValueError, match=r"set actor_rollout_ref\.rollout\.free_cache_engine=false"):
        check_capabilities(SimpleNamespace(name="sleepless", free_cache_engine=True))


def test_checkpoint_rng_state_round_trips_on_the_cpu_platform():
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    state = BaseCheckpointManager.get_rng_state()
    expected = torch.rand(3)
    BaseCheckpointManager.load_rng_state(state)  # verl restores "the device RNG" too: the CPU one here
    assert torch.equal(torch.rand(3), expected)


def test_fsdp_engine_found_for_cpu():
    from verl.workers.engine import EngineRegistry

    assert EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__.startswith("FSDP")


def test_hooked_trainer_modes_wrap_verls_own():
    from verl.trainer.ppo.v1 import PPOTrainer, PPOTrainerSync, get_trainer_cls

    from areal_plugins.driver.hooked import HookedTrainerMixin

    assert issubclass(get_trainer_cls("areal_sync"), PPOTrainerSync)
    assert issubclass(get_trainer_cls("areal_sync"), HookedTrainerMixin)
    assert issubclass(get_trainer_cls("areal_async"), PPOTrainer)
    assert issubclass(get_trainer_cls("areal_async"), HookedTrainerMixin)
