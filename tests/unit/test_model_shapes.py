"""The shipped table of hub models: every row's parameter count against the size its model card publishes, its
source, the names it answers to; a config.json read as its shape; an unknown model refused, never guessed."""

from __future__ import annotations

import json
import re

import pytest

from areal_plugins.planning.hardware import MODELS
from areal_plugins.planning.model_shapes import (
    UnknownModelError,
    from_table,
    resolve,
    resolve_for_plan,
    shape_from_config,
    table,
)

#: Parameters (billions) as each model card publishes them ("Number of Parameters" for Qwen, the model size
#: Hugging Face reports from the safetensors for the others), total and, for a MoE, activated per token. An
#: independent number: the table holds only config.json's keys.
PUBLISHED = {
    "Qwen/Qwen2.5-0.5B": 0.49,
    "Qwen/Qwen2.5-1.5B": 1.54,
    "Qwen/Qwen2.5-Math-1.5B": 1.54,
    "Qwen/Qwen2.5-3B": 3.09,
    "Qwen/Qwen2.5-7B": 7.61,
    "Qwen/Qwen2.5-Math-7B": 7.61,
    "Qwen/Qwen2.5-14B": 14.7,
    "Qwen/Qwen2.5-32B": 32.5,
    "Qwen/Qwen2.5-72B": 72.7,
    "Qwen/Qwen3-0.6B": 0.6,
    "Qwen/Qwen3-1.7B": 1.7,
    "Qwen/Qwen3-4B": 4.0,
    "Qwen/Qwen3-8B": 8.2,
    "Qwen/Qwen3-14B": 14.8,
    "Qwen/Qwen3-32B": 32.8,
    "Qwen/Qwen3-30B-A3B": 30.5,
    "Qwen/Qwen3-235B-A22B": 235.0,
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": 1.78,
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": 7.62,
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": 14.8,
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": 32.8,
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": 8.03,
    "deepseek-ai/DeepSeek-R1-Distill-Llama-70B": 70.6,
    "meta-llama/Llama-3.1-8B": 8.03,
    "meta-llama/Llama-3.1-70B": 70.6,
    "meta-llama/Llama-3.3-70B-Instruct": 70.6,
    "meta-llama/Llama-3.2-1B-Instruct": 1.24,
    "meta-llama/Llama-3.2-3B": 3.21,
    "google/gemma-2-2b": 2.61,
    "google/gemma-2-9b-it": 9.24,
    "google/gemma-2-27b": 27.2,
    "mistralai/Mistral-7B-v0.1": 7.24,
    "mistralai/Mistral-7B-v0.3": 7.25,
    "mistralai/Mistral-Nemo-Base-2407": 12.2,
}
#: A MoE's activated parameters per token (Qwen3 model cards: "3.3B activated", "22B activated").
ACTIVATED = {"Qwen/Qwen3-30B-A3B": 3.3, "Qwen/Qwen3-235B-A22B": 22.0}
#: Biases, norms and the embedding's rounding are left out of the count: within 3% of the published size.
TOLERANCE = 0.03


def test_every_row_has_a_published_size_to_be_held_against():
    assert set(table()) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_derived_parameter_count_matches_the_published_size(name):
    """Catches a wrong width, layer count or tie_word_embeddings: an untied Qwen2.5-1.5B would count 1.78B,
    15% over its published 1.54B."""
    shape = from_table(name).shape
    assert shape.params / 1e9 == pytest.approx(PUBLISHED[name], rel=TOLERANCE)


@pytest.mark.parametrize("name", sorted(ACTIVATED))
def test_a_moe_counts_its_activated_parameters_per_token(name):
    """Qwen3-30B-A3B by hand: 48 layers x (attention 2·2048·4096 + 2·2048·512 = 18,874,368; 8 of 128 experts
    3·2048·768 = 4,718,592 each, 37,748,736; router 2048·128 = 262,144) = 2,724,200,448, + the untied embedding
    and head 2 x 151,936 x 2048 = 622,329,856: 3.35B, the card's 3.3B."""
    shape = from_table(name).shape
    activated = shape.layers * shape.active_layer_params + shape.vocab * shape.hidden * 2
    assert activated / 1e9 == pytest.approx(ACTIVATED[name], rel=TOLERANCE)
    if name == "Qwen/Qwen3-30B-A3B":
        assert activated == 48 * (18_874_368 + 37_748_736 + 262_144) + 622_329_856


def test_qwen25_7b_by_hand():
    """28 layers x (q, o 2·3584² = 25,690,112; k, v 2·3584·512 = 3,670,016; MLP 3·3584·18944 = 203,685,888) =
    6,525,288,448, + embedding and head 2 x 152,064 x 3584 = 1,089,994,752: 7,615,283,200. Hugging Face counts
    7,615,616,512 in the safetensors: the same plus the q, k, v biases 28 x 4608 and the 57 norms of 3584."""
    assert from_table("Qwen/Qwen2.5-7B").shape.params == 7_615_283_200 == 7_615_616_512 - 28 * 4608 - 57 * 3584


@pytest.mark.parametrize("row", sorted(PUBLISHED))
def test_every_row_names_its_published_config_json(row):
    fields = table()[row]
    assert fields["source"] == f"https://huggingface.co/{row}/blob/main/config.json"
    assert fields["read_from"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings"):  # fmt: skip
        assert isinstance(fields[key], int) and fields[key] > 0, key
    assert isinstance(fields["tie_word_embeddings"], bool)


def test_no_name_answers_for_two_rows():
    names = [n.lower() for row, f in table().items() for n in [row, *f.get("aliases", []), *f.get("same_shape", [])]]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[\w.-]+/[\w.-]+", n) for n in names)


@pytest.mark.parametrize("alias", ["1.5b", "7b", "14b", "32b"])
def test_the_planners_shapes_are_the_tables_rows(alias):
    planner = MODELS[alias]
    row = from_table(f"deepseek-ai/DeepSeek-R1-Distill-Qwen-{alias.upper()}").shape
    fields = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "head_size", "params")
    assert [getattr(planner, f) for f in fields] == [getattr(row, f) for f in fields]


def test_names_are_case_blind_and_may_leave_out_the_organisation():
    assert from_table("qwen/qwen2.5-7b").shape.params == from_table("Qwen2.5-7B").shape.params == 7_615_283_200


def test_a_same_shape_fine_tune_has_the_rows_shape_but_no_positions():
    known = from_table("Qwen/Qwen2.5-32B-Instruct")
    assert known.shape.params == from_table("Qwen/Qwen2.5-32B").shape.params
    assert known.shape.max_positions is None and "max_position_embeddings is not in the table" in known.origin
    assert from_table("meta-llama/Llama-3.1-8B-Instruct").shape.max_positions == 131072  # an alias: same file


def test_an_unknown_hub_model_is_refused_naming_model_config():
    with pytest.raises(UnknownModelError, match=r"example-org/NotAModel-7B is neither .* pass --model-config PATH"):
        resolve("example-org/NotAModel-7B")


def test_a_local_folder_and_model_config_are_read(tmp_path):
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 2048}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    # per layer: q, o 2·64·64 = 8,192; k, v 2·64·2·16 = 4,096; MLP 3·64·128 = 24,576 -> 36,864 x 2 = 73,728;
    # untied embedding and head 2·1000·64 = 128,000: 201,728
    for known in (resolve(str(tmp_path)), resolve("Qwen/Qwen2.5-7B", model_config=tmp_path / "config.json")):
        assert known.shape.params == 201_728 and known.shape.max_positions == 2048
    assert resolve("Qwen/Qwen2.5-7B", model_config=tmp_path).origin == f"--model-config {tmp_path}"
    with pytest.raises(UnknownModelError, match=r"--model-config .*missing\.json: no such file"):
        resolve("x", model_config=tmp_path / "missing.json")


def test_a_multimodal_configs_text_config_and_gemmas_tied_default():
    config = {"model_type": "gemma2", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 16, "intermediate_size": 8, "vocab_size": 10}  # fmt: skip
    nested = shape_from_config({"model_type": "gemma3", "text_config": config}, "m")
    # q, o 2·8·(2·16) = 512; k, v 2·8·2·16 = 512 (no num_key_value_heads: as many as the heads); MLP 3·8·8 =
    # 192; the tied embedding 10·8 = 80: 1,296
    assert shape_from_config(config, "m").params == nested.params == 1_296
    assert shape_from_config({**config, "model_type": "llama"}, "m").tied_embeddings is False


def test_a_config_without_a_key_or_with_latent_attention_is_refused():
    with pytest.raises(UnknownModelError, match="no vocab_size"):
        shape_from_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "intermediate_size": 8}, "m")  # fmt: skip
    with pytest.raises(UnknownModelError, match="multi-head latent attention"):
        shape_from_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "intermediate_size": 8, "vocab_size": 10, "kv_lora_rank": 4}, "m")  # fmt: skip


def test_plan_takes_its_aliases_any_table_name_or_a_config(tmp_path):
    assert resolve_for_plan("7b", None) is MODELS["7b"]
    assert resolve_for_plan("Qwen/Qwen3-8B", None).params == from_table("Qwen/Qwen3-8B").shape.params
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "vocab_size": 1000}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_for_plan("7b", tmp_path).hidden == 64  # the config wins over --model's default
    with pytest.raises(UnknownModelError, match="--model-config"):
        resolve_for_plan("llama-9000", None)


@pytest.mark.parametrize("how", ["table", "config", "model-json", "model-folder"])
def test_plan_sizes_a_table_model_or_a_config_json(capsys, tmp_path, how):
    from areal_plugins.cli import main as cli_main

    (tmp_path / "config.json").write_text(json.dumps(table()["Qwen/Qwen3-8B"]))
    config = str(tmp_path / "config.json")
    model, name = {
        "table": (["--model", "Qwen/Qwen3-8B"], "Qwen/Qwen3-8B"),
        "config": (["--model-config", config], config),
        "model-json": (["--model", config], config),
        "model-folder": (["--model", str(tmp_path)], str(tmp_path)),
    }[how]
    assert cli_main(["plan", "--gpus", "8", *model, "--batch", "32", "--group", "8", "--response-mean", "1500",
                     "--max-response", "8192", "--truncated-fraction", "0.002"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"8 x H100 SXM, {name}, 32 prompts x 8") for line in lines), lines
