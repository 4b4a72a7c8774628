"""verl's ``RLHFDataset`` with pictures loaded by PIL alone: the image task's dataset class (``data.custom_cls``).

verl loads a prompt's images with ``qwen_vl_utils.process_vision_info``, which imports torchvision at its top for its
video code; the CPU box has no CPU build of torchvision (images_only_processor.py). The task's pictures are already
the size the model takes (vision_task.py, ``IMAGE_SIDE``), so nothing is resized here; a picture of another size is
refused, naming it, instead of being fed at a size the processor would change.
"""

from __future__ import annotations

from typing import Any

from verl.utils.dataset.rl_dataset import RLHFDataset

from areal_plugins.tiny.vision_task import IMAGE_SIDE


class PictureDataset(RLHFDataset):
    """``RLHFDataset`` whose images come from the rows' PNG bytes through PIL (no video, no audio)."""

    @classmethod
    def _process_multi_modal_info(cls, messages: list[dict], image_patch_size: Any, config: Any):
        images = []
        for message in messages:
            content = message.get("content")
            for item in content if isinstance(content, list) else []:
                if isinstance(item, dict) and item.get("type") in ("video", "audio"):
                    raise ValueError(f"the tiny image task's dataset serves images only, not {item['type']}")
                if isinstance(item, dict) and item.get("type") == "image":
                    image = item["image"].convert("RGB")
                    if image.size != (IMAGE_SIDE, IMAGE_SIDE):
                        raise ValueError(
                            f"a picture of {image.size[0]} x {image.size[1]} pixels: the tiny image task's are "
                            f"{IMAGE_SIDE} x {IMAGE_SIDE} (areal_plugins/tiny/vision_task.py)"
                        )
                    images.append(image)
        return images or None, None, None
