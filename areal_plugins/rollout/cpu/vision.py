"""Images for ``areal_cpu``: what a vision-language model's prompt carries beside its tokens, and its positions.

verl's agent loop hands a server the prompt's tokens with each image already expanded into its placeholder tokens
(``<|image_pad|>`` x the image's merged patches) and the images themselves (``image_data``), as vLLM takes them. The
engine needs the pixels, the patch grid of each image and the model's multimodal rotary positions (Qwen2-VL's
M-RoPE: three position axes; an image's placeholders advance them by its grid, not by its token count). After the
prompt every axis moves one per token, offset by the prompt's ``rope_delta``: what a decode step needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: ``config.json`` ``model_type`` of the vision-language models this engine serves: Qwen2-VL, the one run here.
#: Qwen2.5-VL's ``get_rope_index`` computes the same positions for images (its time scaling is for videos) but its
#: windowed vision tower has never run through this engine.
SERVED_VISION_MODEL_TYPES = ("qwen2_vl",)


@dataclass(frozen=True)
class VisionPrompt:
    """A prompt's images as the model's forward takes them, and its rotary positions."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    #: (3, 1, prompt tokens): the M-RoPE positions of the prompt.
    positions: torch.Tensor
    #: The last prompt position + 1 - the prompt's length: a later token at index ``i`` sits at ``i + rope_delta``.
    rope_delta: int


class ImagePrompts:
    """Turns a request's images into a :class:`VisionPrompt` with the model's own processor and rope index.

    Args:
        model: a Qwen2-VL-family ``...ForConditionalGeneration``.
        image_processor: the model folder's image processor (``AutoProcessor``'s, the one verl's agent loop used to
            expand the prompt's placeholders, so the counts agree).
    """

    def __init__(self, model: Any, image_processor: Any) -> None:
        config = model.config
        self.model = model
        self.image_processor = image_processor
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)

    def prompt(self, prompt_ids: list[int], images: list[Any] | None) -> VisionPrompt | None:
        """The request's :class:`VisionPrompt`; None without images and placeholders.

        Raises:
            ValueError: the prompt's placeholder tokens do not match its images' patches (a prompt built with another
                processor, or images lost on the way), which would place image features on text.
        """
        placeholders = sum(1 for token in prompt_ids if token == self.image_token_id)
        if not images:
            if placeholders:
                raise ValueError(
                    f"the prompt holds {placeholders} image placeholder tokens and no image came with it: "
                    "a request resubmitted after an interruption must carry its images again (image_data)"
                )
            return None
        processed = self.image_processor(images=list(images), return_tensors="pt")
        grid = processed["image_grid_thw"]
        expected = int(grid.prod(dim=-1).sum()) // (self.merge * self.merge)
        if placeholders != expected:
            raise ValueError(
                f"the prompt holds {placeholders} image placeholder tokens, its {len(images)} images {expected} "
                "merged patches: the prompt was expanded by another processor than the model folder's"
            )
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        token_types = (ids == self.image_token_id).to(torch.int)
        positions, delta = self.model.model.get_rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=grid)
        return VisionPrompt(processed["pixel_values"], grid, positions, int(delta.reshape(-1)[0]))


def load_model(model_path: str, trust_remote_code: bool = False) -> tuple[Any, ImagePrompts | None]:
    """The model of ``model_path`` in float32 (eval mode), and its :class:`ImagePrompts` if it is a vision-language
    model (its ``config.json`` has a ``vision_config``).

    Raises:
        ValueError: a vision-language model of a family this engine does not serve.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if getattr(config, "vision_config", None) is None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
        return model.eval(), None
    if config.model_type not in SERVED_VISION_MODEL_TYPES:
        raise ValueError(
            f"areal_cpu serves the vision-language models {', '.join(SERVED_VISION_MODEL_TYPES)}, not "
            f"{config.model_type!r}: use another rollout backend for it"
        )
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return model.eval(), ImagePrompts(model, processor.image_processor)
