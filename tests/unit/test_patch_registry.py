"""``apply_enabled_patches``: only the features in use get patched, in the listed order."""

from __future__ import annotations

from areal_plugins.patches import (
    fsdp1_cpu,
    gloo_backend,
    master_port,
    trainer_progress,
    vllm_cpu_distribution,
    vlm_position_ids,
)

from areal_plugins import patches


def test_nothing_is_patched_off_the_cpu_platform(monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cuda")
    assert patches.enabled_patches(None) == []
    # The async trainer's workers count micro-batches for its stall guard (patches/trainer_progress.py), and a
    # vision-language model's 3-D positions are kept whole (patches/vlm_position_ids.py: nothing else is touched).
    assert patches.enabled_patches({"areal": {"enable": True}}) == [trainer_progress, vlm_position_ids]
    assert patches.enabled_patches({"areal": {"enable": False}}) == []


def test_cpu_platform_needs_the_gloo_patch_and_the_vllm_cpu_alias(monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert patches.enabled_patches(None) == [gloo_backend, vllm_cpu_distribution, master_port, fsdp1_cpu]


def test_every_patch_module_follows_the_patch_contract():
    for feature, _, patch in patches.PATCHES:
        assert feature
        doc = patch.__doc__ or ""
        for section in ("Why", "Upstream", "Remove when"):
            assert section in doc, f"{patch.__name__}: docstring lacks {section!r}"
        assert callable(patch.apply) and callable(patch.revert) and callable(patch.is_applied)
