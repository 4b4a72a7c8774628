"""A tensor larger than the transfer bucket, through the path ``areal_gloo`` takes to verl's vLLM workers.

The trainer's rank 0 broadcasts over a real ``areal_gloo`` group (two threads, one sender and one rollout worker
that stages the update), the rollout worker hands the staged tensors to our server adapter, and verl's own bucketed
sender moves them over ZMQ and shared memory (this machine has no CUDA IPC) to verl's bucketed receiver, driven by
our worker extension: both of verl's loading paths, the per-bucket one a GPU takes and the CPU build's gathered
reload. The bucket is the recipe key ``checkpoint_engine.update_weights_bucket_megabytes`` at 1 MB, smaller than
the tiny model's embedding (16,448 x 128 float32: 8.4 MB), so that tensor must cross in pieces.

Needs vLLM importable (verl's adapter and extension modules import it), so it runs in ``.venv-verl-vllm``. No engine
is started: the model the worker loads into is the tiny model itself, given vLLM's ``load_weights``, and the server
actor is an object with the methods verl's adapter calls.
"""

from __future__ import annotations

import asyncio
import json
import threading
import types

import pytest
import ray
import torch
import zmq
from verl.workers.config import RolloutConfig
from verl.workers.config.rollout import CheckpointEngineConfig

from areal_plugins.platforms.ports import free_port_outside_ephemeral_range
from areal_plugins.rollout.verl_vllm.adapter import ArealServerAdapter
from areal_plugins.rollout.verl_vllm.worker_extension import ArealVLLMWorkerExtension
from areal_plugins.tiny.model import WORKLOADS, random_qwen2
from areal_plugins.weight_sync.gloo import register_gloo_checkpoint_engine
from areal_plugins.weight_sync.split_tensors import JOINS_PIECES_KEY

BUCKET_MB = 1
SPEC = WORKLOADS["addition"]
VOCAB = SPEC.tokenizer_ranks + 64  # the tiny tokenizer's ranks and room for its special tokens


def trainer_weights() -> dict[str, torch.Tensor]:
    model = random_qwen2(SPEC, vocab_size=VOCAB)
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


def engine_model() -> torch.nn.Module:
    """The tiny model with other values, loading as a vLLM model does (``load_weights`` of named tensors)."""
    model = random_qwen2(type(SPEC)(seed=SPEC.seed + 1), vocab_size=VOCAB)
    parameters = dict(model.named_parameters())

    def load_weights(weights):
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                parameters[name].copy_(tensor)  # a name no parameter has fails here, as in vLLM's Qwen2
                loaded.add(name)
        return loaded

    model.load_weights = load_weights
    return model


class Server:
    """The server actor as verl's adapter calls it; its one vLLM worker is ``worker``, receiving in a thread."""

    def __init__(self, worker: ArealVLLMWorkerExtension) -> None:
        self.worker = worker

        def call(method, timeout=None, args=(), kwargs=None):
            loop = asyncio.get_running_loop()
            done = loop.create_future()

            def run() -> None:
                try:
                    result = getattr(worker, method)(*args, **(kwargs or {}))
                except BaseException as error:  # handed to the awaiting adapter, as Ray hands a task's error
                    loop.call_soon_threadsafe(done.set_exception, error)
                else:
                    loop.call_soon_threadsafe(done.set_result, result)

            threading.Thread(target=run, daemon=True).start()  # daemon: a receiver left waiting cannot hold pytest
            return done

        async def nothing(*args, **kwargs):
            return None

        async def reports():
            return [worker.areal_weight_report()]

        self.collective_rpc = types.SimpleNamespace(remote=call)
        self.clear_kv_cache = types.SimpleNamespace(remote=nothing)
        self.set_global_steps = types.SimpleNamespace(remote=nothing)
        self.areal_weight_reports = types.SimpleNamespace(remote=reports)


def vllm_worker(model: torch.nn.Module, zmq_handle: str) -> ArealVLLMWorkerExtension:
    """Our extension as vLLM's worker holds it: its model runner, device and verl's flags, ZMQ on the adapter's path."""
    worker = ArealVLLMWorkerExtension.__new__(ArealVLLMWorkerExtension)
    parameters = dict(model.named_parameters())

    def reload_weights(weights_iterator):  # the CPU build's reload: every tensor at once
        model.load_weights(weights_iterator)

    model_config = types.SimpleNamespace(
        dtype=torch.float32,
        hf_config=types.SimpleNamespace(tie_word_embeddings=True),
        word_embeddings_untied_by_checkpoint=False,  # read by vLLM's after-load step (GPU path), as is:
        quantization=None,
    )
    worker.model_runner = types.SimpleNamespace(
        model=model,
        reload_weights=reload_weights,
        vllm_config=types.SimpleNamespace(model_config=model_config, quant_config=None, speculative_config=None),
    )
    worker.device = torch.device("cpu")
    worker.local_rank = worker.rank = 0
    worker._is_qat_model = worker._is_modelopt_qat = False
    worker._get_zmq_handle = lambda: zmq_handle
    assert parameters  # the engine holds every parameter it will be sent
    return worker


@pytest.fixture
def transfer(monkeypatch, tmp_path):
    """Send the tiny model trainer -> areal_gloo -> adapter -> verl's bucketed transport -> our extension; return
    what the trainer sent and the engine's model after the update."""
    import vllm.distributed.parallel_state as parallel_state

    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_job_id=lambda: "01000000"))
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("AREAL_RUN_DIR", str(tmp_path))
    context = zmq.Context.instance()  # verl's sender and receiver share it: a lost answer fails in 60 s, not never
    context.setsockopt(zmq.RCVTIMEO, 60_000)
    register_gloo_checkpoint_engine()
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    engine_cls = CheckpointEngineRegistry._registry["areal_gloo"]

    def run(
        platform_is_cpu: bool, marked: bool = True
    ) -> tuple[dict[str, torch.Tensor], torch.nn.Module, ArealServerAdapter]:
        from vllm.platforms import current_platform

        monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: platform_is_cpu)
        config = RolloutConfig(
            name="vllm",
            tensor_model_parallel_size=1,  # one vLLM worker: the one this test drives
            checkpoint_engine=CheckpointEngineConfig(backend="areal_gloo", update_weights_bucket_megabytes=BUCKET_MB),
            custom={JOINS_PIECES_KEY: True} if marked else None,  # set by our trainers (use_checked_vllm_replicas)
        )
        bucket_bytes = config.checkpoint_engine.update_weights_bucket_megabytes << 20  # as verl's worker sizes it
        sent = trainer_weights()
        assert max(t.numel() * t.element_size() for t in sent.values()) > bucket_bytes  # the case under test
        master = {"host": "127.0.0.1", "port": free_port_outside_ephemeral_range()}
        sender, receiver = engine_cls(bucket_bytes, is_master=True), engine_cls(bucket_bytes)
        failures: list[BaseException] = []

        def trainer_rank_0() -> None:
            try:
                sender.init_process_group(0, 2, master)
                asyncio.run(sender.send_weights(iter(sent.items()), global_steps=1))
            except BaseException as error:
                failures.append(error)

        thread = threading.Thread(target=trainer_rank_0, daemon=True)
        thread.start()
        receiver.init_process_group(1, 2, master)
        receiver.stage(1)  # areal_async's order: the whole update staged and checked, then loaded
        thread.join(60)
        assert not failures and not thread.is_alive()

        adapter = ArealServerAdapter(config, types.SimpleNamespace(), None)
        model = engine_model()
        adapter.server_handle = Server(vllm_worker(model, adapter.zmq_handle))
        asyncio.run(adapter.update_weights(receiver.receive_weights(1), global_steps=1))
        return sent, model

    yield run
    context.setsockopt(zmq.RCVTIMEO, -1)


@pytest.mark.parametrize("platform_is_cpu", [False, True], ids=["per-bucket load (GPU path)", "CPU build reload"])
def test_a_tensor_larger_than_the_bucket_arrives_whole_and_checked(transfer, tmp_path, platform_is_cpu):
    sent, model = transfer(platform_is_cpu)
    held = dict(model.named_parameters())
    assert sorted(held) == sorted(sent)
    for name, tensor in sent.items():
        assert torch.equal(held[name], tensor), name  # the embedding too: every piece in its place
    # The adapter compared every whole tensor's checksum (sent before cutting, received after joining) and what the
    # worker holds after loading: one record of the checked update.
    (record,) = [json.loads(line) for line in (tmp_path / "weight_syncs.jsonl").read_text().splitlines()]
    assert record["event"] == "update_checked" and record["checksum"]["tensors"] == len(sent)
    assert record["checksum"]["loaded_compared"] == len(sent)
    # Of the tiny model's tensors only the embedding (8.4 MB) exceeds 1 MB (the next largest, a 128 x 256 float32
    # MLP matrix, is 128 KiB): it alone crossed in pieces.
    assert record["checksum"]["joined"] == ["model.embed_tokens.weight"]


def test_without_the_mark_nothing_is_cut(transfer):
    # verl's own trainers (their workers run verl's extension, which would not join pieces): the adapter hands
    # verl's sender the tensors as they are, and verl refuses the large one over shared memory as it always did.
    with pytest.raises(AssertionError, match="too large to fit in the bucket"):
        transfer(True, marked=False)


def test_our_trainers_mark_the_rollout_config_for_every_worker():
    from omegaconf import OmegaConf

    from areal_plugins.rollout.verl_vllm.server import use_checked_vllm_replicas

    rollout = OmegaConf.create({"name": "vllm", "custom": {"areal_seeded_sampling": True}})
    OmegaConf.set_struct(rollout, True)  # as verl's composed config: new keys refused outside open_dict
    use_checked_vllm_replicas(rollout)
    assert OmegaConf.to_container(rollout.custom) == {"areal_seeded_sampling": True, JOINS_PIECES_KEY: True}
    bare = OmegaConf.create({"name": "vllm"})  # verl's rollout.yaml declares no custom node
    OmegaConf.set_struct(bare, True)
    use_checked_vllm_replicas(bare)
    assert OmegaConf.to_container(bare.custom) == {JOINS_PIECES_KEY: True}


@pytest.mark.parametrize(
    ("use_shm", "device", "fails"),
    [
        (False, "meta", False),  # a device tensor over CUDA IPC (a GPU's colocated sync): verl's direct path carries it
        (False, "cpu", True),  # a host tensor (what areal_gloo delivers) has no device IPC handle to rebuild
        (True, "meta", True),  # over shared memory verl's sender refuses any tensor larger than its bucket
        (True, "cpu", True),
    ],
)
def test_which_tensors_verls_direct_path_cannot_carry(use_shm, device, fails):
    """``_direct_path_fails`` branches on where the tensor lies, not on the platform: its GPU side (a device tensor,
    no shared memory) runs here with a tensor on the ``meta`` device standing in for one on a GPU."""
    adapter = ArealServerAdapter.__new__(ArealServerAdapter)
    adapter.use_shm = use_shm
    assert adapter._direct_path_fails(torch.empty(4, device=device)) is fails
