"""From verl's own scripts to a run: verl's ``ppo_trainer.yaml`` as the recipe, one of verl's example GRPO scripts'
override lists as it is (the model swapped for the tiny model's shape), plus ``+areal.enable=true``, passes our startup
validation and ``areal-plugins check`` in both placements (docs/guides/own_recipe.md, From verl's example scripts).
The same recipe shape trains on CPU in CI: ``tests/integration/test_plugins_in_a_run.py`` (the observed run)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from areal_plugins import cli
from areal_plugins.builtin.validation import areal_validate_config
from areal_plugins.cli.preflight import RecipeRefusedError, check_recipe
from areal_plugins.tiny.model import TinyModelSpec

#: verl's own recipe: what ``python3 -m verl.trainer.main_ppo`` composes without ``--config-name``.
PPO_TRAINER = Path(__import__("verl").__file__).parent / "trainer" / "config" / "ppo_trainer.yaml"

#: verl's Qwen3-8B GRPO example (``examples/grpo_trainer/run_qwen3-8b.sh`` in volcengine/verl at b178a3c; the issue
#: read the same list as ``run_qwen3_8b_fsdp.sh`` in v0.9.0), its overrides as the shell passes them (quotes
#: stripped). It sets no ``actor_rollout_ref.actor.strategy``: verl's default ``fsdp`` (FSDP1). ``<model>`` stands
#: for the model path (``Qwen/Qwen3-8B`` there).
QWEN3_8B_GRPO = """
    algorithm.adv_estimator=grpo
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    data.train_batch_size=1024
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path=<model>
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger=["console","wandb"]
    trainer.project_name=verl_grpo_example_gsm8k
    trainer.experiment_name=qwen3_8b_function_rm
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
""".split()
#: The engines in a pool of their own, as docs/guides/gpus.md writes it for verl's command line: the trainer on 4 of
#: the node's 8 GPUs, the engines on the other 4, weights over NCCL.
SEPARATE = [
    "+areal.placement=separate",
    "trainer.n_gpus_per_node=4",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=4",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
]


@pytest.fixture
def script(tmp_path) -> list[str]:
    """The script's overrides with ``<model>`` a folder holding a config.json of the tiny model's shape
    (:class:`TinyModelSpec`), whose positions reach Qwen3-8B's 40,960 (the tiny model's 1,024 are fewer than the
    script's 512 + 1,024 tokens), and ``$HOME`` this test's folder (the data files are read when the run starts)."""
    spec = TinyModelSpec()
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "vocab_size": spec.tokenizer_ranks + 64,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    }
    (model / "config.json").write_text(json.dumps(config))
    return [o.replace("<model>", str(model)).replace("$HOME", str(tmp_path)) for o in QWEN3_8B_GRPO]


def check(caplog, *overrides: str) -> tuple[int, list[str]]:
    """``areal-plugins check <verl's ppo_trainer.yaml> --nodes 1 --gpus-per-node 8 OVERRIDES``: exit code, lines."""
    with caplog.at_level(logging.INFO):
        code = cli.main(["check", str(PPO_TRAINER), "--nodes", "1", "--gpus-per-node", "8", *overrides])
    return code, [record.getMessage() for record in caplog.records]


def test_the_script_sets_no_trainer_engine_and_verl_defaults_fsdp1(script):
    assert not [o for o in script if ".strategy=" in o]
    config = check_recipe(PPO_TRAINER, [*script, "+areal.enable=true"])
    assert config.actor_rollout_ref.actor.strategy == "fsdp"
    assert config.actor_rollout_ref.ref.strategy == "fsdp"


def test_a_verl_script_plus_the_one_flag_passes_validation_and_check_colocated(script, caplog):
    config = check_recipe(PPO_TRAINER, [*script, "+areal.enable=true"])
    assert config.trainer.v1.trainer_mode == "areal_async"  # routed: our trainer, not verl's sync one
    assert config.areal.placement == "colocated" and config.actor_rollout_ref.rollout.name == "vllm"
    areal_validate_config(config)
    code, lines = check(caplog, *script, "+areal.enable=true")
    assert code == 0, lines
    assert any(line.endswith("fsdp") and "trainer: 1 node(s) x 8 GPU(s)" in line for line in lines), lines


def test_a_verl_script_plus_the_one_flag_passes_validation_and_check_separate(script, caplog):
    config = check_recipe(PPO_TRAINER, [*script, "+areal.enable=true", *SEPARATE])
    assert config.areal.placement == "separate" and config.actor_rollout_ref.actor.strategy == "fsdp"
    areal_validate_config(config)
    code, lines = check(caplog, *script, "+areal.enable=true", *SEPARATE)
    assert code == 0, lines


def test_every_areal_key_on_verls_recipe_takes_a_plus_and_the_refusal_says_so(script):
    """On verl's recipe the ``areal`` node exists only as ``+areal.enable=true`` makes it: another areal key without a
    + is refused naming exactly what to write; with + (or ++) it is read."""
    with pytest.raises(RecipeRefusedError) as refused:
        check_recipe(PPO_TRAINER, [*script, "+areal.enable=true", "areal.max_staleness=2"])
    assert "write +areal.max_staleness=2" in str(refused.value)
    assert "docs/guides/own_recipe.md" in str(refused.value)
    for plus in ("+", "++"):
        config = check_recipe(PPO_TRAINER, [*script, f"{plus}areal.enable=true", f"{plus}areal.max_staleness=2"])
        assert config.areal.max_staleness == 2 and config.areal.enable is True
