"""Which model a run trains, and its shape: a ``config.json`` (``--model-config``, or the recipe's
``actor_rollout_ref.model.path`` when it is a local folder), else the shipped table of hub models
(``model_shapes.yaml``, one row per published ``config.json``, each naming its source).

A model in none of them is refused with a line naming ``--model-config``: ``check`` and ``plan`` never size a run
by a guess. Rows' ``same_shape`` fine-tunes get the row's shape but no ``max_position_embeddings`` (no source we
read gives theirs), so the position check says it needs their ``config.json``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from areal_plugins.planning.hardware import MODELS, ModelShape
from areal_plugins.planning.vision import vision_from_config

TABLE_FILE = Path(__file__).with_name("model_shapes.yaml")
#: The planner's short names (the paper's R1-Distill-Qwen models), kept as aliases of ``plan --model``.
PLANNER_ALIASES = {
    "1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "14b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
    "32b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
}
#: Model types whose transformers config class ties the embeddings when config.json does not say (Gemma's do;
#: Qwen2, Qwen3, Llama and Mistral default to untied).
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")
#: Model types whose attention normalises each head's q and k (transformers' ``Qwen3Attention.q_norm``, ``k_norm``).
_QK_NORM = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe")
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
ASK_FOR_CONFIG = "pass --model-config PATH (the model's config.json, from its hub page or its folder)"


class UnknownModelError(ValueError):
    """A model whose shape neither a ``config.json`` nor the table gives; ``str()`` is the one line to show."""


@dataclass(frozen=True)
class KnownModel:
    """A model's shape and where it came from (``shape.max_positions`` is None where no source gives it)."""

    shape: ModelShape
    origin: str


def shape_from_config(config: dict[str, Any], name: str) -> ModelShape:
    """A ``ModelShape`` from a Hugging Face ``config.json``: a multimodal one's ``text_config``, and its
    ``vision_config``'s tower (:mod:`areal_plugins.planning.vision`).

    Raises:
        UnknownModelError: a key the sizing needs is missing, an attention the formulas do not cover (MLA), or a
            vision tower of a family they do not cover.
    """
    text = config.get("text_config") or config
    missing = [key for key in _REQUIRED if key not in text]
    if missing:
        raise UnknownModelError(f"{name}: config.json has no {', '.join(missing)}; {ASK_FOR_CONFIG}")
    if "kv_lora_rank" in text:
        raise UnknownModelError(
            f"{name}: multi-head latent attention (kv_lora_rank) is not sized by areal_plugins' check; "
            "check this model on its cluster instead"
        )
    heads = int(text["num_attention_heads"])
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    model_type = str(config.get("model_type") or text.get("model_type") or "")
    tied_default = model_type in _TIED_BY_DEFAULT
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", tied_default))
    positions = text.get("max_position_embeddings")
    try:
        vision = vision_from_config(config)
    except ValueError as error:
        raise UnknownModelError(f"{name}: {error}; check this model on its cluster instead") from None
    return ModelShape(
        name=name,
        hidden=int(text["hidden_size"]),
        layers=int(text["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        intermediate=int(text["intermediate_size"]),
        vocab=int(text["vocab_size"]),
        head_dim=int(text["head_dim"]) if text.get("head_dim") else None,
        tied_embeddings=bool(tied),
        experts=experts,
        experts_per_token=int(text.get("num_experts_per_tok") or 0) if experts else 0,
        # Mixtral's experts are intermediate_size wide; Qwen3-MoE names them moe_intermediate_size
        moe_intermediate=int(text.get("moe_intermediate_size") or text["intermediate_size"]) if experts else 0,
        max_positions=int(positions) if positions else None,
        qk_norm=model_type in _QK_NORM,
        vision=vision,
    )


@functools.cache
def table() -> dict[str, dict[str, Any]]:
    """The shipped rows by hub id, as ``model_shapes.yaml`` has them."""
    return dict(yaml.safe_load(TABLE_FILE.read_text())["models"])


@functools.cache
def _index() -> dict[str, tuple[str, bool]]:
    """Lower-cased hub id (and the part after the organisation) -> (row, positions known)."""
    index: dict[str, tuple[str, bool]] = {}
    for row, fields in table().items():
        names = [(row, True)] + [(n, True) for n in fields.get("aliases", [])]
        names += [(n, False) for n in fields.get("same_shape", [])]
        for name, positions in names:
            index[name.lower()] = (row, positions)
    short: dict[str, list[tuple[str, bool]]] = {}
    for name, found in list(index.items()):
        short.setdefault(name.rsplit("/", 1)[-1], []).append(found)
    index |= {name: found[0] for name, found in short.items() if len(found) == 1 and name not in index}
    return index


def from_table(name: str) -> KnownModel | None:
    """The table's model ``name`` names (a hub id, case-insensitive, with or without its organisation)."""
    found = _index().get(name.strip().strip("/").lower())
    if found is None:
        return None
    row, positions = found
    fields = table()[row]
    shape = shape_from_config(fields, row if positions else name)
    if positions:
        return KnownModel(shape, f"{row}'s config.json ({fields['source']})")
    return KnownModel(
        replace(shape, max_positions=None),
        f"the shape of {row} ({fields['source']}); {name}'s own max_position_embeddings is not in the table",
    )


def read_config(path: Path) -> dict[str, Any]:
    """A ``config.json``: the file itself, or the one in the folder ``path``."""
    file = path.expanduser() / "config.json" if path.expanduser().is_dir() else path.expanduser()
    if not file.is_file():
        raise UnknownModelError(f"--model-config {path}: no such file (give a config.json or a folder holding one)")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UnknownModelError(f"--model-config {path}: not a readable config.json ({error})") from None
    if not isinstance(config, dict):
        raise UnknownModelError(f"--model-config {path}: a config.json holds one JSON object, not {type(config)}")
    return config


def resolve(model_path: str, model_config: Path | None = None) -> KnownModel:
    """The shape of the model a recipe trains: ``model_config`` if given, else ``model_path``'s own
    ``config.json`` when it is a local folder, else the table.

    Raises:
        UnknownModelError: none of them knows the model (the line names ``--model-config``).
    """
    if model_config is not None:
        file = model_config.expanduser()
        return KnownModel(shape_from_config(read_config(file), model_path), f"--model-config {model_config}")
    folder = Path(model_path).expanduser()
    if (folder / "config.json").is_file():
        return KnownModel(shape_from_config(read_config(folder), folder.name), f"{folder / 'config.json'}")
    known = from_table(model_path)
    if known is None:
        raise UnknownModelError(
            f"{model_path} is neither a local folder with config.json nor a hub model in areal_plugins' table "
            f"({TABLE_FILE.name}, {len(table())} models): {ASK_FOR_CONFIG}"
        )
    return known


def resolve_for_plan(name: str, model_config: Path | None) -> ModelShape:
    """``plan --model``: the planner's short names (its fitted shapes), any table name, a ``config.json`` or a folder
    holding one; or ``--model-config``, which wins."""
    if model_config is not None:
        return shape_from_config(read_config(model_config), str(model_config))
    given = Path(name).expanduser()
    if given.is_file() or (given / "config.json").is_file():
        return shape_from_config(read_config(given), name)
    if name.lower() in MODELS:
        return MODELS[name.lower()]
    return resolve(PLANNER_ALIASES.get(name.lower(), name)).shape
