"""Qwen2-VL's processor for images only, written into the tiny vision-language model's folder as its processor code.

transformers' ``Qwen2VLProcessor`` needs a video processor, and Qwen2-VL's video processor needs torchvision, which
has no CPU build on the CPU box (PyPI's is built for CUDA and fails to import on the CPU torch). This subclass takes
the image processor and the tokenizer alone; everything else is Qwen2-VL's own, so verl (which binds the model's
``get_rope_index`` to a processor by its class name, ``Qwen2VLProcessor``) treats it as Qwen2-VL's. The model folder
names it in ``processor_config.json`` (``auto_map``), which needs ``actor_rollout_ref.model.trust_remote_code=true``.
"""

from transformers.models.qwen2_vl import processing_qwen2_vl
from transformers.processing_utils import ProcessorMixin


class Qwen2VLProcessor(processing_qwen2_vl.Qwen2VLProcessor):
    """Qwen2-VL's processor without a video processor (videos are refused by the engine anyway)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.video_processor = None
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
