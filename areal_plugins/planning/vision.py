"""A vision-language model's vision tower, from its ``config.json``'s ``vision_config``: its parameters and how many
image tokens and patches an image of ``max_pixels`` becomes. Pure arithmetic (no transformers, no torch).

The families sized are the Qwen vision towers vLLM and verl run (transformers 5.10's
``models/qwen2_vl/modeling_qwen2_vl.py``, ``qwen2_5_vl/modeling_qwen2_5_vl.py``, ``qwen3_vl/modeling_qwen3_vl.py``;
``qwen3_vl_moe`` shares Qwen3-VL's tower). Each is a ViT over patches of ``patch_size`` x ``patch_size`` pixels
(x ``temporal_patch_size`` frames: an image is repeated to fill them), whose merger folds
``spatial_merge_size`` x ``spatial_merge_size`` patches into one token of the language model: an image of ``P``
pixels is ``P / (patch_size x spatial_merge_size)²`` tokens of the prompt (Qwen2-VL's ``smart_resize`` rounds each
side to a multiple of ``patch_size x spatial_merge_size`` and keeps the area at most ``max_pixels``). A tower of
another family is refused by the caller (``check`` and ``plan`` never size by a guess).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The ``model_type`` values whose vision tower this module counts.
SIZED_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
#: The image processor's default ``max_pixels`` when neither the recipe (``data.mm_processor_kwargs.max_pixels``)
#: nor the model's ``preprocessor_config.json`` gives one: Qwen2-VL's ``Qwen2VLImageProcessor`` default,
#: ``size.longest_edge`` = 28 x 28 x 1280 (transformers 5.10, ``image_processing_qwen2_vl.py:95``).
PROCESSOR_DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class VisionShape:
    """A Qwen-family vision tower (every field named as ``vision_config`` names it, or derived)."""

    family: str  # the model's model_type
    depth: int  # vision blocks
    hidden: int  # the ViT's width (Qwen2-VL: embed_dim)
    intermediate: int  # the block MLP's width (Qwen2-VL: embed_dim x mlp_ratio)
    heads: int
    out_hidden: int  # the language model's width the merger projects to
    patch: int  # patch_size (pixels a side)
    merge: int  # spatial_merge_size (patches a side folded into one token)
    temporal_patch: int  # temporal_patch_size (frames a patch spans)
    in_channels: int = 3
    gated_mlp: bool = False  # Qwen2.5-VL: gate, up, down; Qwen2-VL and Qwen3-VL: fc1, fc2
    norm_bias: bool = True  # LayerNorm (weight and bias); Qwen2.5-VL's RMSNorm has a weight only
    patch_bias: bool = False  # Qwen3-VL's patch embedding has a bias
    position_embeddings: int = 0  # Qwen3-VL's learned position table (num_position_embeddings)
    deepstack_mergers: int = 0  # Qwen3-VL: one more merger per deepstack_visual_indexes entry

    @property
    def patch_params(self) -> int:
        """The patch embedding: a Conv3d of kernel temporal_patch x patch x patch over ``in_channels``."""
        kernel = self.in_channels * self.temporal_patch * self.patch * self.patch
        return kernel * self.hidden + (self.hidden if self.patch_bias else 0)

    @property
    def block_params(self) -> int:
        """One block: two norms, qkv and proj (with biases), the MLP (with biases)."""
        h, width = self.hidden, self.intermediate
        norms = 2 * h * (2 if self.norm_bias else 1)
        attention = (3 * h * h + 3 * h) + (h * h + h)
        mlp = (2 if self.gated_mlp else 1) * (h * width + width) + (width * h + h)
        return norms + attention + mlp

    def _merger_params(self, norm_width: int) -> int:
        context = self.hidden * self.merge * self.merge
        norm = norm_width * (2 if self.norm_bias else 1)
        return norm + (context * context + context) + (context * self.out_hidden + self.out_hidden)

    @property
    def merger_params(self) -> int:
        """The merger (its norm over the ViT's width, then two linears over the folded patches) and Qwen3-VL's
        deepstack mergers (their norm over the folded width)."""
        context = self.hidden * self.merge * self.merge
        return self._merger_params(self.hidden) + self.deepstack_mergers * self._merger_params(context)

    @property
    def params(self) -> int:
        """Every parameter of the tower: patch embedding, position table, blocks, mergers."""
        return (
            self.patch_params
            + self.position_embeddings * self.hidden
            + self.depth * self.block_params
            + self.merger_params
        )

    @property
    def pixels_per_token(self) -> int:
        """Pixels of an image per token of the language model: (patch x merge)²."""
        return (self.patch * self.merge) ** 2

    def image_tokens(self, max_pixels: int) -> int:
        """Tokens of the prompt an image of at most ``max_pixels`` pixels becomes, at most."""
        return max_pixels // self.pixels_per_token

    def patches(self, tokens: int) -> int:
        """Patches the tower encodes for ``tokens`` image tokens of the prompt (merge² each)."""
        return tokens * self.merge * self.merge


def _first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is None:
        raise KeyError(keys[0])
    return default


def vision_from_config(config: dict[str, Any]) -> VisionShape | None:
    """The vision tower of a ``config.json`` (None: no ``vision_config``).

    Raises:
        ValueError: a ``vision_config`` of a family this module does not size, or one missing a key it needs;
            the message names the family and the key.
    """
    vision = config.get("vision_config")
    if not vision:
        return None
    family = str(config.get("model_type") or "")
    if family not in SIZED_FAMILIES:
        raise ValueError(
            f"a vision tower of model_type {family!r} (vision_config) is not sized by areal_plugins' check and plan "
            f"(sized: {', '.join(SIZED_FAMILIES)})"
        )
    try:
        common: dict[str, Any] = {
            "family": family,
            "depth": int(vision["depth"]),
            "heads": int(vision["num_heads"]),
            "patch": int(_first(vision, "patch_size", "spatial_patch_size", default=14)),
            "merge": int(_first(vision, "spatial_merge_size", default=2)),
            "temporal_patch": int(_first(vision, "temporal_patch_size", default=2)),
            "in_channels": int(_first(vision, "in_channels", "in_chans", default=3)),
        }
        if family == "qwen2_vl":  # embed_dim wide, an fc1/fc2 MLP of embed_dim x mlp_ratio; hidden_size: the LM's
            width = int(vision["embed_dim"])
            return VisionShape(
                **common,
                hidden=width,
                intermediate=int(width * float(_first(vision, "mlp_ratio", default=4))),
                out_hidden=int(vision["hidden_size"]),
            )
        if family == "qwen2_5_vl":  # RMSNorm, a gated MLP
            return VisionShape(
                **common,
                hidden=int(vision["hidden_size"]),
                intermediate=int(vision["intermediate_size"]),
                out_hidden=int(vision["out_hidden_size"]),
                gated_mlp=True,
                norm_bias=False,
            )
        return VisionShape(  # qwen3_vl, qwen3_vl_moe
            **common,
            hidden=int(vision["hidden_size"]),
            intermediate=int(vision["intermediate_size"]),
            out_hidden=int(vision["out_hidden_size"]),
            patch_bias=True,
            position_embeddings=int(_first(vision, "num_position_embeddings", default=0)),
            deepstack_mergers=len(vision.get("deepstack_visual_indexes") or ()),
        )
    except KeyError as missing:
        raise ValueError(f"vision_config of a {family} model has no {missing.args[0]}") from None
