"""The rollout-backend contract: what areal_async needs, refused at startup when a backend lacks it."""

from __future__ import annotations

import pytest

from areal_plugins.config.settings import ArealConfigError
from areal_plugins.rollout.capabilities import CAPABILITIES, check_backend_capabilities
from tests.unit.test_recipes import compose


@pytest.fixture(autouse=True)
def tiny_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_TINY_DIR", str(tmp_path))


def test_every_capability_is_kept_by_abstract_methods_of_the_server_contract():
    """A server class that declares a capability cannot be instantiated without the methods that keep it."""
    from areal_plugins.rollout.base import RolloutServer
    from areal_plugins.rollout.capabilities import CONTRACT_METHODS

    assert set(CONTRACT_METHODS) == set(CAPABILITIES) == set(RolloutServer.capabilities)
    for capability, methods in CONTRACT_METHODS.items():
        for method in methods:
            assert method in RolloutServer.__abstractmethods__, f"{capability}: {method} is not abstract"


def test_a_backend_that_narrows_its_capabilities_is_refused_naming_what_it_dropped(monkeypatch):
    import sys
    import types

    from areal_plugins.rollout import verl_registration
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    class NoChecksumServer(CPURolloutServer):
        capabilities = CPURolloutServer.capabilities - {"weight_checksum"}

    module = types.ModuleType("no_checksum_backend")
    module.NoChecksumServer = NoChecksumServer
    monkeypatch.setitem(sys.modules, "no_checksum_backend", module)
    monkeypatch.setitem(verl_registration.BACKENDS, "no_checksum", "no_checksum_backend:NoChecksumServer")
    with pytest.raises(ArealConfigError) as refused:
        check_backend_capabilities("no_checksum")
    assert "- weight_checksum:" in str(refused.value) and "progress_stats" not in str(refused.value)
    assert check_backend_capabilities("no_checksum", ["weight_checksum"]) == ["weight_checksum"]
    assert check_backend_capabilities("areal_cpu") == []


def test_verls_vllm_has_everything_through_our_server_subclass():
    # verl 0.9.1's vLLM server has no weight checksum and counts no tokens; under areal_async its replicas build
    # rollout/verl_vllm/server.py's subclass, which answers both (checked end to end in test_verl_vllm.py).
    assert check_backend_capabilities("vllm") == []


def test_verls_sglang_is_refused_naming_what_it_lacks_and_the_way_out():
    with pytest.raises(ArealConfigError) as refused:
        check_backend_capabilities("sglang")
    message = str(refused.value)
    assert "- weight_checksum:" in message and "- progress_stats:" in message
    assert "- abort_keeps_partial:" in message and "version_stamps" not in message
    assert "verl's vllm" in message and "areal.enable=false" in message
    assert message.endswith("areal.waive_capabilities=[abort_keeps_partial,weight_checksum,progress_stats]")


def test_a_waived_capability_is_returned_for_the_startup_warning():
    lacking = ["abort_keeps_partial", "weight_checksum", "progress_stats"]
    assert check_backend_capabilities("sglang", lacking) == lacking
    with pytest.raises(ArealConfigError, match=r"- progress_stats"):  # waiving two is not waiving all three
        check_backend_capabilities("sglang", lacking[:2])


def test_sglang_also_lacks_partial_log_probs_and_an_unknown_backend_everything():
    with pytest.raises(ArealConfigError, match=r"(?s)- abort_keeps_partial:.*- weight_checksum:"):
        check_backend_capabilities("sglang")
    assert check_backend_capabilities("my_engine", list(CAPABILITIES)) == list(CAPABILITIES)


def test_a_misspelled_waiver_is_refused():
    with pytest.raises(ArealConfigError, match=r"\['weight_checksums'\], which are not capabilities"):
        check_backend_capabilities("sglang", ["weight_checksums"])


def test_the_startup_validation_applies_the_contract_to_the_composed_recipe():
    from areal_plugins.builtin.validation import areal_validate_config

    with pytest.raises(ArealConfigError, match=r"rollout\.name=sglang lacks"):
        areal_validate_config(compose("grpo_cpu_async", ["actor_rollout_ref.rollout.name=sglang"]))
    waived = "areal.waive_capabilities=[abort_keeps_partial,weight_checksum,progress_stats]"
    areal_validate_config(compose("grpo_cpu_async", ["actor_rollout_ref.rollout.name=sglang", waived]))
    areal_validate_config(compose("grpo_cpu_async", ["actor_rollout_ref.rollout.name=vllm"]))
    # verl's synchronous trainer with our hooks needs none of it.
    areal_validate_config(compose("grpo_cpu_async", ["areal.mode=sync", "actor_rollout_ref.rollout.name=sglang"]))


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        (
            "actor_rollout_ref.model.lora_rank=8 ++actor_rollout_ref.model.lora.fully_sharded_loras=true",
            r"set actor_rollout_ref\.model\.lora\.fully_sharded_loras=false",
        ),
        ("actor_rollout_ref.rollout.disaggregation.enabled=true", r"set actor_rollout_ref\.rollout\.disaggregation"),
        ("actor_rollout_ref.rollout.data_parallel_size=2", r"set actor_rollout_ref\.rollout\.data_parallel_size=1"),
        ("actor_rollout_ref.rollout.checkpoint_engine.backend=delta_sharded", r"checkpoint_engine\.backend=nccl"),
    ],
    ids=["lora-fully-sharded", "disaggregation", "data-parallel", "delta"],
)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_what_the_vllm_weight_check_does_not_cover_is_refused_at_startup_in_both_modes(override, fix, mode):
    from areal_plugins.builtin.validation import areal_validate_config

    with pytest.raises(ArealConfigError, match=fix):
        areal_validate_config(
            compose("grpo_cpu_async", ["actor_rollout_ref.rollout.name=vllm", f"areal.mode={mode}", *override.split()])
        )
