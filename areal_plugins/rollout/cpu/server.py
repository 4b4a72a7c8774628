"""verl's rollout-server contract, served by :class:`ContinuousBatchingEngine` in a Ray actor.

The methods mirror what verl 0.9.1's ``LLMServerClient``, ``RolloutReplica`` and
``CheckpointEngineManager`` call on a vLLM server actor (generate, abort, resume, sleep/wake,
cache control), plus ``update_weights`` that the trainer-side :class:`CPUServerAdapter` calls.
Every response carries the per-token generating versions in ``extra_fields["token_versions"]``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import torch

from areal_plugins.rollout.base import CPUReplicaContract, record_weight_sync, token_budget, version_fields
from areal_plugins.rollout.cpu.engine import STOP_ABORTED, ContinuousBatchingEngine

logger = logging.getLogger(__name__)


def weights_checksum(state_dict: dict[str, torch.Tensor]) -> str:
    """A short digest of a state dict, independent of key order (for the sync handshake)."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class CPURolloutServer(CPUReplicaContract):
    """One rollout server: a model copy on CPU serving token-in/token-out generation.

    Args:
        model_path: Hugging Face model directory.
        response_length: default ``max_tokens`` (verl's ``rollout.response_length``).
        max_model_len: prompt + response limit.
        max_batch_size: most sequences decoded together (verl's ``rollout.max_num_seqs``).
        num_threads: torch intra-op threads of this process.
        seed: sampling seed.
    """

    def __init__(
        self,
        model_path: str,
        response_length: int,
        max_model_len: int,
        max_batch_size: int = 64,
        num_threads: int = 1,
        seed: int = 0,
        replica_rank: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(max(1, num_threads))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(tokenizer.eos_token_id)
        self.engine = ContinuousBatchingEngine(model.eval(), eos_ids, max_batch_size=max_batch_size, seed=seed)
        self.response_length = response_length
        self.max_model_len = max_model_len
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        self._rejecting = False
        self.global_steps = 0
        self.replica_rank = replica_rank
        record_weight_sync(replica_rank, self.engine.version, weights_checksum(model.state_dict()), "load")

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> Any:
        """Token-in/token-out generation with per-token log-probs and versions (verl contract)."""
        from verl.workers.rollout.replica import TokenOutput

        params = dict(sampling_params)
        media = bool(image_data or video_data or audio_data)
        max_tokens = token_budget("areal_cpu", prompt_ids, params, self.max_model_len, self.response_length, media)
        while not self._gate_open.is_set():
            if self._rejecting:
                return TokenOutput(token_ids=[], log_probs=None, stop_reason=STOP_ABORTED, extra_fields=self._extra([]))
            await self._gate_open.wait()
        result = await self.engine.generate(
            prompt_ids,
            max_tokens=max_tokens,
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            request_id=request_id,
        )
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.logprobs if params.get("logprobs") else None,
            stop_reason=result.stop_reason,
            extra_fields=self._extra(result.versions),
        )

    def _extra(self, versions: list[int]) -> dict[str, Any]:
        return version_fields(self.engine.version, versions)

    # ------------------------------------------------------------------ interruption

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the gate and return every in-flight request with its partial output."""
        self._rejecting = reject_request
        self._gate_open.clear()
        request_ids = self.engine.abort_all()
        await self.engine.wait_idle()
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._gate_open.set()

    async def wait_for_requests_to_drain(self) -> None:
        await self.engine.wait_idle()

    # ------------------------------------------------------------------ weights

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Load new weights between decode steps; return the version and weights checksum now served."""
        await asyncio.to_thread(self.engine.load_state_dict, state_dict, version)
        self.global_steps = version
        served = self.engine.model.state_dict()
        checksum = weights_checksum({k: served[k] for k in state_dict})
        record_weight_sync(self.replica_rank, version, checksum, "update")
        return {"version": self.engine.version, "checksum": checksum}

    async def get_version(self) -> int:
        return self.engine.version

    async def get_weights_checksum(self) -> str:
        return weights_checksum(self.engine.model.state_dict())

    async def get_stats(self) -> dict[str, Any]:
        return {
            "generated_tokens": self.engine.generated_tokens,
            "in_flight": self.engine.num_in_flight,
            "busy_s": self.engine.busy_seconds,
            "version": self.engine.version,
        }
