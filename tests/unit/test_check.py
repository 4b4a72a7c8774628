"""``areal-plugins check``: every recipe passes on the cluster it declares; broken variants are refused in one
line; the pool, tensor-parallel and engine-memory arithmetic against hand-counted numbers."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from areal_plugins import cli
from areal_plugins.cli.preflight import RecipeRefusedError, check_recipe
from areal_plugins.planning.cluster_fit import Cluster, fit_cluster

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
    assert "finds no node with room on the cluster (1 nodes x 4 GPUs)" in line


def test_a_two_node_recipe_on_one_node(caplog):
    line = refused(caplog, str(REPO / "recipes/gpu/grpo_1.5b_two_nodes.yaml"), "--nodes", "1", "--gpus-per-node", "8")
    assert "finds no node with room" in line


def test_a_pool_wider_than_a_node(caplog):
    line = refused(caplog, str(SEPARATE_GPU), "trainer.n_gpus_per_node=16", "--nodes", "4", "--gpus-per-node", "8")
    assert "trainer.n_gpus_per_node=16, but the cluster's nodes have 8 GPUs" in line


def test_a_tensor_parallel_size_that_does_not_divide_the_engines(caplog):
    line = refused(
        caplog, str(SEPARATE_GPU), "actor_rollout_ref.rollout.tensor_model_parallel_size=3", "--nodes", "1",
        "--gpus-per-node", "8",
    )  # fmt: skip
    assert "spans tensor x data x pipeline parallel = 3 GPUs, which must divide the engines' 4 GPUs" in line


def test_a_32b_model_on_one_gpu_per_engine_leaves_no_room(caplog):
    """R1-Distill-Qwen-32B (the planner's shape): ~61 GiB of bf16 weights per GPU at TP 1; at
    gpu_memory_utilization 0.7 of an H100's 79.6 GiB (55.7 GiB) they do not fit."""
    line = refused(
        caplog, str(SEPARATE_GPU), "actor_rollout_ref.model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7", "--nodes", "1", "--gpus-per-node", "8",
    )  # fmt: skip
    assert "over vLLM's share of 55.7 GiB" in line and "tensor_model_parallel_size" in line


def hand_counted_model(folder: Path) -> Path:
    """Parameters by hand: per layer q,o 2 x 1024^2 + k,v 2 x 1024 x (8 x 128) = 4,194,304, MLP 3 x 1024 x 4096 =
    12,582,912, so 16,777,216 x 10 layers = 167,772,160; embeddings and head 2 x 10,000 x 1024 = 20,480,000;
    188,252,160 parameters, 376,504,320 bytes in bf16 = 0.35064 GiB."""
    folder.mkdir()
    config = {"hidden_size": 1024, "num_hidden_layers": 10, "num_attention_heads": 8, "num_key_value_heads": 8}
    config |= {"intermediate_size": 4096, "vocab_size": 10000}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("max_model_len", "fits"), [(17000, True), (17100, False)])
def test_weights_and_one_sequence_must_fit_vllms_share(tmp_path, max_model_len, fits):
    """vLLM's share: 0.25 x 4 GiB = 1,073,741,824 bytes; minus the weights (376,504,320) leaves 697,237,504 for
    the KV cache. KV per token: 2 (K, V) x 10 layers x 8 heads x 128 x 2 bytes = 40,960 bytes, so one sequence
    fits up to 17,022 tokens: 17,000 fits, 17,100 does not."""
    model = hand_counted_model(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.max_model_len={max_model_len}",
         "actor_rollout_ref.rollout.checkpoint_engine.backend=naive", "areal.placement=colocated",
         "actor_rollout_ref.rollout.gpu_memory_utilization=0.25"],
    )  # fmt: skip
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=4.0)
    if fits:
        lines = fit_cluster(config, cluster)
        assert any("weights 0.4 GiB + KV cache 0.6 GiB (1.0 sequences of 17000 tokens" in line for line in lines)
    else:
        with pytest.raises(RecipeRefusedError, match=r"one sequence of 17100 tokens, over vLLM's share of 1\.0 GiB"):
            fit_cluster(config, cluster)


@pytest.mark.parametrize(("bucket_mb", "fits"), [(1024, True), (1025, False)])
def test_transfer_buckets_come_on_top_of_vllms_share(tmp_path, bucket_mb, fits):
    """A 10 GiB GPU at gpu_memory_utilization 0.5: vLLM's 5 GiB + ~2 GiB of CUDA context + 3 buckets on the
    engine's side. 3 x 1024 MiB = 3 GiB fills it exactly; 3 x 1025 MiB is 3 MiB too many."""
    model = hand_counted_model(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
         f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={bucket_mb}"],
    )  # fmt: skip
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=10.0)
    if fits:
        lines = fit_cluster(config, cluster)
        assert any("+ 3.0 GiB of transfer buckets; 0.0 GiB spare" in line for line in lines), lines
        assert "trainer GPU: + 2.0 GiB of transfer buckets during a weight sync" in lines
    else:
        with pytest.raises(RecipeRefusedError, match=r"3 transfer buckets of 1\.0 GiB .* = 10\.0 GiB, more than"):
            fit_cluster(config, cluster)


def test_tensor_parallel_beyond_the_kv_heads_replicates_them(tmp_path):
    """8 KV heads at TP 16 (two nodes of 8 engine GPUs): each GPU still holds one whole head, not half of one."""
    model = hand_counted_model(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.tensor_model_parallel_size=16",
         "actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.n_gpus_per_node=8",
         "actor_rollout_ref.rollout.max_model_len=1000"],
    )  # fmt: skip
    lines = fit_cluster(config, Cluster(nodes=3, gpus_per_node=8, gpu_memory_gib=80.0))
    # one head per GPU: 2 x 10 x 1 x 128 x 2 = 5,120 bytes a token; vLLM's 0.85 x 80 GiB = 73,014,444,032 bytes
    # less 376,504,320 / 16 bytes of weights leaves 72,990,912,512: 14,256.0 sequences of 1,000 tokens (half a head
    # per GPU would claim twice as many).
    assert any("(14256.0 sequences of 1000 tokens" in line for line in lines), lines
