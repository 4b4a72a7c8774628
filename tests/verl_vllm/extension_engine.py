"""A vLLM CPU engine in this process with our worker extension, updated as verl's colocated sync updates it: the one
engine the LoRA and MoE checks in a real vLLM engine share (test_vllm_lora_check.py, test_vllm_moe_check.py,
test_vllm_moe_lora.py)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from areal_plugins.rollout.verl_vllm import worker_extension


class ExtensionEngine:
    """``vllm.LLM`` on ``model`` (dummy weights, float32, eager) with ``options`` added (LoRA's, say)."""

    def __init__(self, model: Path, **options: Any) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=str(model),
            load_format="dummy",
            max_model_len=64,
            max_num_seqs=2,
            dtype="float32",
            enforce_eager=True,
            seed=0,
            worker_extension_cls=f"{worker_extension.__name__}.ArealVLLMWorkerExtension",
            **options,
        )
        self.handle = self.llm.collective_rpc("_get_zmq_handle")[0]

    def update(
        self, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any] | None = None, adapter_only: bool = False
    ) -> dict:
        """One update as verl's colocated sync sends it (``adapter_only``: verl's ``base_sync_done``, the adapter
        alone); this worker's report."""
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

        def send() -> None:
            sender = BucketedWeightSender(zmq_handle=self.handle, bucket_size_mb=16, use_shm=True)
            asyncio.run(sender.async_send_weights(iter([(n, t.clone()) for n, t in tensors.items()])))

        sender = threading.Thread(target=send, daemon=True)  # a receiver that failed leaves it waiting
        sender.start()
        try:
            self.llm.collective_rpc(
                "update_weights_from_ipc",
                kwargs={"peft_config": peft_config, "base_sync_done": adapter_only, "use_shm": True},
            )
        finally:
            sender.join(timeout=60)
        return self.llm.collective_rpc("areal_weight_report")[0]


EngineT = TypeVar("EngineT", bound=ExtensionEngine)


@contextmanager
def started(engine_class: type[EngineT], model: Path, job: str, **options: Any) -> Iterator[EngineT]:
    """``engine_class`` on ``model`` in this process (no engine subprocess, a 1 GiB KV cache), with its own
    transfer socket (named by ``job``), removed afterwards."""
    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    patch.setenv("VERL_RAY_JOB_ID", f"{job}-{os.getpid()}")
    engine = None
    try:
        engine = engine_class(model, **options)
        yield engine
    finally:
        patch.undo()
        if engine is not None:  # the sender's ipc socket file stays behind otherwise
            Path(engine.handle.removeprefix("ipc://")).unlink(missing_ok=True)
