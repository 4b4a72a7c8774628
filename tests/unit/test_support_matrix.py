"""docs/support.md, checked: every refusal it lists is raised with the text it names, each new refusal has its own
test below, the setups it calls tested or unit-tested name test files that exist, and every "refused" cell points
to a refusal the table lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from areal_plugins.builtin.validation import areal_validate_config
from areal_plugins.cli.preflight import one_line
from areal_plugins.config.settings import ArealConfigError
from tests.unit.test_recipes import compose
from tests.unit.test_refusals import refusal_of, tiny_dirs  # noqa: F401  (tiny_dirs: autouse here too)

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "docs" / "support.md"
RECIPE = "grpo_cpu_async"
#: A Qwen2-MoE's, a Qwen2-VL's, a Qwen3-VL's and an audio model's config.json, as far as the checks read them.
MOE_CONFIG = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 4}
MULTIMODAL_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "vision_config": {"depth": 2},
}
QWEN3_VL_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "vision_config": {"depth": 2},
}
AUDIO_CONFIG = {
    "architectures": ["Qwen2AudioForConditionalGeneration"],
    "model_type": "qwen2_audio",
    "audio_config": {"num_hidden_layers": 2},
}
MIXTRAL_CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 8}
#: The engines in a pool of their own, one CPU engine, weights by our gloo checkpoint engine.
SEPARATE = [
    "areal.placement=separate",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=areal_gloo",
]


@pytest.fixture
def models(tmp_path):
    """The doc's placeholders: model folders whose config.json is a mixture of experts', a vision-language model's
    or an audio model's."""
    folders = {}
    placeholders = (
        ("<moe-model>", MOE_CONFIG),
        ("<multimodal-model>", MULTIMODAL_CONFIG),
        ("<qwen3-vl-model>", QWEN3_VL_CONFIG),
        ("<audio-model>", AUDIO_CONFIG),
        ("<mixtral-model>", MIXTRAL_CONFIG),
    )
    for placeholder, config in placeholders:
        folder = tmp_path / placeholder.strip("<>")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        folders[placeholder] = str(folder)
    return folders


def refusal(overrides: list[str]) -> str:
    """The startup validation's refusal of the recipe with ``overrides``, on one line as the CLI prints it."""
    with pytest.raises(ArealConfigError) as refused:
        areal_validate_config(compose(RECIPE, overrides))
    return one_line(refused.value)


def table_rows(heading: str) -> list[list[str]]:
    """The rows of the first table under ``## heading`` in docs/support.md, cells stripped."""
    text = SUPPORT.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def documented_refusals() -> dict[str, tuple[list[str], str]]:
    refusals = {}
    for identifier, _what, overrides, says in table_rows("Refused at startup"):
        refusals[identifier.strip("`")] = (overrides.strip("`").split(), says.strip("`"))
    return refusals


def test_the_doc_lists_refusals():
    assert len(documented_refusals()) >= 12


@pytest.mark.parametrize("identifier", sorted(documented_refusals()))
def test_every_refusal_the_doc_lists_is_raised_with_the_text_it_names(identifier, models):
    overrides, says = documented_refusals()[identifier]
    overrides = [re.sub(r"<[a-z0-9-]+>", lambda found: models[found.group(0)], override) for override in overrides]
    assert says in refusal(overrides)


def matrix_cells() -> list[str]:
    """The status cells of the matrix tables (every table but the refusals' own): each row's cells after its first
    (the setting's name), header and separator rows left out."""
    text = SUPPORT.read_text().split("\n## Refused at startup\n", 1)[0]
    cells: list[str] = []
    for table in re.findall(r"(?:^\|.*\n)+", text, flags=re.M):
        for row in table.splitlines()[2:]:
            cells.extend(cell.strip() for cell in row.strip("|").split("|")[1:])
    return cells


def test_every_refused_cell_points_to_a_listed_refusal():
    listed = set(documented_refusals())
    pointed = [found for cell in matrix_cells() for found in re.findall(r"refused \(`([a-z0-9-]+)`\)", cell)]
    assert set(pointed) <= listed, sorted(set(pointed) - listed)
    assert listed <= set(pointed), f"refusals no cell points to: {sorted(listed - set(pointed))}"


def test_every_cell_is_tested_unit_tested_or_refused_and_names_tests_that_exist():
    cells = matrix_cells()
    assert len(cells) >= 30
    for cell in cells:
        assert cell.startswith(("tested: ", "unit-tested at the seam: ", "refused (")), cell
        if not cell.startswith("refused"):
            named = re.findall(r"`(tests/[\w/]+\.py)`", cell)
            assert named, f"a tested cell names its test: {cell!r}"
            for path in named:
                assert (REPO / path).is_file(), f"{cell!r} names {path}, which does not exist"


# ------------------------------------------------------------------ one test per refusal this file added


def test_verls_fsdp_engines_run_and_another_trainer_engine_is_refused_naming_the_key():
    # fsdp (FSDP1, verl's default) and fsdp2: one engine class in verl, our loss, micro-batches and progress reports
    # patched into it; CI trains with both (docs/support.md, Trainer engines), in either placement.
    separate = [
        "areal.placement=separate",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=areal_gloo",
    ]
    for strategy in ("fsdp", "fsdp2"):
        engine = [f"actor_rollout_ref.actor.strategy={strategy}", f"actor_rollout_ref.ref.strategy={strategy}"]
        areal_validate_config(compose(RECIPE, engine))
        areal_validate_config(compose(RECIPE, [*engine, *separate]))
        areal_validate_config(compose(RECIPE, [*engine, *separate, "actor_rollout_ref.rollout.name=vllm"]))
        areal_validate_config(compose(RECIPE, [*engine, "areal.mode=sync"]))
    for strategy in ("megatron", "veomni"):
        line = refusal([f"actor_rollout_ref.actor.strategy={strategy}"])
        assert f"actor_rollout_ref.actor.strategy={strategy} is not a trainer engine" in line
        assert "no CPU build to test on here" in line
        assert "set actor_rollout_ref.actor.strategy=fsdp2 (or fsdp, verl's default)" in line
    areal_validate_config(compose(RECIPE, ["actor_rollout_ref.actor.strategy=megatron", "areal.enable=false"]))


def test_the_trainer_engine_refusal_comes_out_of_the_cli_in_one_line(caplog):
    """Megatron's config adds a logging handler while the recipe is checked: the refusal is still one line."""
    line = refusal_of(caplog, REPO / "recipes" / f"{RECIPE}.yaml", "actor_rollout_ref.actor.strategy=megatron")
    assert "set actor_rollout_ref.actor.strategy=fsdp2" in line


def test_float16_training_is_refused_bf16_and_fp32_are_not():
    line = refusal(["actor_rollout_ref.actor.fsdp_config.model_dtype=fp16"])
    assert "set actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 or fp32" in line
    areal_validate_config(compose(RECIPE, ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"]))


def test_lora_runs_adapter_only_or_merged_in_either_placement():
    areal_validate_config(compose(RECIPE, ["actor_rollout_ref.model.lora_rank=8"]))
    areal_validate_config(compose(RECIPE, ["actor_rollout_ref.model.lora_rank=8", "areal.mode=sync"]))
    # Adapter-only in the engines' own pool: our patch sends the adapter through the checkpoint engine (verl issue
    # #7495 is what it replaces: patches/lora_separate_sync.py), the patch selected for the trainer's workers.
    from areal_plugins.patches import enabled_patches, lora_separate_sync

    adapter_separate = compose(RECIPE, ["actor_rollout_ref.model.lora_rank=8", *SEPARATE])
    areal_validate_config(adapter_separate)
    assert lora_separate_sync in enabled_patches(adapter_separate)
    assert lora_separate_sync not in enabled_patches(compose(RECIPE, ["actor_rollout_ref.model.lora_rank=8"]))
    # Merged, every update carries full weights: accepted in either placement, on either engine; no patch.
    merged = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true"]
    areal_validate_config(compose(RECIPE, merged))
    areal_validate_config(compose(RECIPE, [*merged, *SEPARATE]))
    areal_validate_config(compose(RECIPE, [*merged, *SEPARATE, "actor_rollout_ref.rollout.name=vllm"]))
    assert lora_separate_sync not in enabled_patches(compose(RECIPE, [*merged, *SEPARATE]))
    waived = "areal.waive_capabilities=[abort_keeps_partial,weight_checksum,progress_stats]"
    line = refusal(["actor_rollout_ref.rollout.name=sglang", waived, "actor_rollout_ref.model.lora_rank=8"])
    assert "(lora_adapter_check)" in line and "set actor_rollout_ref.model.lora_rank=0" in line


def test_a_backend_without_the_adapter_check_is_refused_lora(monkeypatch):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    monkeypatch.setattr(CPURolloutServer, "capabilities", CPURolloutServer.capabilities - {"lora_adapter_check"})
    assert "lora_adapter_check" in refusal(["actor_rollout_ref.model.lora_rank=8"])
    assert "lora_adapter_check" in refusal(["actor_rollout_ref.model.lora.rank=4"])  # verl's other spelling


def test_a_mixture_of_experts_runs_on_areal_cpu_and_vllm_and_is_refused_where_experts_go_unchecked(models):
    moe = f"actor_rollout_ref.model.path={models['<moe-model>']}"
    areal_validate_config(compose(RECIPE, [moe]))
    areal_validate_config(compose(RECIPE, [moe, "actor_rollout_ref.rollout.name=vllm"]))
    waived = "areal.waive_capabilities=[abort_keeps_partial,weight_checksum,progress_stats]"
    line = refusal(["actor_rollout_ref.rollout.name=sglang", waived, moe])
    assert "(moe_weight_check)" in line and "set actor_rollout_ref.rollout.name=areal_cpu" in line


def test_a_model_not_on_disk_yet_is_not_read():
    """The tiny model is built after the startup checks: a path with no config.json is no refusal."""
    areal_validate_config(compose(RECIPE, ["actor_rollout_ref.rollout.name=vllm"]))


def test_router_replay_is_refused_where_the_engine_returns_no_routed_experts():
    replay = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    waived = "areal.waive_capabilities=[abort_keeps_partial,weight_checksum,progress_stats]"
    line = refusal(["actor_rollout_ref.rollout.name=sglang", waived, replay])
    assert "(routed_experts)" in line and "areal_cpu" not in line  # never a CPU engine suggested to a GPU user
    areal_validate_config(compose(RECIPE, [replay]))  # areal_cpu returns them
    # verl's vllm returns them; on the CPU build only eager (compiled, every route comes back 0).
    vllm = ["actor_rollout_ref.rollout.name=vllm", replay]
    areal_validate_config(compose(RECIPE, [*vllm, "actor_rollout_ref.rollout.enforce_eager=true"]))
    assert "set actor_rollout_ref.rollout.enforce_eager=true" in refusal(vllm)
    gpu = ["trainer.device=cuda", "actor_rollout_ref.rollout.enforce_eager=false"]
    areal_validate_config(compose(RECIPE, [*vllm, *gpu]))  # on CUDA vLLM's MoE layer runs the capture compiled too


def test_router_replay_runs_on_the_models_the_trainer_replays_and_is_refused_elsewhere(models):
    replay = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    areal_validate_config(compose(RECIPE, [replay, f"actor_rollout_ref.model.path={models['<moe-model>']}"]))
    line = refusal([replay, f"actor_rollout_ref.model.path={models['<mixtral-model>']}"])
    assert "on a model of type 'mixtral'" in line and "enable_rollout_routing_replay=false" in line
    line = refusal([replay, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert "set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1" in line
    areal_validate_config(compose(RECIPE, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]))


def test_a_vision_language_model_runs_on_areal_cpu_and_is_refused_where_images_or_its_family_are_not_served(models):
    path = f"actor_rollout_ref.model.path={models['<multimodal-model>']}"
    areal_validate_config(compose(RECIPE, ["actor_rollout_ref.rollout.name=areal_cpu", path]))  # Qwen2-VL
    line = refusal(["actor_rollout_ref.rollout.name=vllm", path])
    assert "(images)" in line and "set actor_rollout_ref.rollout.name=areal_cpu" in line
    # On GPUs the CPU box's engine is no advice: verl's own trainer is what runs a VLM there.
    line = refusal(["actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda", path])
    assert "(images)" in line and "set areal.enable=false" in line and "rollout.name=areal_cpu" not in line
    qwen3_vl = f"actor_rollout_ref.model.path={models['<qwen3-vl-model>']}"
    line = refusal(["actor_rollout_ref.rollout.name=areal_cpu", qwen3_vl])
    assert "of type 'qwen3_vl'" in line and "serves the vision-language models qwen2_vl" in line
    audio = f"actor_rollout_ref.model.path={models['<audio-model>']}"
    for backend in ("areal_cpu", "vllm"):
        assert "(audio)" in refusal([f"actor_rollout_ref.rollout.name={backend}", audio])


def test_a_checkpoint_engine_we_cannot_check_is_refused_and_ours_pass():
    separate = [
        "areal.placement=separate",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    ]
    for backend in ("nixl", "mooncake", "kimi_ckpt_engine", "delta_sharded"):
        line = refusal([*separate, f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}"])
        assert f"checkpoint_engine.backend={backend} delivers weights that areal_async cannot check" in line
    for backend in ("nccl", "areal_gloo"):
        areal_validate_config(
            compose(RECIPE, [*separate, f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}"])
        )


def test_a_checkpoint_engine_between_colocated_engines_and_the_trainer_is_refused():
    line = refusal(["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"])
    assert "set actor_rollout_ref.rollout.checkpoint_engine.backend=naive, or areal.placement=separate" in line


def test_every_shipped_recipe_passes_the_matrix():
    from areal_plugins.builtin.validation import check_support_matrix

    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        if not recipe.name.startswith("_"):
            check_support_matrix(compose(recipe.stem))


def test_lora_runs_on_verls_vllm_in_either_placement_and_fully_sharded_adapters_are_refused():
    vllm_lora = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.lora_rank=8"]
    areal_validate_config(compose(RECIPE, vllm_lora))
    areal_validate_config(compose(RECIPE, [*vllm_lora, *SEPARATE]))
    line = refusal([*vllm_lora, "++actor_rollout_ref.model.lora.fully_sharded_loras=true"])
    assert "set actor_rollout_ref.model.lora.fully_sharded_loras=false" in line


def test_lora_on_a_mixture_of_experts_is_refused_on_either_engine(models):
    moe = f"actor_rollout_ref.model.path={models['<moe-model>']}"
    for engine in ("areal_cpu", "vllm"):
        line = refusal([f"actor_rollout_ref.rollout.name={engine}", moe, "actor_rollout_ref.model.lora_rank=8"])
        assert "on a mixture-of-experts model (num_experts=4" in line and "lora_rank=0" in line
        areal_validate_config(compose(RECIPE, [f"actor_rollout_ref.rollout.name={engine}", moe]))  # without LoRA


def readme_cells() -> list[str]:
    """The status cells (every column but the first) of the README's support table."""
    text = (REPO / "README.md").read_text()
    table = text.split("| setup | `areal_cpu`", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    return [cell.strip() for row in rows for cell in row.strip("|").split("|")[1:]]


def test_every_readme_cell_names_a_test_that_exists_or_a_refusal_the_matrix_lists():
    tests = {path.stem for path in (REPO / "tests").rglob("test_*.py")}
    listed = set(documented_refusals())
    cells = readme_cells()
    assert len(cells) >= 18, cells
    for cell in cells:
        named = re.findall(r"`(test_\w+)`", cell)
        refused = [found for found in re.findall(r"`([a-z0-9-]+)`", cell) if found in listed]
        ran = re.search(r"\b(CI|full|seam)\b", cell)
        assert named or refused or "not run" in cell or cell.startswith("refused (same)"), f"README cell {cell!r}"
        assert not (ran and not named), f"README cell {cell!r} says it runs but names no test"
        assert set(named) <= tests, f"README cell {cell!r} names {sorted(set(named) - tests)}, which do not exist"
        if cell.startswith("refused ("):
            assert refused or cell == "refused (same)", f"README cell {cell!r} names no refusal docs/support.md lists"
