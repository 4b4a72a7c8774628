"""``check`` names each recipe value verl 0.9.1 overrides, caps or ignores at run time, with the key to change; each
rule's cited verl lines still say what the rule assumes."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from areal_plugins.planning.verl_overrides import verl_overrides


def recipe(**changes):
    """A composed recipe's keys the rules read, as verl's ppo_trainer defaults them, then ``changes`` (dotted)."""
    config = OmegaConf.create(
        {
            "data": {"train_batch_size": 128, "max_prompt_length": 1024, "max_response_length": 8192},
            "trainer": {"nnodes": 1, "n_gpus_per_node": 8, "max_actor_ckpt_to_keep": None,
                        "remove_previous_ckpt_in_save": False},
            "actor_rollout_ref": {
                "actor": {"use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": None, "ppo_mini_batch_size": 32,
                          "ulysses_sequence_parallel_size": 1, "strategy": "fsdp",
                          "optim": {"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "min_lr_ratio": 0.0,
                                    "lr_scheduler_type": "constant", "warmup_style": None}},
                "rollout": {"name": "vllm", "n": 8, "max_model_len": 9216, "log_prob_micro_batch_size_per_gpu": None,
                            "enable_chunked_prefill": True, "max_num_batched_tokens": 8192},
                "ref": {"log_prob_use_dynamic_bsz": False, "log_prob_micro_batch_size_per_gpu": None},
            },
        }
    )  # fmt: skip
    for key, value in changes.items():
        OmegaConf.update(config, key.replace("__", "."), value)
    return config


def test_a_recipe_verl_runs_as_written_gets_no_warning():
    assert verl_overrides(recipe(), 40960) == []


def test_sample_counts_beside_token_budgets_are_named_as_ignored():
    (line,) = verl_overrides(
        recipe(actor_rollout_ref__actor__use_dynamic_bsz=True, actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=4,
               actor_rollout_ref__rollout__log_prob_micro_batch_size_per_gpu=16),
        40960,
    )  # fmt: skip
    assert line.startswith(
        "warning: verl ignores actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4, "
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16: actor.use_dynamic_bsz=true"
    )
    # fixed micro-batches read them; token budgets with none set leave nothing to ignore
    assert verl_overrides(recipe(actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=4), 40960) == []
    assert verl_overrides(recipe(actor_rollout_ref__actor__use_dynamic_bsz=True), 40960) == []


def test_a_null_max_model_len_becomes_the_models_positions():
    """1024 + 8192 = 9216 tokens a sequence; verl's vLLM server takes the model's 40,960."""
    (line,) = verl_overrides(recipe(actor_rollout_ref__rollout__max_model_len=None), 40960)
    assert "max_model_len=null to 40960 (max_position_embeddings" in line
    assert line.endswith("set actor_rollout_ref.rollout.max_model_len=9216")
    assert (
        "the model's max_position_embeddings"
        in verl_overrides(recipe(actor_rollout_ref__rollout__max_model_len=None), None)[0]
    )
    assert verl_overrides(recipe(actor_rollout_ref__rollout__max_model_len=None,
                                 actor_rollout_ref__rollout__name="areal_cpu"), 40960) == []  # fmt: skip


def test_batched_tokens_below_max_model_len_without_chunked_prefill_are_raised():
    (line,) = verl_overrides(recipe(actor_rollout_ref__rollout__enable_chunked_prefill=False), 40960)
    assert line.startswith(
        "warning: verl raises actor_rollout_ref.rollout.max_num_batched_tokens=8192 to max_model_len"
    )
    assert "(9216)" in line and "set max_num_batched_tokens=9216" in line
    raised = recipe(actor_rollout_ref__rollout__enable_chunked_prefill=False,
                    actor_rollout_ref__rollout__max_num_batched_tokens=9216)  # fmt: skip
    assert verl_overrides(raised, 40960) == []


def test_remove_previous_ckpt_in_save_overrides_the_count_kept():
    (line,) = verl_overrides(
        recipe(trainer__remove_previous_ckpt_in_save=True, trainer__max_actor_ckpt_to_keep=3), None
    )
    assert line.startswith("warning: verl keeps 1 checkpoint, not trainer.max_actor_ckpt_to_keep=3")


@pytest.mark.parametrize(
    ("batch", "sp", "padding", "multiple"),
    [(100, 1, 224, 256), (128, 1, 0, 256), (96, 2, 0, 256), (127, 1, 8, 256)],
)
def test_a_batch_that_is_no_multiple_of_the_mini_batch_is_padded(batch, sp, padding, multiple):
    """n = 8, ppo_mini_batch_size 32: mini-batches of 256 sequences; 8 trainer GPUs (4 ranks with sequence
    parallelism 2). 100 x 8 = 800 sequences: the next multiple of lcm(8, 256) = 256 is 1024, 224 synthetic ones;
    128 x 8 = 1024: none; 96 x 8 = 768 = 3 x 256: none; 127 x 8 = 1016: 8."""
    lines = verl_overrides(
        recipe(data__train_batch_size=batch, actor_rollout_ref__actor__ulysses_sequence_parallel_size=sp), 40960
    )
    if not padding:
        assert lines == []
        return
    (line,) = lines
    assert f"{batch * 8} sequences (data.train_batch_size x rollout.n) with {padding} synthetic" in line
    assert f"= {multiple} (" in line and line.endswith("multiple of actor_rollout_ref.actor.ppo_mini_batch_size")


def test_the_learning_rate_keys_verl_does_not_read():
    optim = "actor_rollout_ref__actor__optim__"
    (line,) = verl_overrides(recipe(**{f"{optim}lr_warmup_steps": 10, f"{optim}lr_warmup_steps_ratio": 0.1}), None)
    assert line.startswith("warning: verl ignores actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1: ")
    assert verl_overrides(recipe(**{f"{optim}lr_warmup_steps_ratio": 0.1}), None) == []  # -1: the ratio is read
    (line,) = verl_overrides(recipe(**{f"{optim}min_lr_ratio": 0.1}), None)
    assert line.startswith("warning: verl ignores actor_rollout_ref.actor.optim.min_lr_ratio=0.1: a constant schedule")
    cosine = {f"{optim}min_lr_ratio": 0.1, f"{optim}lr_scheduler_type": "cosine"}
    assert verl_overrides(recipe(**cosine), None) == []
    # warmup_style: constant replaces cosine, and then min_lr_ratio is not read either
    lines = verl_overrides(recipe(**cosine, **{f"{optim}warmup_style": "constant"}), None)
    assert lines[0].startswith("warning: verl schedules 'constant', not actor_rollout_ref.actor.optim.lr_scheduler")
    assert lines[1].startswith("warning: verl ignores actor_rollout_ref.actor.optim.min_lr_ratio=0.1")


#: (verl file, first and last line cited, text those lines hold): the rules' citations, held against verl's source.
CITED = [
    ("workers/engine/utils.py", 103, 128, "if use_dynamic_bsz:"),
    ("workers/engine/utils.py", 103, 128, 'micro_batch_size_per_gpu = data["micro_batch_size_per_gpu"]'),
    ("workers/rollout/vllm_rollout/vllm_async_server.py", 1104, 1105,
     "self.config.max_model_len = max_position_embeddings"),
    ("workers/rollout/vllm_rollout/vllm_async_server.py", 1113, 1119,
     "self.config.max_num_batched_tokens = self.config.max_model_len"),
    ("trainer/ppo/v1/trainer_base.py", 958, 966, "if not remove_previous_ckpt_in_save else 1"),
    ("trainer/ppo/v1/trainer_base.py", 1589, 1606, "actor_global_mini_batch_size *= self.config.actor_rollout_ref"),
    ("trainer/ppo/v1/trainer_base.py", 1620, 1621, "upsample_batch_to_divisible_size(batch, batch_multiple"),
    ("trainer/ppo/padding_utils.py", 144, 167, "remainder = len(batch) % batch_multiple"),
    ("workers/engine/fsdp/transformer_impl.py", 514, 516, "num_warmup_steps = int(num_warmup_steps_ratio * total"),
    ("workers/engine/fsdp/transformer_impl.py", 521, 522, "get_constant_schedule_with_warmup(optimizer=optimizer,"),
    ("workers/engine/fsdp/transformer_impl.py", 523, 530, "min_lr_ratio=min_lr_ratio"),
    ("workers/config/optimizer.py", 117, 122, "self.lr_scheduler_type = self.warmup_style"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "first", "last", "text"), CITED)
def test_the_cited_verl_lines_say_what_the_rules_assume(path, first, last, text):
    import verl

    lines = (Path(verl.__file__).parent / path).read_text().splitlines()[first - 1 : last]
    assert any(text in line for line in lines), (path, first, last)
