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
    monkeypatch.setenv("AREAL_TINY_VISION_DIR", str(tmp_path))
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
    if recipe.parent.name == "gpu":  # docs/guides/gpus.md quotes the memory lines of every GPU recipe
        shown = (REPO / "docs" / "guides" / "gpus.md").read_text()
        memory = [r.getMessage().strip() for r in caplog.records if "GPU: " in r.getMessage()]
        assert len(memory) == 2 and all(line in shown for line in memory), memory


def refused(caplog, *argv: str) -> str:
    with caplog.at_level(logging.INFO):
        code = cli.main(["check", *argv])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2 and len(errors) == 1 and "\n" not in errors[0], errors
    return errors[0].removeprefix("refused: ")


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
    """vLLM's share: 0.125 x 8 GiB = 1,073,741,824 bytes; minus the weights (376,504,320) leaves 697,237,504 for
    the KV cache. KV per token: 2 (K, V) x 10 layers x 8 heads x 128 x 2 bytes = 40,960 bytes, so one sequence
    fits up to 17,022 tokens: 17,000 fits, 17,100 does not."""
    model = hand_counted_model(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.max_model_len={max_model_len}",
         "actor_rollout_ref.rollout.checkpoint_engine.backend=naive", "areal.placement=colocated",
         "actor_rollout_ref.rollout.free_cache_engine=true", "actor_rollout_ref.rollout.gpu_memory_utilization=0.125",
         "areal.check.memory_margin_gib=0"],  # the counted terms to the byte
    )  # fmt: skip
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=8.0)
    if fits:
        lines = fit_cluster(config, cluster)
        assert any("weights 0.4 GiB + KV cache 0.6 GiB (1.0 sequences of 17000 tokens" in line for line in lines)
        assert f"model: model, 0.19B parameters, from {model / 'config.json'}" in lines  # the folder's own file
    else:
        with pytest.raises(RecipeRefusedError, match=r"one sequence of 17100 tokens, over vLLM's share of 1\.0 GiB"):
            fit_cluster(config, cluster)


@pytest.mark.parametrize(("bucket_mb", "fits"), [(812, True), (813, False)])
def test_transfer_buckets_and_the_checkpoint_engines_context_come_on_top_of_vllms_share(tmp_path, bucket_mb, fits):
    """A 10 GiB GPU at gpu_memory_utilization 0.5: vLLM's 5 GiB + ~2 GiB of its CUDA context + the checkpoint
    engine process's 666,632,192 bytes + 3 buckets leave 10,737,418,240 - 5,368,709,120 - 2,147,483,648 -
    666,632,192 = 2,554,593,280 bytes: 3 x 812 MiB (2,554,331,136) fit, 3 x 813 MiB are 2,883,584 too many. The
    largest tensor (the fp32 embedding, 10,000 x 1024 x 4 = 40,960,000) fits a bucket: nothing to assemble."""
    model = hand_counted_model(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
         f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={bucket_mb}",
         "areal.check.memory_margin_gib=0"],  # the counted terms to the byte
    )  # fmt: skip
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=10.0)
    if fits:
        lines = fit_cluster(config, cluster)
        engine = ("+ 2.4 GiB of transfer buckets + 0.0 GiB assembled over-bucket tensor + 0.62 GiB checkpoint-engine "
                  "context; 0.0 GiB spare")  # fmt: skip
        assert any(engine in line for line in lines), lines
        assert any(line.startswith("trainer GPU:") and "+ 1.6 GiB of buckets" in line for line in lines), lines
    else:
        with pytest.raises(RecipeRefusedError, match=r"3 transfer buckets of 0\.8 GiB .* = 10\.0 GiB, more than"):
            fit_cluster(config, cluster)


def hand_counted_16_heads(folder: Path) -> Path:
    """16 heads of 64 over hidden 1024, 8 KV heads: per layer q, o 2 x 1024 x 1024 = 2,097,152, k, v 2 x 1024 x
    512 = 1,048,576, MLP 12,582,912: 15,728,640 x 10 = 157,286,400, + 20,480,000 of embedding and head =
    177,766,400 parameters, 355,532,800 bytes in bf16."""
    folder.mkdir()
    config = {"hidden_size": 1024, "num_hidden_layers": 10, "num_attention_heads": 16, "num_key_value_heads": 8}
    config |= {"intermediate_size": 4096, "vocab_size": 10000, "max_position_embeddings": 4096}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_tensor_parallel_beyond_the_kv_heads_replicates_them(tmp_path):
    """8 KV heads at TP 16 (two nodes of 8 engine GPUs): each GPU still holds one whole head, not half of one."""
    model = hand_counted_16_heads(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.tensor_model_parallel_size=16",
         "actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.n_gpus_per_node=8",
         "actor_rollout_ref.rollout.max_model_len=1000", "data.max_response_length=512"],
    )  # fmt: skip
    lines = fit_cluster(config, Cluster(nodes=3, gpus_per_node=8, gpu_memory_gib=80.0))
    # one head per GPU: 2 x 10 x 1 x 64 x 2 = 2,560 bytes a token; vLLM's 0.85 x 80 GiB = 73,014,444,032 bytes
    # less 355,532,800 / 16 = 22,220,800 of weights leaves 72,992,223,232: 28,512.6 sequences of 1,000 tokens
    # (half a head per GPU would claim twice as many).
    assert any("(28512.6 sequences of 1000 tokens" in line for line in lines), lines
    assert "positions: 1000 of model's 4096 (max_position_embeddings)" in lines


def test_tensor_parallel_that_does_not_divide_the_heads(tmp_path, caplog):
    """vLLM refuses 8 attention heads over 16 tensor parallel ranks at start."""
    model = hand_counted_model(tmp_path / "model")
    line = refused(
        caplog, str(SEPARATE_GPU), f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=16", "actor_rollout_ref.rollout.nnodes=2",
        "actor_rollout_ref.rollout.n_gpus_per_node=8", "--nodes", "3", "--gpus-per-node", "8",
    )  # fmt: skip
    assert "tensor_model_parallel_size=16 does not divide model's 8 attention heads" in line


def checked(caplog, *argv: str) -> list[str]:
    """``areal-plugins check`` that passes: its lines."""
    with caplog.at_level(logging.INFO):
        code = cli.main(["check", *argv])
    messages = [r.getMessage().strip() for r in caplog.records]
    assert code == 0, messages
    return messages


ONE_NODE = ("--nodes", "1", "--gpus-per-node", "8")
#: The counted terms to the byte: a 7B or 32B on the separate GPU recipe leaves its engine GPU 1.2 GiB beside vLLM's
#: 0.85 share, its 3 buckets and the assembled fp32 embedding, under the default margin (test_the_margin_*).
NO_MARGIN = "areal.check.memory_margin_gib=0"


def test_a_32b_on_one_engine_and_one_trainer_gpu_is_refused(caplog):
    """Qwen/Qwen2.5-32B-Instruct has Qwen2.5-32B's shape: 64 layers x (q, o 2 x 5120² = 52,428,800; k, v 2 x 5120
    x 1024 = 10,485,760; MLP 3 x 5120 x 27,648 = 424,673,280) = 31,205,621,760, + 2 x 152,064 x 5120 =
    1,557,135,360: 32,762,757,120 parameters. The engine's bf16 weights, 65.5 GB (61.0 GiB), still fit its 67.7 GiB
    share; the trainer's fp32 parameters, gradients and Adam, 16 bytes each, are 524,204,113,920 bytes = 488.2 GiB
    on its one GPU."""
    line = refused(
        caplog, str(SEPARATE_GPU), "actor_rollout_ref.model.path=Qwen/Qwen2.5-32B-Instruct", NO_MARGIN,
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.n_gpus_per_node=1", *ONE_NODE,
    )  # fmt: skip
    assert line.startswith("a trainer GPU needs 533.4 GiB at the update (488.2 GiB of fp32 parameters, gradients")
    assert "add trainer GPUs" in line and "offload_policy=true" in line and "ppo_max_token_len_per_gpu" in line


def test_a_7b_on_two_trainer_gpus_is_refused_and_on_eight_fits(caplog):
    """Qwen2.5-7B (7,615,283,200 parameters; tests/unit/test_trainer_memory.py counts every term): on 2 GPUs
    56.7 GiB of fp32 state + 13.9 GiB logits of the 24,576-token micro-batch + 10.4 GiB activations + 4.1 GiB
    gathered embedding = 85.1 GiB, + 2 GiB of CUDA context, over 79.6. On 8: 14.2 GiB of state, 42.6 GiB."""
    seven = "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B"
    line = refused(caplog, str(SEPARATE_GPU), seven, NO_MARGIN, "trainer.n_gpus_per_node=2", *ONE_NODE)
    assert line.startswith("a trainer GPU needs 87.1 GiB at the update (56.7 GiB of fp32 parameters")
    caplog.clear()
    lines = checked(
        caplog, str(SEPARATE_GPU), seven, NO_MARGIN, "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.rollout.n_gpus_per_node=8",
        "--nodes", "2", "--gpus-per-node", "8",
    )  # fmt: skip
    trainer = next(line for line in lines if line.startswith("trainer GPU:"))
    assert "update 14.2 GiB of fp32 parameters, gradients and Adam m, v over 8 GPU(s)" in trainer
    assert "= 42.6 GiB;" in trainer and "35.0 GiB spare of 79.6" in trainer
    # the engine assembles the fp32 embedding, 544,997,376 x 4 = 2,179,989,504 bytes, over a 2 GiB bucket
    assert any("+ 2.0 GiB assembled over-bucket tensor" in line for line in lines)


def test_a_bucket_larger_than_every_tensor_assembles_nothing(caplog):
    """2080 MiB = 2,181,038,080 bytes holds the 7B's fp32 embedding (2,179,989,504) whole."""
    lines = checked(
        caplog, str(SEPARATE_GPU), "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B", "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.rollout.n_gpus_per_node=8",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=2080", "--nodes", "2",
        "--gpus-per-node", "8",
    )  # fmt: skip
    assert any("+ 0.0 GiB assembled over-bucket tensor" in line for line in lines)


def test_colocated_the_trainers_state_stays_beside_the_awake_engine_unless_offloaded(caplog):
    """Colocated on 8 GPUs at gpu_memory_utilization 0.9: vLLM's 71.6 GiB + ~2 GiB leave 6.0 GiB, and the 7B's
    fp32 parameters and Adam, 12 x 7,615,283,200 / 8 = 10.6 GiB, stay on each GPU between updates; verl's
    param_offload and optimizer_offload move them to the CPU then."""
    colocated = REPO / "recipes/gpu/grpo_1.5b_colocated.yaml"
    args = (str(colocated), "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.9")  # fmt: skip
    line = refused(caplog, *args, *ONE_NODE)
    assert line.startswith("while the engine is awake, a trainer GPU keeps 10.6 GiB of fp32 parameters and Adam")
    assert "param_offload=true and optimizer_offload=true" in line
    caplog.clear()
    offload = ("actor_rollout_ref.actor.fsdp_config.param_offload=true",
               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true")  # fmt: skip
    checked(caplog, *args, *offload, *ONE_NODE)


def test_a_context_past_the_models_positions_is_refused(caplog):
    line = refused(caplog, str(SEPARATE_GPU), "actor_rollout_ref.rollout.max_model_len=200000", *ONE_NODE)
    assert line == (
        "actor_rollout_ref.rollout.max_model_len=200000 is past deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B's "
        "max_position_embeddings (131072), which vLLM refuses at start: lower max_model_len to at most 131072"
    )
    caplog.clear()
    line = refused(
        caplog, str(SEPARATE_GPU), "actor_rollout_ref.model.path=Qwen/Qwen2.5-Math-7B",
        "actor_rollout_ref.rollout.max_model_len=null", *ONE_NODE,
    )  # fmt: skip
    assert "data.max_prompt_length + data.max_response_length = 9216 tokens is past Qwen/Qwen2.5-Math-7B's" in line
    assert "max_position_embeddings (4096)" in line


def test_a_same_shape_fine_tune_is_sized_but_its_positions_need_its_config(caplog):
    lines = checked(caplog, str(SEPARATE_GPU), "actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct", *ONE_NODE)
    assert any(line.startswith("positions: not checked (the shape of Qwen/Qwen2.5-1.5B") for line in lines), lines
    assert any(line.startswith("trainer GPU:") for line in lines)


def test_an_unknown_hub_model_is_refused_naming_model_config(caplog):
    line = refused(caplog, str(SEPARATE_GPU), "actor_rollout_ref.model.path=acme/private-model-7b", *ONE_NODE)
    assert line.startswith("acme/private-model-7b is neither a local folder with config.json nor a hub model")
    assert line.endswith("pass --model-config PATH (the model's config.json, from its hub page or its folder)")


def test_model_config_sizes_a_hub_model_the_table_lacks(tmp_path, caplog):
    model = hand_counted_model(tmp_path / "model")
    lines = checked(
        caplog, str(SEPARATE_GPU), "actor_rollout_ref.model.path=acme/private-model-7b", "--model-config",
        str(model / "config.json"), *ONE_NODE,
    )  # fmt: skip
    assert f"model: acme/private-model-7b, 0.19B parameters, from --model-config {model / 'config.json'}" in lines


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        ("recipes/gpu/_gpu_grpo_1.5b.yaml", "_gpu_grpo_1.5b.yaml is a part that recipes include (no defaults: list "
         "composing verl's ppo_trainer), not a recipe; check a recipe that includes it: grpo_1.5b_colocated.yaml, "
         "grpo_1.5b_separate.yaml, grpo_1.5b_two_nodes.yaml"),
        ("pyproject.toml", "pyproject.toml is not a recipe: not readable YAML"),
        ("mkdocs.yml", "mkdocs.yml is not a recipe: it has no defaults: list composing verl's ppo_trainer"),
    ],
)  # fmt: skip
def test_a_file_that_is_not_a_recipe_is_refused_in_one_line(caplog, recipe, expected):
    line = refused(caplog, str(REPO / recipe), *ONE_NODE)
    assert line.startswith(expected)


def test_colocated_without_free_cache_engine_the_sleeping_engine_keeps_its_share(caplog):
    """free_cache_engine=false keeps vLLM's weights and KV cache, 0.9 x 79.6 = 71.6 GiB, on the GPU while the trainer
    trains: beside the 1.5B's 23.6 GiB update and ~4 GiB of CUDA context it no longer fits (with true it does: the
    recipe as shipped)."""
    line = refused(
        caplog, str(REPO / "recipes/gpu/grpo_1.5b_colocated.yaml"), "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.9", *ONE_NODE,
    )  # fmt: skip
    assert "+ 71.6 GiB vLLM keeps asleep (free_cache_engine=false)" in line
    assert line.endswith("or set actor_rollout_ref.rollout.free_cache_engine=true")


def test_fp32_compute_is_sized_and_a_7b_that_fits_in_bf16_no_longer_does(caplog):
    """mixed_precision.param_dtype=fp32 (verl computes in the parameters' fp32, no autocast) on Qwen2.5-7B over 8
    trainer GPUs (tests/unit/test_trainer_memory.py::test_fp32_compute_by_hand counts each term): 15,230,566,400
    of state + 44,845,498,368 logits + 21,293,236,224 activations + 6,539,968,512 gathered unit = 87,909,269,504
    bytes = 81.9 GiB, + 2 GiB of CUDA context = 83.9 GiB, over 79.6; in bf16 (verl's default) 42.6 GiB fits."""
    seven = ("actor_rollout_ref.model.path=Qwen/Qwen2.5-7B", "trainer.n_gpus_per_node=8", NO_MARGIN,
             "actor_rollout_ref.rollout.n_gpus_per_node=8", "--nodes", "2", "--gpus-per-node", "8")  # fmt: skip
    fp32 = "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32}"
    line = refused(caplog, str(SEPARATE_GPU), fp32, *seven)
    assert line.startswith("a trainer GPU needs 83.9 GiB at the update (14.2 GiB of fp32 parameters, gradients")
    assert "+ 41.8 GiB fp32 logits of a 24576-token micro-batch + 19.8 GiB fp32 activations" in line
    assert "+ 6.1 GiB gathered FSDP unit = 81.9 GiB" in line
    caplog.clear()
    trainer = next(line for line in checked(caplog, str(SEPARATE_GPU), *seven) if line.startswith("trainer GPU:"))
    assert "+ 13.9 GiB bf16 logits of a 24576-token micro-batch + 10.4 GiB bf16 activations" in trainer
    # reduce_dtype=bf16 alone (param_dtype stays verl's bf16): the unsharded gradient in 2 bytes, the embedding's
    # unit 544,997,376 x (2 + 2 + 2) = 3,269,984,256 (3.0 GiB) instead of x 8; 45,715,619,840 - 1,089,994,752 =
    # 44,625,625,088 bytes = 41.6 GiB
    caplog.clear()
    reduce = "+actor_rollout_ref.actor.fsdp_config.mixed_precision={reduce_dtype: bf16}"
    lines = checked(caplog, str(SEPARATE_GPU), reduce, *seven)
    trainer = next(line for line in lines if line.startswith("trainer GPU:"))
    assert "+ 3.0 GiB gathered FSDP unit = 41.6 GiB;" in trainer


def test_an_unknown_compute_dtype_is_refused_naming_the_key(caplog):
    line = refused(
        caplog, str(SEPARATE_GPU), "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: fp8}",
        *ONE_NODE,
    )  # fmt: skip
    assert line.startswith("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp8: check knows bfloat16")


@pytest.mark.parametrize(("max_model_len", "fits"), [(17000, True), (17100, False)])
def test_an_fp32_engine_holds_fp32_weights_and_kv_cache(tmp_path, max_model_len, fits):
    """rollout.dtype=float32: vLLM's KV cache follows the model's dtype (kv_cache_dtype auto). vLLM's share 0.25 x
    8 GiB = 2,147,483,648 bytes less the fp32 weights 188,252,160 x 4 = 752,008,640 leaves 1,395,475,008; KV per
    token 2 x 10 layers x 8 heads x 128 x 4 bytes = 81,920: one sequence fits up to 17,034 tokens."""
    model = hand_counted_model(tmp_path / "model")
    config = check_recipe(
        SEPARATE_GPU,
        [f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.max_model_len={max_model_len}",
         "actor_rollout_ref.rollout.checkpoint_engine.backend=naive", "areal.placement=colocated",
         "actor_rollout_ref.rollout.free_cache_engine=true", "actor_rollout_ref.rollout.gpu_memory_utilization=0.25",
         "actor_rollout_ref.rollout.dtype=float32", NO_MARGIN],
    )  # fmt: skip
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=8.0)
    if fits:
        lines = fit_cluster(config, cluster)
        assert any("weights 0.7 GiB + KV cache 1.3 GiB (1.0 sequences of 17000 tokens" in line for line in lines)
    else:
        with pytest.raises(RecipeRefusedError, match=r"0\.7 GiB of weights \(float32, TP 1\) \+ 1\.3 GiB of float32"):
            fit_cluster(config, cluster)


def test_verls_own_token_micro_batches_without_remove_padding_say_padding_is_not_counted(caplog):
    """verl's dynamic micro-batching counts real tokens and pads each micro-batch to its longest sequence without
    use_remove_padding; areal.micro_batch.max_tokens counts the padded tokens, so the GPU recipes need no note."""
    padded = "actor_rollout_ref.model.use_remove_padding=false"
    lines = checked(
        caplog, str(SEPARATE_GPU), padded, "areal.micro_batch.max_tokens=null",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", *ONE_NODE,
    )  # fmt: skip
    trainer = next(line for line in lines if line.startswith("trainer GPU:"))
    assert "micro-batch (padding not counted: verl pads each micro-batch of up to 16384 real tokens" in trainer
    caplog.clear()
    lines = checked(caplog, str(SEPARATE_GPU), padded, *ONE_NODE)
    ours = next(line for line in lines if line.startswith("trainer GPU:"))
    assert "padding not counted" not in ours and "24576-token micro-batch" in ours


def test_fixed_micro_batches_are_sized_padded_to_prompt_plus_response(caplog):
    """Without token-budget micro-batches (areal.micro_batch.max_tokens=null, verl's use_dynamic_bsz false), a
    micro-batch is ppo_micro_batch_size_per_gpu sequences padded to data.max_prompt_length + max_response_length:
    2 x (1024 + 8192) = 18,432 tokens; logits 18,432 x 151,936 x 4 = 11,201,937,408 bytes = 10.4 GiB."""
    lines = checked(
        caplog, str(SEPARATE_GPU), "areal.micro_batch.max_tokens=null",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *ONE_NODE,
    )  # fmt: skip
    trainer = next(line for line in lines if line.startswith("trainer GPU:"))
    assert "+ 10.4 GiB bf16 logits of a 18432-token micro-batch +" in trainer


def test_kv_heads_that_tensor_parallel_neither_divides_nor_multiplies(tmp_path, caplog):
    """12 attention heads and 4 KV heads at TP 6: 6 divides the heads, but neither divides the 4 KV heads nor is a
    multiple of them, which vLLM refuses at start."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 4}
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 2048, "vocab_size": 1000}))
    line = refused(
        caplog, str(SEPARATE_GPU), f"actor_rollout_ref.model.path={folder}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=6", "actor_rollout_ref.rollout.n_gpus_per_node=6",
        "--nodes", "2", "--gpus-per-node", "8",
    )  # fmt: skip
    assert line.startswith("actor_rollout_ref.rollout.tensor_model_parallel_size=6 neither divides model's 4 KV heads")


#: Issue 59's MoE run: Qwen3-30B-A3B, 8 trainer GPUs and 8 engine GPUs (TP 4) on two nodes; micro-batches of 16,384
#: tokens (A3B), or the issue's 17,408 (a 16k answer and its prompt).
A3B_BASE = (str(SEPARATE_GPU), "actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.rollout.n_gpus_per_node=8", "--nodes", "2", "--gpus-per-node", "8")  # fmt: skip
A3B = (*A3B_BASE, "areal.micro_batch.max_tokens=16384")


def test_the_issues_moe_run_no_longer_fits():
    """tests/unit/test_trainer_memory.py counts the update at 17,408 tokens: 83,718,987,776 bytes (78.0 GiB; the
    issue's 76.3 left out the expert copies, the router, Qwen3's q/k norms and its 4096-wide q), + 2 GiB of CUDA
    context = 85,866,471,424, over 79.6 GiB = 85,470,522,982 by 0.37 GiB: refused even with no margin."""
    with pytest.raises(RecipeRefusedError) as refusal:
        fit_cluster(check_recipe(REPO / "recipes/gpu/grpo_1.5b_separate.yaml",
                                 [arg for arg in A3B_BASE if "=" in arg] + ["areal.micro_batch.max_tokens=17408",
                                                                            NO_MARGIN]),
                    Cluster(nodes=2, gpus_per_node=8))  # fmt: skip
    line = str(refusal.value)
    assert line.startswith("a trainer GPU needs 80.0 GiB at the update (56.9 GiB of fp32 parameters")
    assert "+ 1.06 GiB bf16 top-8 expert dispatch and combine copies + 0.01 GiB fp32 router probabilities of the " \
           "recomputed layer + 4.6 GiB gathered FSDP unit = 78.0 GiB" in line  # fmt: skip
    assert "more than its 79.6 GiB" in line


@pytest.mark.parametrize(("margin", "fits"), [("0.59", True), ("0.6", False), (None, False)])
def test_the_margin_refuses_a_trainer_that_fits_with_less(caplog, margin, fits):
    """At 16,384 tokens a token costs 151,936 x 4 (logits) + 341,272 (activations) + 65,536 + 512 (expert copies,
    router) = 1,015,064 bytes: 16,630,808,576, beside 61,063,823,360 of state and 4,984,930,304 of gathered unit =
    82,679,562,240 (77.0 GiB); + 2 GiB = 84,827,045,888 of 85,470,522,982: 643,477,094 bytes = 0.599 GiB spare. A
    margin of 0.59 GiB passes, 0.6 and the default 2 GiB refuse it, naming the spare and the key."""
    extra = () if margin is None else (f"areal.check.memory_margin_gib={margin}",)
    if fits:
        trainer = next(line for line in checked(caplog, *A3B, *extra) if line.startswith("trainer GPU:"))
        assert "+ 1.00 GiB bf16 top-8 expert dispatch and combine copies + 0.01 GiB fp32 router probabilities of " \
               "the recomputed layer + 4.6 GiB gathered FSDP unit = 77.0 GiB" in trainer  # fmt: skip
        assert trainer.endswith("0.6 GiB spare of 79.6")
        return
    line = refused(caplog, *A3B, *extra)
    assert line.startswith("a trainer GPU needs 79.0 GiB at the update (56.9 GiB of fp32 parameters")
    expected = f"0.6 GiB spare of 79.6, under the areal.check.memory_margin_gib={float(margin or 2):g} GiB"
    assert expected in line and line.endswith("or lower areal.check.memory_margin_gib (0: fit to the byte)")


def test_the_margin_refuses_an_engine_that_fits_with_less(caplog):
    """The separate recipe with Qwen2.5-7B: vLLM's 0.85 x 79.6 = 67.66 GiB + ~2 GiB of its context + 3 x 2 GiB buckets
    + the assembled fp32 embedding 544,997,376 x 4 = 2,179,989,504 bytes (2.03 GiB) + 666,632,192 of the checkpoint
    engine's context (0.62 GiB) = 78.31 GiB: 1.29 GiB spare, under the default 2 GiB; with no margin it fits."""
    seven = (str(SEPARATE_GPU), "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B", "trainer.n_gpus_per_node=8",
             "actor_rollout_ref.rollout.n_gpus_per_node=8", "--nodes", "2", "--gpus-per-node", "8")  # fmt: skip
    line = refused(caplog, *seven)
    assert line.startswith("an engine GPU needs vLLM's 67.7 GiB + 10.7 GiB beside it")
    assert "1.3 GiB spare of 79.6, under the areal.check.memory_margin_gib=2 GiB" in line
    caplog.clear()
    assert any("1.3 GiB spare" in line for line in checked(caplog, *seven, NO_MARGIN))


def test_a_negative_margin_is_refused_naming_the_key(caplog):
    line = refused(caplog, *A3B, "areal.check.memory_margin_gib=-1")
    assert "areal.check.memory_margin_gib must be GiB >= 0" in line


def checkpoint_config(**trainer):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "trainer": {"save_freq": 25, "total_training_steps": 400, "max_actor_ckpt_to_keep": None} | trainer,
            "actor_rollout_ref": {"actor": {"fsdp_config": {"model_dtype": "fp32"},
                                            "checkpoint": {"save_contents": ["model", "optimizer", "extra"]}}},
        }
    )  # fmt: skip


def test_checkpoints_on_disk_their_size_count_and_total():
    """Qwen3-30B-A3B's 30,531,911,680 fp32 parameters: a checkpoint holds them (122,127,646,720 bytes) and Adam's two
    moments (244,255,293,440): 366,382,940,160 bytes = 366.4 GB (the issue's ~366 GB). 400 steps saved every 25: 16
    saves, all kept (max_actor_ckpt_to_keep null) = 5,862,127,042,560 bytes, and a warning; 2 kept: 732.8 GB; 410
    steps: 16 + the last = 17; parameters alone (save_contents [model]): 122.1 GB."""
    from areal_plugins.planning.cluster_fit import checkpoint_lines
    from areal_plugins.planning.model_shapes import from_table

    a3b = from_table("Qwen/Qwen3-30B-A3B").shape
    line, warning = checkpoint_lines(checkpoint_config(), a3b)
    assert line.startswith("checkpoints: 366.4 GB each (30.53B 32-bit: parameters 122.1 GB + Adam m, v 244.3 GB")
    assert "all 16 saves of trainer.total_training_steps=400" in line and "5862.1 GB on disk" in line
    assert (
        warning.startswith("warning: verl keeps every checkpoint of 366.4 GB") and "max_actor_ckpt_to_keep" in warning
    )
    (kept,) = checkpoint_lines(checkpoint_config(max_actor_ckpt_to_keep=2), a3b)
    assert "2 kept (trainer.max_actor_ckpt_to_keep=2): 732.8 GB on disk" in kept
    assert "all 17 saves" in checkpoint_lines(checkpoint_config(total_training_steps=410), a3b)[0]
    model_only = checkpoint_config()
    model_only.actor_rollout_ref.actor.checkpoint.save_contents = ["model"]
    assert checkpoint_lines(model_only, a3b)[0].startswith("checkpoints: 122.1 GB each")
    assert checkpoint_lines(checkpoint_config(save_freq=-1), a3b) == ["checkpoints: none (trainer.save_freq=-1)"]


def test_check_warns_when_verl_keeps_every_checkpoint(caplog):
    with caplog.at_level(logging.INFO):
        assert cli.main(["check", *A3B, NO_MARGIN]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("warning: verl keeps every checkpoint of 366.4 GB (5862.1 GB)") for w in warnings)
    # the GPU recipes' sample counts, which areal.micro_batch.max_tokens (use_dynamic_bsz) leaves unread
    ignored = "warning: verl ignores actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4, actor_rollout_ref.rollout"
    assert any(w.startswith(ignored) for w in warnings), warnings
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert cli.main(["check", *A3B, NO_MARGIN, "trainer.max_actor_ckpt_to_keep=2"]) == 0
    assert not any("checkpoint" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_the_margin_holds_beside_an_awake_colocated_engine(caplog):
    """Colocated at gpu_memory_utilization 0.83: vLLM's 66.07 GiB + ~2 GiB leave 11.53 GiB; Qwen2.5-7B's fp32
    parameters and Adam, 12 x 7,615,283,200 / 8 = 11,422,924,800 bytes = 10.64 GiB, fit beside it, but not with the
    2 GiB margin (12.64)."""
    args = (str(REPO / "recipes/gpu/grpo_1.5b_colocated.yaml"), "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.83", *ONE_NODE)  # fmt: skip
    line = refused(caplog, *args)
    assert line.startswith("while the engine is awake, a trainer GPU keeps 10.6 GiB of fp32 parameters and Adam state")
    assert "+ the areal.check.memory_margin_gib=2 GiB margin, more than the 11.5 GiB the engine leaves" in line
    caplog.clear()
    checked(caplog, *args, NO_MARGIN)
