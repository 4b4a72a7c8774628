from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A Ray of this process's own for one test module (``address="local"``: never a cluster already running).

    Its workers at the driver's priority: Ray lowers theirs by 15 by default, and with the unit tier's files running in
    parallel (pytest-xdist) a busy file beside this one then starves them (an actor's start measured at 2 min)."""
    import ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


@pytest.fixture(scope="session")
def random_qwen2():
    """A randomly initialised tiny Qwen2 (no tokenizer needed), in eval mode."""
    from areal_plugins.tiny.model import TinyModelSpec, random_qwen2

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    return random_qwen2(spec, vocab_size=256).eval()


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The tiny tokenizer truncated to 4,096 ranks (plus its special tokens)."""
    from transformers import AutoTokenizer

    from areal_plugins.tiny.tokenizer import write_tokenizer

    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, 4096)
    return AutoTokenizer.from_pretrained(out)


def wait_until(condition, timeout_s: float = 10.0, what: str = "the condition") -> None:
    """Poll ``condition`` until it holds: a readiness signal instead of a fixed sleep (a busy 2-core box
    may take far longer than a sleep assumes). Fails naming ``what`` after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.01)


def replica_lists(server_manager):
    """The run's :class:`ReplicaLists` over ``server_manager`` (a stand-in of verl's ``LLMServerManager``) and verl's
    own ``CheckpointEngineManager``, built as driver/placements.py builds it: holding the server manager's very list
    (``replicas=server_manager.get_replicas()``). Returns (lists, checkpoint manager)."""
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    from areal_plugins.driver.replica_lists import ReplicaLists

    checkpoints = CheckpointEngineManager(CheckpointEngineConfig(backend="naive"), None, server_manager.get_replicas())
    return ReplicaLists(lambda: server_manager, lambda: checkpoints), checkpoints


@pytest.fixture
def paced_backend(monkeypatch):
    """The bench's paced engine (``tools/areal_bench``) as rollout backend ``areal_paced``, for one test only: our
    backends and any of verl's rollout registries imported already are restored afterwards."""
    import sys

    from areal_plugins.rollout import verl_registration

    monkeypatch.setattr(verl_registration, "BACKENDS", dict(verl_registration.BACKENDS))
    adapters = getattr(sys.modules.get("verl.workers.rollout.base"), "_ROLLOUT_REGISTRY", None)
    if adapters is not None:  # restored as it was (without the name) afterwards
        monkeypatch.setitem(adapters, ("areal_paced", "async"), verl_registration.ADAPTER_FQN)
    replicas = getattr(sys.modules.get("verl.workers.rollout.replica"), "RolloutReplicaRegistry", None)
    if replicas is not None:
        monkeypatch.setitem(replicas._registry, "areal_paced", None)
    from areal_bench import verl_backend

    verl_backend.register()
    return verl_backend.BACKEND
