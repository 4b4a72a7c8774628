"""Recipe values verl 0.9.1 overrides, caps or ignores at run time without refusing them: ``check`` names each with
the key to change, so the run does what the recipe says or the recipe says what the run does.

Each check cites the verl source that changes the value (paths under ``verl/``, lines of 0.9.1). Pure reading of the
composed config: no verl import, no device.
"""

from __future__ import annotations

import math
from typing import Any

#: Where verl chooses between token-budget and fixed-size micro-batches: ``verl/workers/engine/utils.py:103-128``
#: (``prepare_micro_batches``: ``max_token_len_per_gpu`` when ``use_dynamic_bsz``, ``micro_batch_size_per_gpu``
#: otherwise), fed by ``verl/workers/engine_workers.py:619-628`` (the actor's training and log-prob passes) and
#: ``engine_workers.py:546-552, 580-583`` (the reference's ``log_prob_*`` keys).
DYNAMIC_BSZ_SOURCE = "verl/workers/engine/utils.py:108-128"


def verl_overrides(config: Any, max_positions: int | None) -> list[str]:
    """One ``warning: ...`` line per recipe value verl will override, cap or ignore at run time.

    Args:
        config: the composed, resolved recipe.
        max_positions: the model's ``max_position_embeddings`` (None where unknown).
    """
    return [
        f"warning: {line}"
        for line in (
            *_ignored_micro_batch_sizes(config),
            *_max_model_len(config, max_positions),
            *_batched_tokens(config, max_positions),
            *_checkpoints_kept(config),
            *_padded_batch(config),
            *_learning_rate_schedule(config),
        )
    ]


def _ignored_micro_batch_sizes(config: Any) -> list[str]:
    """``use_dynamic_bsz: true`` packs micro-batches by tokens: a sample count set beside it is never read."""
    actor_rollout_ref = config.actor_rollout_ref
    if not actor_rollout_ref.actor.get("use_dynamic_bsz", False):
        return []
    keys = [
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor_rollout_ref.actor),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", actor_rollout_ref.rollout),
    ]
    if actor_rollout_ref.get("ref") is not None and actor_rollout_ref.ref.get("log_prob_use_dynamic_bsz", False):
        keys.append(("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", actor_rollout_ref.ref))
    set_keys = [f"{key}={node.get(key.rsplit('.', 1)[1])}" for key, node in keys if node.get(key.rsplit(".", 1)[1])]
    if not set_keys:
        return []
    return [
        f"verl ignores {', '.join(set_keys)}: actor.use_dynamic_bsz=true cuts micro-batches by tokens "
        "(actor.ppo_max_token_len_per_gpu, rollout.log_prob_max_token_len_per_gpu; areal.micro_batch.max_tokens "
        f"where set), never by sample count ({DYNAMIC_BSZ_SOURCE}): remove them, or set use_dynamic_bsz=false to "
        "use them"
    ]


def _max_model_len(config: Any, max_positions: int | None) -> list[str]:
    """verl's vLLM server sets a null ``max_model_len`` to the model's ``max_position_embeddings``
    (``verl/workers/rollout/vllm_rollout/vllm_async_server.py:1104-1105``): vLLM then reserves KV cache and
    accepts prompts for the model's whole context, not the recipe's prompt + response."""
    rollout = config.actor_rollout_ref.rollout
    if str(rollout.name) != "vllm" or rollout.get("max_model_len") is not None:
        return []
    sequence = int(config.data.max_prompt_length) + int(config.data.max_response_length)
    positions = f"{max_positions}" if max_positions is not None else "the model's max_position_embeddings"
    return [
        f"verl sets actor_rollout_ref.rollout.max_model_len=null to {positions} (max_position_embeddings; "
        "verl/workers/rollout/vllm_rollout/vllm_async_server.py:1104-1105), not to data.max_prompt_length + "
        f"max_response_length = {sequence}: set actor_rollout_ref.rollout.max_model_len={sequence}"
    ]


def _batched_tokens(config: Any, max_positions: int | None) -> list[str]:
    """Without chunked prefill verl raises ``max_num_batched_tokens`` to ``max_model_len``
    (``vllm_async_server.py:1113-1119``)."""
    rollout = config.actor_rollout_ref.rollout
    if str(rollout.name) != "vllm" or rollout.get("enable_chunked_prefill", True):
        return []
    length = rollout.get("max_model_len") or max_positions
    batched = rollout.get("max_num_batched_tokens")
    if length is None or batched is None or int(batched) >= int(length):
        return []
    return [
        f"verl raises actor_rollout_ref.rollout.max_num_batched_tokens={batched} to max_model_len ({length}): "
        "enable_chunked_prefill=false needs a whole prompt in one batch (verl/workers/rollout/vllm_rollout/"
        f"vllm_async_server.py:1113-1119): set max_num_batched_tokens={length}, or enable_chunked_prefill=true"
    ]


def _checkpoints_kept(config: Any) -> list[str]:
    """``trainer.remove_previous_ckpt_in_save: true`` replaces ``max_actor_ckpt_to_keep`` with 1
    (``verl/trainer/ppo/v1/trainer_base.py:958-966``)."""
    trainer = config.trainer
    if not trainer.get("remove_previous_ckpt_in_save", False):
        return []
    keep = trainer.get("max_actor_ckpt_to_keep")
    return [
        f"verl keeps 1 checkpoint, not trainer.max_actor_ckpt_to_keep={keep}: the deprecated "
        "trainer.remove_previous_ckpt_in_save=true overrides it (verl/trainer/ppo/v1/trainer_base.py:958-966): "
        "remove remove_previous_ckpt_in_save and set max_actor_ckpt_to_keep"
    ]


def _padded_batch(config: Any) -> list[str]:
    """verl pads each step's batch with synthetic no-op sequences up to a multiple of lcm(data-parallel size,
    ``ppo_mini_batch_size`` x n) (``verl/trainer/ppo/v1/trainer_base.py:1589-1606, 1620-1621``,
    ``verl/trainer/ppo/padding_utils.py:144-167``): they take a trainer's time and a mini-batch's place."""
    actor_rollout_ref = config.actor_rollout_ref
    n = int(actor_rollout_ref.rollout.n)
    sequences = int(config.data.train_batch_size) * n
    mini = int(actor_rollout_ref.actor.ppo_mini_batch_size) * n
    trainer_gpus = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    sp = int(actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1)
    data_parallel = max(trainer_gpus // sp, 1)
    multiple = math.lcm(data_parallel, mini)
    padding = -sequences % multiple
    if not padding:
        return []
    return [
        f"verl pads every step's {sequences} sequences (data.train_batch_size x rollout.n) with {padding} synthetic "
        f"ones to a multiple of lcm({data_parallel} data-parallel ranks, ppo_mini_batch_size x n = {mini}) = "
        f"{multiple} (verl/trainer/ppo/v1/trainer_base.py:1589-1621): make data.train_batch_size a multiple of "
        "actor_rollout_ref.actor.ppo_mini_batch_size"
    ]


def _learning_rate_schedule(config: Any) -> list[str]:
    """verl's FSDP engine builds the actor's schedule from ``actor.optim`` (``verl/workers/engine/fsdp/
    transformer_impl.py:503-534``): ``lr_warmup_steps`` > 0 wins over ``lr_warmup_steps_ratio`` (514-516); a
    ``constant`` schedule never reads ``min_lr_ratio`` (521-522; cosine does, 523-530); and the deprecated
    ``warmup_style``, when set, replaces ``lr_scheduler_type`` (``verl/workers/config/optimizer.py:117-122``)."""
    actor = config.actor_rollout_ref.actor
    if str(actor.get("strategy", "fsdp")) not in ("fsdp", "fsdp2") or actor.get("optim") is None:
        return []
    optim = actor.optim
    key = "actor_rollout_ref.actor.optim"
    lines = []
    steps, ratio = optim.get("lr_warmup_steps"), float(optim.get("lr_warmup_steps_ratio", 0.0) or 0.0)
    if steps is not None and int(steps) > 0 and ratio:
        lines.append(
            f"verl ignores {key}.lr_warmup_steps_ratio={ratio:g}: lr_warmup_steps={steps} > 0 wins "
            f"(verl/workers/engine/fsdp/transformer_impl.py:514-516): set {key}.lr_warmup_steps=-1 to warm up by the "
            "ratio, or remove the ratio"
        )
    style = optim.get("warmup_style")
    schedule = str(style if style is not None else optim.get("lr_scheduler_type", "constant"))
    if style is not None and str(style) != str(optim.get("lr_scheduler_type", "constant")):
        lines.append(
            f"verl schedules {style!r}, not {key}.lr_scheduler_type={optim.get('lr_scheduler_type')}: the deprecated "
            f"{key}.warmup_style replaces it (verl/workers/config/optimizer.py:117-122): remove warmup_style and set "
            "lr_scheduler_type"
        )
    min_lr = float(optim.get("min_lr_ratio", 0.0) or 0.0)
    if schedule == "constant" and min_lr:
        lines.append(
            f"verl ignores {key}.min_lr_ratio={min_lr:g}: a constant schedule never decays "
            f"(verl/workers/engine/fsdp/transformer_impl.py:521-530): set {key}.lr_scheduler_type=cosine, or remove "
            "min_lr_ratio"
        )
    return lines
