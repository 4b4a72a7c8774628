"""``areal-plugins check``: every recipe passes on the cluster it declares; broken variants are refused in one
line; the pool, tensor-parallel and engine-memory arithmetic against hand-counted numbers."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from areal_plugins import cli
from areal_plugins.run.cluster_fit import Cluster, fit_cluster
from areal_plugins.run.preflight import RecipeRefusedError, check_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if not p.name.startswith("_"))
SEPARATE_GPU = REPO / "recipes" / "gpu" / "grpo_1.5b_separate.yaml"
#: The cluster a recipe says it is checked on (its header's ``areal-plugins check ... --nodes N --gpus-per-node M``).
DECLARED = re.compile(r"areal-plugins check \S+ --nodes (\d+) --gpus-per-node (\d+)")


@pytest.fixture(autouse=True)
def environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_TINY_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_TINY_CALCULATOR_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_DATA_DIR", str(tmp_path))


def declared_cluster(recipe: Path) -> tuple[int, int]:
    found = DECLARED.search(recipe.read_text())
    return (int(found.group(1)), int(found.group(2))) if found else (1, 2)  # CPU recipes: fake GPU slots


def test_every_gpu_recipe_declares_the_cluster_it_is_checked_on():
    gpu = [r for r in RECIPES if r.parent.name == "gpu"]
    assert len(gpu) == 3
    assert all(DECLARED.search(r.read_text()) for r in gpu)


@pytest.mark.parametrize("recipe", RECIPES, ids=[str(r.relative_to(REPO / "recipes")) for r in RECIPES])
def test_every_recipe_passes_check_on_its_cluster(recipe, caplog):
    nodes, per_node = declared_cluster(recipe)
    with caplog.at_level(logging.INFO):
        code = cli.main(["check", str(recipe), "--nodes", str(nodes), "--gpus-per-node", str(per_node)])
    assert code == 0, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def refused(caplog, *argv: str) -> str:
    with caplog.at_level(logging.INFO):
        code = cli.main(["check", *argv])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2 and len(errors) == 1 and "\n" not in errors[0], errors
    return errors[0]


def test_a_pool_that_does_not_fit_the_nodes(caplog):
    line = refused(caplog, str(SEPARATE_GPU), "--nodes", "1", "--gpus-per-node", "4")
    assert "does not fit the cluster (1 nodes x 4 GPUs)" in line


def test_a_two_node_recipe_on_one_node(caplog):
    line = refused(caplog, str(REPO / "recipes/gpu/grpo_1.5b_two_nodes.yaml"), "--nodes", "1", "--gpus-per-node", "8")
    assert "does not fit" in line


def test_a_pool_wider_than_a_node(caplog):
    line = refused(caplog, str(SEPARATE_GPU), "trainer.n_gpus_per_node=16", "--nodes", "4", "--gpus-per-node", "8")
    assert "asks for 16 GPUs per node; the cluster's nodes have 8" in line


def test_a_tensor_parallel_size_that_does_not_divide_the_engines(caplog):
    line = refused(
        caplog, str(SEPARATE_GPU), "actor_rollout_ref.rollout.tensor_model_parallel_size=3", "--nodes", "1",
        "--gpus-per-node", "8",
    )  # fmt: skip
    assert "tensor_model_parallel_size=3 must divide the engines' 4 GPUs" in line


def test_a_32b_model_on_one_gpu_per_engine_leaves_no_room(caplog):
    """R1-Distill-Qwen-32B (the planner's shape): ~61 GiB of bf16 weights per GPU at TP 1; at
    gpu_memory_utilization 0.7 of 80 GiB (56 GiB) they do not fit."""
    line = refused(
        caplog, str(SEPARATE_GPU), "actor_rollout_ref.model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7", "--nodes", "1", "--gpus-per-node", "8",
    )  # fmt: skip
    assert "over its budget of 56.0 GiB" in line and "tensor_model_parallel_size" in line


def hand_counted_model(folder: Path) -> Path:
    """Parameters by hand: per layer q,o 2 x 1024^2 + k,v 2 x 1024 x (8 x 128) = 4,194,304, MLP 3 x 1024 x 4096 =
    12,582,912, so 16,777,216 x 10 layers = 167,772,160; embeddings and head 2 x 10,000 x 1024 = 20,480,000;
    188,252,160 parameters, 376,504,320 bytes in bf16 = 0.35064 GiB."""
    folder.mkdir()
    config = {"hidden_size": 1024, "num_hidden_layers": 10, "num_attention_heads": 8, "num_key_value_heads": 8}
    config |= {"intermediate_size": 4096, "vocab_size": 10000}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("bucket_mb", "fits"), [(128, True), (256, False)])
def test_engine_memory_against_a_hand_count(tmp_path, bucket_mb, fits):
    """Budget 0.85 x 1 GiB = 0.85 GiB. Weights 0.35064 GiB + 2 buckets: 2 x 128 MiB = 0.25 GiB fits (0.60 GiB);
    2 x 256 MiB = 0.5 GiB does not (0.85064 GiB > 0.85 GiB)."""
    model = hand_counted_model(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}", "data.max_response_length=1024",
         f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={bucket_mb}"],
    )  # fmt: skip
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=1.0)
    if fits:
        lines = fit_cluster(config, cluster)
        assert any("weights 0.4 GiB + buckets 0.2 GiB of 0.8 GiB" in line for line in lines), lines
    else:
        with pytest.raises(RecipeRefusedError, match=r"0\.4 GiB of weights .* \+ 0\.5 GiB of transfer buckets"):
            fit_cluster(config, cluster)


def test_the_kv_cache_must_hold_one_longest_sequence(tmp_path):
    """KV cache per token by hand: 2 (K, V) x 10 layers x 8 heads x 128 x 2 bytes = 40,960 bytes; one sequence of
    1024 + 8192 tokens needs 377,487,360 bytes = 0.35 GiB, more than the 0.85 - 0.35064 - 0.25 = 0.249 GiB left."""
    model = hand_counted_model(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}",
         "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=128"],
    )  # fmt: skip
    with pytest.raises(RecipeRefusedError, match=r"0\.2 GiB left .* one sequence of 9216 tokens needs \(0\.4 GiB\)"):
        fit_cluster(config, Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=1.0))
