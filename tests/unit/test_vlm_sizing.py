"""``check`` and ``plan`` know a vision-language model however it is named (issue 60, item 3): the vision tower's
parameters in the trainer's and the engine's memory, its activations, an image's tokens in the prompt, the
processor's ``max_pixels`` read from the recipe; and ``check --model-config`` on a hub id refuses what the same
model in a local folder is refused for.

Expected numbers are counted by hand from Qwen2.5-VL-7B-Instruct's published ``config.json`` (written out below), or
taken from transformers' own vision classes built on the meta device (an independent reference)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from areal_plugins import cli
from areal_plugins.planning.model_shapes import shape_from_config
from areal_plugins.planning.vision import vision_from_config
from tests.unit.test_verl_scripts import PPO_TRAINER

#: Qwen2.5-VL-7B-Instruct's config.json (huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct), the keys sizing reads.
QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}
#: The language model, by hand: 28 layers x (q, o 2·3584² + k, v 2·3584·512 = 29,360,128; MLP 3·3584·18,944 =
#: 203,685,888) = 6,525,288,448, + untied embedding and head 2·152,064·3584 = 1,089,994,752: 7,615,283,200 (the
#: issue's 7.62B).
TEXT_PARAMS = 7_615_283_200
#: The vision tower, by hand: patch embedding Conv3d 3·2·14·14·1280 = 1,505,280 (no bias); a block: two RMSNorms
#: 2·1280, qkv 1280·3840 + 3840, proj 1280² + 1280, gated MLP 2·(1280·3420 + 3420) + 3420·1280 + 1280 = 19,702,200,
#: x 32 = 630,470,400; merger: RMSNorm 1280, 5120² + 5120, 5120·3584 + 3584 = 44,574,464. Total 676,550,144 (the
#: published 8.29B less the language model's 7.62B).
VISION_PARAMS = 676_550_144
#: One image of 512 x 28 x 28 = 401,408 pixels: 401,408 / (14·2)² = 512 prompt tokens, 2,048 patches (half the
#: script's 1,024-token prompt).
MAX_PIXELS = 401_408
#: A Qwen2.5-VL vision block's activations a patch in bf16 (trainer_memory's decoder-layer formula at h = 1280,
#: 16 heads of 80, MLP 3420): 2·(4·1280 + 2·1280 + 4·3420 + 2·1280) + 4·(2·1280 + 16) + 8 = 58,152 bytes; with
#: gradient checkpointing 32 block inputs 32·2·1280 = 81,920 + one block 58,152 + the merger 4·1280·2 = 10,240:
#: 150,312 bytes a patch.
VISION_BYTES_PER_PATCH = 150_312
#: verl's Qwen2.5-VL-7B GRPO example (examples/grpo_trainer/run_qwen2_5_vl-7b.sh, geo3k), the keys that size it.
VL_SCRIPT = """
    algorithm.adv_estimator=grpo
    data.train_batch_size=512
    data.max_prompt_length=1024
    data.max_response_length=2048
    data.filter_overlong_prompts=True
    data.image_key=images
    actor_rollout_ref.model.path=<model>
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=128
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.total_epochs=15
""".split()


def test_qwen25_vl_7b_counts_its_vision_tower():
    shape = shape_from_config(QWEN25_VL_7B, "Qwen/Qwen2.5-VL-7B-Instruct")
    assert shape.decoder_params == TEXT_PARAMS
    assert shape.vision_params == VISION_PARAMS
    assert shape.params == TEXT_PARAMS + VISION_PARAMS  # 8.29B, not 7.62B
    assert shape.vision is not None
    # transformers' Qwen2-VL processor default, 1,280 x 28 x 28 pixels: 1,003,520 / 784 = 1,280 tokens of 4 patches
    assert shape.vision.image_tokens(1_003_520) == 1280 and shape.vision.patches(1280) == 5120


VISION_CONFIGS = {
    "qwen2_vl": {"depth": 2, "embed_dim": 64, "hidden_size": 96, "mlp_ratio": 4, "num_heads": 4, "in_chans": 3,
                 "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen2_5_vl": {"depth": 2, "hidden_size": 64, "intermediate_size": 120, "num_heads": 4, "in_chans": 3,
                   "out_hidden_size": 96, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen3_vl": {"depth": 3, "hidden_size": 64, "intermediate_size": 120, "num_heads": 4, "in_channels": 3,
                 "out_hidden_size": 96, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                 "num_position_embeddings": 144, "deepstack_visual_indexes": [0, 2]},
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(VISION_CONFIGS))
def test_every_sized_tower_has_the_parameters_transformers_builds(family):
    """transformers' own vision class, built on the meta device from the same vision_config, is the reference."""
    from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl, modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import configuration_qwen2_vl, modeling_qwen2_vl
    from transformers.models.qwen3_vl import configuration_qwen3_vl, modeling_qwen3_vl

    classes = {
        "qwen2_vl": (
            configuration_qwen2_vl.Qwen2VLVisionConfig,
            modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel,
        ),
        "qwen2_5_vl": (
            configuration_qwen2_5_vl.Qwen2_5_VLVisionConfig,
            modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel,
        ),
        "qwen3_vl": (configuration_qwen3_vl.Qwen3VLVisionConfig, modeling_qwen3_vl.Qwen3VLVisionModel),
    }
    config_class, model_class = classes[family]
    with torch.device("meta"):
        tower = model_class._from_config(config_class(**VISION_CONFIGS[family]))
    built = sum(parameter.numel() for parameter in tower.parameters())
    vision = vision_from_config({"model_type": family, "vision_config": VISION_CONFIGS[family]})
    assert vision is not None and vision.params == built


def test_a_tower_of_another_family_is_refused_not_guessed():
    from areal_plugins.planning.model_shapes import UnknownModelError

    llava = {**QWEN25_VL_7B, "model_type": "llava", "vision_config": {"hidden_size": 1024}}
    with pytest.raises(UnknownModelError, match=r"model_type 'llava' .* not sized .* check this model on its cluster"):
        shape_from_config(llava, "llava")


def model_folder(tmp_path: Path, config: dict, processor: dict | None = None) -> Path:
    folder = tmp_path / "Qwen2.5-VL-7B-Instruct"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if processor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder


def check(caplog, *argv: str) -> tuple[int, list[str]]:
    with caplog.at_level(logging.INFO):
        code = cli.main(["check", str(PPO_TRAINER), "--nodes", "1", "--gpus-per-node", "8", *argv])
    return code, [record.getMessage() for record in caplog.records]


def script(model: str) -> list[str]:
    return [o.replace("<model>", model) for o in VL_SCRIPT]


def test_check_sizes_the_vision_tower_its_activations_and_the_images_tokens(tmp_path, caplog):
    """verl's own trainer (no areal): nothing refuses the VLM, and check sizes it."""
    folder = model_folder(tmp_path, QWEN25_VL_7B)
    code, lines = check(caplog, *script(str(folder)), f"+data.mm_processor_kwargs.max_pixels={MAX_PIXELS}")
    assert code == 0, lines
    model = next(line for line in lines if "model: " in line)
    assert "8.29B parameters (7.62B language model + 0.68B qwen2_5_vl vision tower)" in model
    images = next(line for line in lines if "images: " in line)
    assert f"{MAX_PIXELS:,} pixels (data.mm_processor_kwargs.max_pixels) is up to 512 prompt tokens" in images
    assert "2,048 patches" in images
    # 10 sequences a micro-batch (ppo_micro_batch_size_per_gpu), each one image of 2,048 patches: 20,480 patches
    # x 150,312 bytes = 2.87 GiB
    trainer = next(line for line in lines if "trainer GPU: " in line)
    assert f"{20_480 * VISION_BYTES_PER_PATCH / 1024**3:.1f} GiB bf16 vision-tower activations of 20,480" in trainer
    assert not [line for line in lines if line.startswith("warning: an image of")]
    # the engine: 8.29B bf16 weights over TP 2 = 7.7 GiB (7.09 GiB without the tower)
    engine = next(line for line in lines if "engine GPU: " in line)
    assert f"weights {(TEXT_PARAMS + VISION_PARAMS) * 2 / 2 / 1024**3:.1f} GiB" in engine
    assert "vision activations for one image" in engine
    assert not [line for line in lines if line.startswith("warning: neither data.mm_processor_kwargs")]


def test_max_pixels_from_the_processor_config_and_an_image_longer_than_the_prompt(tmp_path, caplog):
    """Without the recipe key, the model's preprocessor_config.json; the published Qwen2.5-VL processor's 12,845,056
    pixels are 16,384 tokens, past the script's 1,024-token prompt: warned, naming the key."""
    folder = model_folder(tmp_path, QWEN25_VL_7B, {"min_pixels": 3136, "max_pixels": 12_845_056})
    code, lines = check(caplog, *script(str(folder)))
    assert code == 0, lines
    assert any("12,845,056 pixels (" in line and "preprocessor_config.json) is up to 16,384 prompt" in line
               for line in lines), lines  # fmt: skip
    assert any(
        line.startswith("warning: an image of 12,845,056 pixels is 16,384 prompt tokens")
        and "data.mm_processor_kwargs.max_pixels to at most 802,816" in line  # 1,024 x 784
        for line in lines
    ), lines


def test_an_image_the_engines_context_cannot_hold_is_warned(tmp_path, caplog):
    """1,024 x 784 = 802,816 pixels are 1,024 tokens: within the script's prompt, but a max_model_len of 1,024 leaves
    no room for an answer."""
    folder = model_folder(tmp_path, QWEN25_VL_7B)
    argv = [*script(str(folder)), "+data.mm_processor_kwargs.max_pixels=802816"]
    code, lines = check(caplog, *argv, "actor_rollout_ref.rollout.max_model_len=1024")
    assert code == 0, lines
    assert any(line.startswith("warning: an image of 802,816 pixels is 1,024 prompt tokens, not fewer than "
                               "actor_rollout_ref.rollout.max_model_len=1024") for line in lines), lines  # fmt: skip
    caplog.clear()
    code, lines = check(caplog, *argv, "actor_rollout_ref.rollout.max_model_len=3072")
    assert code == 0 and not [line for line in lines if line.startswith("warning: an image")], lines


def test_without_max_pixels_check_says_what_it_assumed(tmp_path, caplog):
    folder = model_folder(tmp_path, QWEN25_VL_7B)
    code, lines = check(caplog, *script(str(folder)))
    assert code == 0, lines
    assert any(line.startswith("warning: neither data.mm_processor_kwargs.max_pixels") for line in lines), lines


def refusal(caplog, argv: list[str]) -> str:
    caplog.clear()
    code, lines = check(caplog, *argv)
    errors = [line for line in lines if line.startswith("refused: ")]
    assert code == 2 and len(errors) == 1, lines
    return errors[0]


def test_a_hub_id_with_model_config_is_refused_as_the_same_model_in_a_folder(tmp_path, caplog):
    """The issue's case: under areal the local folder is refused and the hub id with --model-config said ok; both
    now give the same refusal (the script's engine is verl's vllm, which lacks the images capability)."""
    folder = model_folder(tmp_path, QWEN25_VL_7B)
    local = refusal(caplog, [*script(str(folder)), "+areal.enable=true"])
    hub = refusal(
        caplog,
        [*script("Qwen/Qwen2.5-VL-7B-Instruct"), "+areal.enable=true", "--model-config", str(folder / "config.json")],
    )
    assert "(images)" in local and hub == local


def test_a_text_model_by_hub_id_with_model_config_still_passes(tmp_path, caplog):
    text = {key: value for key, value in QWEN25_VL_7B.items() if key != "vision_config"} | {"model_type": "qwen2"}
    folder = model_folder(tmp_path, text)
    code, lines = check(
        caplog, *script("Qwen/Qwen2.5-7B-Instruct"), "+areal.enable=true", "--model-config", str(folder)
    )
    assert code == 0, lines
    assert any("7.62B parameters, from --model-config" in line for line in lines), lines


def test_plan_counts_the_vision_tower_and_says_images_are_not_simulated(tmp_path, capsys):
    folder = model_folder(tmp_path, QWEN25_VL_7B)
    argv = ["plan", "--gpus", "8", "--model", str(folder), "--batch", "32", "--group", "4", "--max-response", "2048",
            "--response-mean", "600", "--eta", "1"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "a vision-language model: its 0.68B-parameter vision tower counts" in out
