"""LoRA under ``areal_async`` on ``areal_cpu`` and verl's ``vllm``, in both placements: the tiny model trains
an adapter through verl 0.9.1's FSDP2 engine (peft's ``get_peft_model``), and every weight update after the first
carries the adapter alone, loaded into the engine's LoRA layers and checked tensor by tensor (docs/design.md, LoRA).
The CI run on ``areal_cpu`` is test_async_trainer.py's η = 1 run (a LoRA adapter, so it shares that verl start).

What the records say, derived from verl's ``engine_workers.update_weights``: with ``rollout.load_format: dummy``
(verl's default) the trainer's ``base_sync_done`` starts false, so the first update (version 0, before step 1) sends
the base weights once (the server's ``update`` record) and then the adapter; every later update sends the adapter
only. Each adapter update gives the server's ``update_adapter`` record and our trainer-side adapter's
``update_checked`` record once the check passed. The tiny Qwen2 under ``target_modules: all-linear`` has 28 adapter
tensors: 2 layers x 7 linear modules (q, k, v, o, gate, up, down) x 2 (``lora_A``, ``lora_B``).

In CI, two runs: test_async_trainer.py's η = 1 run (colocated, ``areal_cpu``, clean, every update checked) and
the last test below (verl's ``vllm`` in its own pool, through ``areal_gloo``), which a tensor corrupted in its LoRA
slot stops. LoRA colocated on verl's vLLM, adapter-only in the separate placement on ``areal_cpu``, a tensor
corrupted on arrival, merged LoRA and η = 0 against synchronous verl with LoRA are in the ``full`` tier (the
receiving check itself, with dropped, renamed and corrupted tensors: tests/unit/test_cpu_lora.py).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import read_jsonl, run_cli, train_args, train_tiny

pytestmark = pytest.mark.integration

STEPS = 3
RECIPE = "grpo_cpu_async.yaml"
LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16")
ADAPTER_TENSORS = 2 * 7 * 2
#: The base parameters areal_cpu re-checks on each adapter update: 2 layers x 12 (q, k, v weights and biases, o, gate,
#: up, down, two norms), the embedding, the final norm and the tied lm_head under its own name.
BASE_PARAMETERS = 2 * 12 + 3
CORRUPTED = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


def assert_the_adapter_trained_and_the_base_stayed(run_dir, versions: list[int], slept: bool = True) -> None:
    """Each version's adapter differs from the one before (peft starts ``lora_B`` at zero, so version 0's adapter
    changes nothing; the optimizer moves it from step 1 on), and the engines slept before each later update
    (colocated, ``rollout.free_cache_engine: true``) keeping the base weights through it: verl sends them once (the
    full-weight runs free them: test_placements.py)."""
    loaded = [r for r in read_jsonl(run_dir / "weight_syncs.jsonl") if r["event"] == "update_adapter"]
    digests = [r["checksum"]["adapter"] for r in loaded if r["version"] in versions]
    assert len(digests) == len(versions) and len(set(digests)) == len(digests), loaded
    events = [e for e in read_jsonl(run_dir / "replica_events.jsonl") if e["replica"] == 0]
    updates = [i for i, e in enumerate(events) if e["event"] == "update" and 1 <= e["version"] <= versions[-1]]
    assert [events[i]["version"] for i in updates] == versions[1:], events
    for i in updates:
        assert events[i]["adapter"] is True
        if slept:  # colocated: the engines slept between updates (standalone ones never sleep)
            sleep = [e for e in events[:i] if e["event"] == "sleep"][-1]
            assert sleep["released"] is True and sleep["weight_bytes"] > 0, sleep


def assert_stopped_at_update_naming(result, version: int, fault: str) -> None:
    """The run failed, naming replica 0, engine rank 0, the update to weight version ``version`` and ``fault``."""
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert f"rollout replica 0, engine rank 0, update {version}: {fault}" in output, output[-3000:]


@pytest.mark.full
def test_an_adapter_tensor_corrupted_on_arrival_stops_the_run_naming_it(tiny_dir, tmp_path):
    """The server's updates count 1 (the base weights, version 0), 2 (version 0's adapter), 3 (version 1's), 4
    (version 2's, after step 2): from the fourth on, one value of ``CORRUPTED`` changes on arrival (fault injection
    on the receiving side, rollout/cpu/server.py), and the run must stop at that update naming the replica, the
    engine rank and the tensor, before step 2's metrics are written. Before it, the run is a clean LoRA run's first
    two updates: the base weights once, then adapters alone, each checked, the adapter moved by step 1."""
    run_dir = tmp_path / "run"
    result = run_cli(
        *train_args(
            RECIPE,
            run_dir,
            tiny_dir,
            STEPS,
            *LORA,
            f"++ray_kwargs.ray_init.runtime_env.env_vars.AREAL_CORRUPT_RECEIVED_WEIGHT='{CORRUPTED}@4'",
        ),
        check=False,
    )
    assert_stopped_at_update_naming(
        result, 2, f"adapter tensor {CORRUPTED} arrived different from what the trainer sent"
    )
    syncs = read_jsonl(run_dir / "weight_syncs.jsonl")
    checked = [r for r in syncs if r["event"] == "update_checked"]
    assert [r["version"] for r in checked] == [0, 1], syncs
    expected = {
        "adapter_tensors": ADAPTER_TENSORS,
        "adapter_ranks": 1,
        "adapter_only": True,
        "base_rechecked": BASE_PARAMETERS,
    }
    assert all(r["checksum"] == expected for r in checked), checked
    assert [r["version"] for r in syncs if r["event"] == "update_adapter"] == [0, 1, 2], syncs  # 2: loaded, refused
    assert [r["version"] for r in syncs if r["event"] == "update"] == [0], syncs  # the base weights, once
    assert_the_adapter_trained_and_the_base_stayed(run_dir, [0, 1])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    assert [json.loads(line)["data"]["training/global_step"] for line in lines if line.strip()] == [1]


#: The tiny Qwen2's adapter in bytes, by hand: rank 8 x (in + out) per module, per layer q 128+128, k 128+64,
#: v 128+64, o 128+128, gate 128+256, up 128+256, down 256+128 (2,048), 2 layers, fp32: 8 x 2,048 x 2 x 4.
ADAPTER_BYTES = 8 * 2048 * 2 * 4
#: Its base weights as verl's FSDP engine sends them (peft's ``.base_layer`` names): 2,401,408 parameters (the embedding
#: 16,448 x 128, per layer 147,968, the final norm 128) plus the tied ``lm_head`` sent again (16,448 x 128), fp32.
BASE_BYTES = (2_401_408 + 16_448 * 128) * 4


def assert_the_base_crossed_once_then_the_adapter_alone(run_dir) -> None:
    """What the checkpoint engine staged per worker for versions 0-2 of a separate-placement LoRA run, against
    :data:`ADAPTER_BYTES` and :data:`BASE_BYTES`: the base, a marker and the adapter at version 0, the adapter alone
    (with its header) after."""
    sent = {r["version"]: r["staged_bytes_per_worker"] for r in read_jsonl(run_dir / "weight_transfers.jsonl")}
    header = sent[1] - ADAPTER_BYTES  # the LoRA update's header (peft's config, pickled)
    assert 0 < header < 4096 and header % 16 == 0 and sent[2] == sent[1], sent
    assert sent[0] == BASE_BYTES + 16 + ADAPTER_BYTES + header, sent  # 16: the marker between base and adapter


@pytest.mark.full  # CI's separate-placement LoRA run is on verl's vLLM (the last test)
def test_lora_adapter_only_in_the_separate_placement_every_update_checked_and_a_bad_tensor_stops_it(tiny_dir, tmp_path):
    """Engines in their own pool (``areal_gloo``), adapter-only LoRA: verl 0.9.1 sends only base weights on this
    path (verl issue #7495); ours (patches/lora_separate_sync.py) sends the base once (``load_format: dummy``) and then
    the adapter alone, checked on arrival and in its slots as colocated. The server's updates count 1 (the base, v0),
    2 (v0's adapter), 3 (v1's), 4 (v2's), 5 (v3's, after step 3): from the fifth one value of ``CORRUPTED`` changes on
    arrival, so three steps train and the last update stops the run naming the tensor. What crossed the transport
    each update is counted by hand (:data:`ADAPTER_BYTES`, :data:`BASE_BYTES`)."""
    run_dir = tmp_path / "run"
    result = run_cli(
        *train_args(
            "grpo_cpu_async_separate.yaml",
            run_dir,
            tiny_dir,
            STEPS,
            *LORA,
            f"++ray_kwargs.ray_init.runtime_env.env_vars.AREAL_CORRUPT_RECEIVED_WEIGHT='{CORRUPTED}@5'",
        ),
        check=False,
    )
    fault = "arrived different from what the trainer sent"
    assert_stopped_at_update_naming(result, 3, f"adapter tensor {CORRUPTED} {fault}")
    steps = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [s["training/global_step"] for s in steps] in ([1, 2], [1, 2, 3])  # step 3's line may race the failed sync
    syncs = read_jsonl(run_dir / "weight_syncs.jsonl")
    assert [r["version"] for r in syncs if r["event"] == "update"] == [0], syncs  # the base weights, once
    checked = [r for r in syncs if r["event"] == "update_checked"]
    assert [r["version"] for r in checked] == [0, 1, 2], syncs
    assert all(r["checksum"]["adapter_only"] and r["checksum"]["adapter_tensors"] == ADAPTER_TENSORS for r in checked)
    assert_the_adapter_trained_and_the_base_stayed(run_dir, [0, 1, 2], slept=False)
    assert_the_base_crossed_once_then_the_adapter_alone(run_dir)


#: The tensor whose LoRA slot is changed after loading in the verl-vLLM run (a value the forward pass reads).
CORRUPTED_IN_SLOT = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"


@pytest.mark.full  # CI's colocated LoRA run is test_async_trainer.py's, on areal_cpu
def test_lora_on_verls_vllm_checks_every_adapter_update_and_stops_on_a_bad_slot(tiny_dir, tmp_path):
    """verl's ``vllm`` rollout (CPU build, ``.venv-verl-vllm``), colocated: verl's vLLM server loads the adapter with
    ``add_lora``, our worker extension reads every adapter tensor back from the LoRA slots the forward pass uses,
    and our server adapter compares them with what the trainer sent (rollout/verl_vllm/loaded_adapter.py,
    weight_sync/adapter_check.py). vLLM starts from dummy weights (verl's ``load_format: dummy``), so the worker's
    updates are 1: the base weights under peft's ``.base_layer`` names (version 0, checked as full weights), 2:
    version 0's adapter, 3: version 1's, 4: version 2's, after step 2. From the fourth on one value of
    ``CORRUPTED_IN_SLOT``'s slot changes after loading (fault injection in the worker): the run must stop at that
    update naming the replica, the engine rank and the tensor."""
    from tests.integration.test_verl_vllm import assert_loaded_check_covers_the_tiny_model, train_with_verl_vllm

    run_dir = tmp_path / "run"
    result = train_with_verl_vllm(
        run_dir,
        tiny_dir,
        STEPS,
        *LORA,
        f"++ray_kwargs.ray_init.runtime_env.env_vars.AREAL_CORRUPT_LOADED_WEIGHT='{CORRUPTED_IN_SLOT}@4'",
    )
    assert_stopped_at_update_naming(
        result, 2, f"adapter tensor {CORRUPTED_IN_SLOT} is held as other values than it arrived as"
    )
    checked = [r for r in read_jsonl(run_dir / "weight_syncs.jsonl") if r["event"] == "update_checked"]
    base = [r for r in checked if not r["checksum"].get("adapter_only")]
    adapters = [r for r in checked if r["checksum"].get("adapter_only")]
    # The base weights once, before the first adapter, and checked as full weights.
    assert [r["version"] for r in base] == [0], checked
    assert_loaded_check_covers_the_tiny_model(base[0]["checksum"])
    # Every adapter update before the corrupted one: all 28 tensors compared on the replica's one vLLM worker.
    assert [r["version"] for r in adapters] == [0, 1], checked
    # ... and the base re-checked on each: every parameter the base load compared, against what it held then.
    rechecked = base[0]["checksum"]["loaded_compared"]
    expected = {"adapter_tensors": ADAPTER_TENSORS, "adapter_ranks": 1, "workers": [0], "adapter_only": True}
    assert all(r["checksum"] == {**expected, "base_rechecked": rechecked} for r in adapters), adapters
    actors = {record["class_name"] for record in read_jsonl(run_dir / "ray_actors.jsonl")}
    assert "ArealVLLMHttpServer" in actors, actors
    steps = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [s["training/global_step"] for s in steps] in ([1], [1, 2])  # step 2's line may race the failing sync
    assert any(s["areal/gen_tokens_per_s"] > 0 for s in steps)


@pytest.mark.full
@pytest.mark.parametrize("recipe", ["grpo_cpu_async.yaml", "grpo_cpu_async_separate.yaml"])
def test_lora_merged_sends_full_weights_each_update_in_either_placement(recipe, tiny_dir, tmp_path):
    """``lora.merge: true``: verl merges the adapter into the base weights for each update (its FSDP engine's
    ``_merged_lora_per_tensor_param``, in bf16) and sends full weights, colocated through verl's direct sync and in
    the engines' own pool through the checkpoint engine (``areal_gloo``): the way LoRA reaches engines in their own
    pool, since verl 0.9.1's checkpoint-engine path sends no adapter alone (verl issue #7495). Every update is a
    full-weight one, checked as a dense model's, and the weights the engine holds move from version 1 on (the
    adapter trained: merged into the same base, equal adapters would give equal weights)."""
    run_dir = tmp_path / "run"
    steps = train_tiny(recipe, run_dir, tiny_dir, STEPS, *LORA, "actor_rollout_ref.model.lora.merge=true")
    assert [s["training/global_step"] for s in steps] == list(range(1, STEPS + 1))
    syncs = read_jsonl(run_dir / "weight_syncs.jsonl")
    assert not [r for r in syncs if r["event"] in ("update_adapter", "update_checked") and "adapter" in str(r)]
    updates = [r for r in syncs if r["event"] == "update"]
    assert [r["version"] for r in updates] == list(range(STEPS + 1)), syncs
    assert len({r["checksum"] for r in updates}) == STEPS + 1, updates


@pytest.mark.full
@pytest.mark.parametrize("recipe", ["grpo_cpu_async.yaml", "grpo_cpu_async_vllm.yaml"])
def test_lora_merged_reaches_verls_vllm_as_checked_full_weights_in_either_placement(recipe, tiny_dir, tmp_path):
    """``lora.merge: true`` on verl's ``vllm``, colocated and in the engines' own pool: verl starts vLLM without LoRA
    (its server's ``lora_as_adapter`` is false when merged) and every update is the merged full weights, checked
    on each vLLM worker after loading as a dense model's (test_verl_vllm.py's runs); in the own pool they are
    broadcast by ``areal_gloo`` and their broadcast leg is checked too."""
    from tests.integration.test_verl_vllm import assert_loaded_check_covers_the_tiny_model, train_with_verl_vllm

    run_dir = tmp_path / "run"
    result = train_with_verl_vllm(
        run_dir, tiny_dir, STEPS, *LORA, "actor_rollout_ref.model.lora.merge=true", recipe=recipe
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    checked = [r for r in read_jsonl(run_dir / "weight_syncs.jsonl") if r["event"] == "update_checked"]
    assert [r["version"] for r in checked] == list(range(STEPS + 1)), checked
    for record in checked:
        assert not record["checksum"].get("adapter_only"), record
        assert_loaded_check_covers_the_tiny_model(record["checksum"])
        # The base model's own names (the merge removes peft's ``base_layer``), none of them an adapter's.
        assert not any(
            "base_layer" in name or "lora_" in name for name in record["checksum"]["loaded_not_compared_examples"]
        )
    if recipe == "grpo_cpu_async_vllm.yaml":  # 27 tensors broadcast and compared on their way
        transfers = read_jsonl(run_dir / "weight_transfers.jsonl")
        assert [t["version"] for t in transfers] == list(range(STEPS + 1)), transfers
        assert all(t["transfer_checked_tensors"] == 27 for t in transfers), transfers


@pytest.mark.full
def test_lora_at_eta0_trains_the_samples_and_losses_of_synchronous_verl_with_lora(
    tiny_dir, distinct_prompts, tmp_path_factory
):
    """Synchronous verl (``grpo_cpu_sync``: our features off) and ``areal_async`` at η = 0, both training the same
    adapter from the same seeds: the same samples at each step, each generated by the step's own adapter, and
    losses within float tolerance (verl's vanilla PPO against our decoupled objective, whose weights are 1 at
    η = 0): asynchrony at η = 0 changes nothing under LoRA either.

    Both runs set verl's ``full_determinism``, which seeds the trainer before peft draws ``lora_A``: without it the
    initial adapter is drawn from the process's random state, different in every run (measured: the same samples,
    the same step-1 loss, since ``lora_B`` starts at zero, and gradient norms 1-3% apart)."""
    from tests.integration.conftest import assert_float32_losses_match, assert_same_samples_each_step, run_with_dump

    seeded = (*LORA, "actor_rollout_ref.actor.fsdp_config.full_determinism=true")
    sync = run_with_dump("grpo_cpu_sync.yaml", tiny_dir, tmp_path_factory, distinct_prompts, *seeded)
    eta0 = run_with_dump(
        "grpo_cpu_async.yaml", tiny_dir, tmp_path_factory, distinct_prompts, *seeded, "areal.max_staleness=0"
    )
    assert_same_samples_each_step(sync, eta0)
    for sample in read_jsonl(eta0 / "areal_samples.jsonl"):
        assert sample["head_version"] == sample["tail_version"] == sample["step"] - 1
    # Both trained the adapter alone, checked on every update (the sync run through the same server adapter).
    for run in (sync, eta0):
        checked = [r for r in read_jsonl(run / "weight_syncs.jsonl") if r["event"] == "update_checked"]
        assert checked and all(r["checksum"].get("adapter_only") for r in checked), checked
    assert_float32_losses_match(*([line["data"] for line in read_jsonl(run / "metrics.jsonl")] for run in (sync, eta0)))


def test_lora_adapter_only_on_verls_vllm_in_its_own_pool_every_update_checked_and_a_bad_slot_stops_it(
    tiny_dir, tmp_path
):
    """verl's ``vllm`` (CPU build) in a pool of its own, adapter-only LoRA through ``areal_gloo``
    (patches/lora_separate_sync.py; verl 0.9.1 sends only base weights on this path, verl issue #7495): the base
    once, under peft's ``.base_layer`` names, checked as full weights; then every update the adapter alone, all 28
    tensors read back from vLLM's LoRA slots and the base re-checked each time; what crossed per update counted by
    hand (:data:`ADAPTER_BYTES`, :data:`BASE_BYTES`). The worker's updates count 1 (the base, v0), 2 (v0's adapter),
    3 (v1's), 4 (v2's), 5 (v3's, after step 3): from the fifth one value of ``CORRUPTED_IN_SLOT``'s slot changes
    after loading (fault injection in the worker), so three steps train and the last update stops the run naming
    the replica, the engine rank and the tensor. CI's one run of LoRA on verl's vLLM and of LoRA in the separate
    placement: the two tests above (colocated on verl's vLLM, separate on ``areal_cpu``) are the full tier's."""
    from tests.integration.test_verl_vllm import assert_loaded_check_covers_the_tiny_model, train_with_verl_vllm

    run_dir = tmp_path / "run"
    result = train_with_verl_vllm(
        run_dir,
        tiny_dir,
        STEPS,
        *LORA,
        f"++ray_kwargs.ray_init.runtime_env.env_vars.AREAL_CORRUPT_LOADED_WEIGHT='{CORRUPTED_IN_SLOT}@5'",
        recipe="grpo_cpu_async_vllm.yaml",
    )
    fault = "is held as other values than it arrived as"
    assert_stopped_at_update_naming(result, 3, f"adapter tensor {CORRUPTED_IN_SLOT} {fault}")
    steps = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [s["training/global_step"] for s in steps] in ([1, 2], [1, 2, 3])  # step 3's line may race the failed sync
    checked = [r for r in read_jsonl(run_dir / "weight_syncs.jsonl") if r["event"] == "update_checked"]
    base = [r for r in checked if not r["checksum"].get("adapter_only")]
    adapters = [r for r in checked if r["checksum"].get("adapter_only")]
    assert [r["version"] for r in base] == [0], checked
    assert_loaded_check_covers_the_tiny_model(base[0]["checksum"])
    assert [r["version"] for r in adapters] == [0, 1, 2], checked
    expected = {"adapter_tensors": ADAPTER_TENSORS, "adapter_ranks": 1, "workers": [0], "adapter_only": True}
    rechecked = base[0]["checksum"]["loaded_compared"]
    assert all(r["checksum"] == {**expected, "base_rechecked": rechecked} for r in adapters), adapters
    assert_the_base_crossed_once_then_the_adapter_alone(run_dir)
