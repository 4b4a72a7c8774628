"""Build the tiny vision-language model: a Qwen2-VL with the tiny text model's shape and a one-block vision tower,
its tokenizer (the tiny Qwen2 BPE plus Qwen2-VL's vision tokens), its processor, and its warm start on the image
task (vision_task.py).

The vision tower: 14-pixel patches, 2 x 2 merged per token (Qwen2-VL's), one block of width 32 projected to the text
width 128, about 0.1M parameters. Everything is transformers' own Qwen2-VL; only the processor drops the video part
(images_only_processor.py).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from areal_plugins.tiny.supervised import warm_start
from areal_plugins.tiny.tokenizer import write_tokenizer
from areal_plugins.tiny.vision_task import IMAGE_PLACEHOLDER, IMAGE_SIDE, PictureProblem, draw, make_picture_problems

logger = logging.getLogger(__name__)

#: Qwen2-VL's vision tokens, added to the tiny tokenizer in this order.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: The chat template of the tiny model with images: Qwen2-VL's layout of an image item.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: The held-out pictures the build measures its warm start on (greedy accuracy), apart from the warm start's and the
#: RL data's seeds.
HELD_OUT_PROBLEMS, HELD_OUT_SEED = 200, 777
#: The processor's code file in the model folder (``auto_map``).
PROCESSOR_MODULE = "processing_tiny_vlm"


def picture_messages(question: str) -> list[dict[str, Any]]:
    """The chat messages verl's ``RLHFDataset`` builds from ``question`` (its ``<image>`` split into an image item)."""
    parts = [part for part in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", question) if part]
    content = [{"type": "image"} if part == IMAGE_PLACEHOLDER else {"type": "text", "text": part} for part in parts]
    return [{"role": "user", "content": content}]


def random_qwen2_vl(spec: Any, tokenizer: Any) -> Any:
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` of ``spec``'s text shape (seeded), in float32."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    head_dim = spec.hidden_size // spec.num_heads
    temporal = head_dim // 2 - 2 * (head_dim // 2 * 3 // 8)  # M-RoPE's sections: Qwen2-VL's 16/24/24 of 64, scaled
    sections = [temporal, (head_dim // 2 - temporal) // 2, (head_dim // 2 - temporal) // 2]
    torch.manual_seed(spec.seed)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": (len(tokenizer) + 63) // 64 * 64,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": sections},
            "bos_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": spec.hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
        dtype="float32",
    )
    return Qwen2VLForConditionalGeneration(config)


def write_processor(out_dir: Path, tokenizer: Any) -> Any:
    """Write the tokenizer with its vision tokens, the image processor and the processor's code; return the processor
    as verl will load it."""
    from transformers import AutoProcessor, Qwen2VLImageProcessor

    from areal_plugins.tiny import images_only_processor

    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    side = IMAGE_SIDE * IMAGE_SIDE  # every picture at its own size: no resize
    # White (the background) normalised to 0: only the squares reach the vision tower, whose features then differ by
    # picture from the start (with CLIP's mean and spread the background dominated them, and a warm start on drawn
    # digits collapsed them to one vector the language model learned to ignore).
    image_processor = Qwen2VLImageProcessor(
        min_pixels=side, max_pixels=side, patch_size=14, merge_size=2, image_mean=[1.0] * 3, image_std=[0.5] * 3
    )
    processor = images_only_processor.Qwen2VLProcessor(image_processor, tokenizer, chat_template=VISION_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    shutil.copyfile(images_only_processor.__file__, out_dir / f"{PROCESSOR_MODULE}.py")
    config = out_dir / "processor_config.json"
    saved = json.loads(config.read_text())
    saved["auto_map"] = {"AutoProcessor": f"{PROCESSOR_MODULE}.Qwen2VLProcessor"}
    config.write_text(json.dumps(saved, indent=2))
    return AutoProcessor.from_pretrained(out_dir, trust_remote_code=True)


def build_tiny_vlm(out_dir: Path, spec: Any) -> dict[str, float]:
    """Write the tiny vision-language model to ``out_dir``; return warm-start metrics."""
    from transformers import AutoTokenizer

    write_tokenizer(out_dir, spec.tokenizer_ranks)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    processor = write_processor(out_dir, tokenizer)
    model = random_qwen2_vl(spec, tokenizer)
    metrics = _warm_start(model, processor, spec) if spec.warmstart_steps > 0 else {}
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    if spec.warmstart_steps > 0:  # what the warm start reached, in the build's record (BUILT.json): about 5 s
        held_out = make_picture_problems(HELD_OUT_PROBLEMS, seed=HELD_OUT_SEED)
        metrics["warmstart_greedy_accuracy"] = greedy_accuracy(out_dir, held_out)
    return metrics


class _PictureBatches:
    """Warm-start batches: each example's ids (image placeholders expanded), labels on the answer, and pixels."""

    def __init__(self, processor: Any, spec: Any) -> None:
        self.processor = processor
        self.spec = spec
        # Seed offset keeps warm-start problems apart from the RL data's default seeds.
        self.problems = make_picture_problems(spec.warmstart_steps * spec.warmstart_batch, seed=spec.seed + 10_000)

    def example(self, problem: PictureProblem) -> tuple[list[int], list[int], Any]:
        tokenizer = self.processor.tokenizer
        prompt = self.processor.apply_chat_template(
            picture_messages(problem.question), add_generation_prompt=True, tokenize=False
        )
        encoded = self.processor(text=[prompt], images=[draw(problem)], return_tensors="pt")
        prompt_ids = encoded["input_ids"][0].tolist()
        answer_ids = [*tokenizer.encode(problem.answer, add_special_tokens=False), tokenizer.eos_token_id]
        return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids, encoded

    def __iter__(self):
        size = self.spec.warmstart_batch
        for start in range(0, len(self.problems), size):
            yield [self.example(problem) for problem in self.problems[start : start + size]]


def _warm_start(model: Any, processor: Any, spec: Any) -> dict[str, float]:
    """Supervised steps on ``picture + question -> answer<|im_end|>``, the loss on the answer only."""
    import torch

    pixels: list[tuple[Any, Any]] = []  # each batch's (pixel_values, image_grid_thw), in step order

    def examples():
        for batch in _PictureBatches(processor, spec):
            pixels.append(
                (
                    torch.cat([encoded["pixel_values"] for _, _, encoded in batch]),
                    torch.cat([encoded["image_grid_thw"] for _, _, encoded in batch]),
                )
            )
            yield [(ids, labels) for ids, labels, _ in batch]

    def more_inputs(step: int, input_ids: Any) -> dict[str, Any]:
        pixel_values, grid = pixels[step]
        token_types = (input_ids == processor.image_token_id).to(torch.int)
        return {"pixel_values": pixel_values, "image_grid_thw": grid, "mm_token_type_ids": token_types}

    return warm_start(
        model,
        examples(),
        spec.warmstart_steps,
        spec.warmstart_lr,
        processor.tokenizer.pad_token_id,
        spec.task,
        more_inputs=more_inputs,
    )


def greedy_accuracy(model_dir: Path, problems: list[PictureProblem]) -> float:
    """Greedy accuracy of the model in ``model_dir`` on ``problems`` (transformers' own ``generate``)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=True)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0
    for problem in problems:
        prompt = processor.apply_chat_template(
            picture_messages(problem.question), add_generation_prompt=True, tokenize=False
        )
        encoded = processor(text=[prompt], images=[draw(problem)], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=4, do_sample=False)
        answer = processor.tokenizer.decode(out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        right += answer.strip() == problem.answer
    return right / len(problems)
