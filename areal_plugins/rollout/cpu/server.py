"""The ``areal_cpu`` rollout server: :class:`ContinuousBatchingEngine` behind verl's server contract.

Sleep releases what a GPU engine releases: the KV caches (held only by in-flight requests, which
must be aborted first) and the weights' storage; the next weight update allocates and fills them
again. Checksums of the served weights answer every update (the sync handshake).

Under LoRA (``actor_rollout_ref.model.lora_rank > 0``, ``lora.merge: false``) verl sends the base weights once and
then the adapter only (docs/design.md, LoRA): :meth:`CPURolloutServer.update_adapter` loads it into peft's LoRA layers
(rollout/cpu/lora.py) and answers with what each adapter tensor holds after loading, which the trainer's adapter
compares with what it sent (weight_sync/adapter_check.py). Sleep then keeps the base weights: they would not come
back (verl's vLLM server sleeps at level 1 under LoRA, keeping them in host memory, where these already are).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import torch

from areal_plugins.rollout.base import (
    RolloutServer,
    record_replica_event,
    record_weight_sync,
)
from areal_plugins.rollout.cpu import lora
from areal_plugins.rollout.cpu.engine import ContinuousBatchingEngine
from areal_plugins.rollout.cpu.experts import held_tensor
from areal_plugins.rollout.cpu.vision import load_model
from areal_plugins.testing.faults import fault_plan
from areal_plugins.testing.holds import finish_first_groups
from areal_plugins.weight_sync.errors import WeightSyncError


def weights_checksum(state_dict: dict[str, torch.Tensor]) -> str:
    """A short digest of a state dict, independent of key order (for the sync handshake)."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class CPURolloutServer(RolloutServer):
    """One rollout server: a model copy on CPU serving token-in/token-out generation.

    Args:
        model_path: Hugging Face model directory.
        response_length: default ``max_tokens`` (verl's ``rollout.response_length``).
        max_model_len: prompt + response limit.
        max_batch_size: most sequences decoded together (verl's ``rollout.max_num_seqs``).
        num_threads: torch intra-op threads of this process.
        seed: sampling seed.
        replica_rank: this replica's index (names its records).
        free_cache_engine: verl's ``rollout.free_cache_engine``: whether sleep releases memory.
        batch_invariant: each request decoded alone (:class:`ContinuousBatchingEngine`): the same tokens and
            log-probs bit for bit whatever else is in flight.
        finish_groups_per_version: for tests that need requests cut by a weight update on any machine: only the
            first this many prompt groups of each weight version finish, the others are held after
            ``hold_others_at_token`` tokens (:mod:`areal_plugins.testing.holds`). None: every request runs.
        hold_others_at_token: see ``finish_groups_per_version``.
        routed_experts: verl's ``rollout.enable_rollout_routing_replay``: every response carries the experts a
            mixture-of-experts model routed each token to (``TokenOutput.routed_experts``, as verl's vLLM server
            returns them).
        test_router_choice_bias: for tests of router replay, ``[expert, bias]``: the routers prefer ``expert`` by
            ``bias`` (logits) in their choice only (:mod:`areal_plugins.testing.router_bias`). None: as the model is.
        lora_adapter: the trainer trains a LoRA adapter and sends it alone (``actor_rollout_ref.model.lora_rank >
            0`` with ``lora.merge: false``; the replica sets it): sleep keeps the base weights, which verl sends once.
        trust_remote_code: verl's ``model.trust_remote_code``, for a vision-language model's processor.

    The tests' fault plan (:mod:`areal_plugins.testing.faults`) may slow every model step
    (``AREAL_TEST_ENGINE_STEP_DELAY_S``: the test suite run with slow engines, CONTRIBUTING.md) and change what
    arrives of each weight update, as a bad transport would.
    """

    backend_name = "areal_cpu"
    releases_memory_on_sleep = True
    #: Beside the contract's: router replay (the engine records each token's experts), every tensor, expert
    #: tensors included, in the checksum that answers each update, every LoRA adapter tensor's checksum after
    #: loading in the reply to each adapter update (:meth:`update_adapter`), and validation requests admitted ahead of
    #: the training backlog, never held (:meth:`ContinuousBatchingEngine.generate`'s ``validation``).
    capabilities = RolloutServer.capabilities | {
        "routed_experts",
        "moe_weight_check",
        "lora_adapter_check",
        "validation_first",
        "images",
    }
    #: ``engine_kwargs.areal_cpu`` keys (verl_registration.ENGINE_OPTIONS and this backend's own).
    engine_options = (
        "num_threads",
        "max_batch_size",
        "batch_invariant",
        "finish_groups_per_version",
        "hold_others_at_token",
        "test_router_choice_bias",
    )

    def __init__(
        self,
        model_path: str,
        response_length: int,
        max_model_len: int,
        max_batch_size: int = 64,
        num_threads: int = 1,
        seed: int = 0,
        replica_rank: int = 0,
        free_cache_engine: bool = False,
        ignore_eos: bool = False,
        batch_invariant: bool = False,
        finish_groups_per_version: int | None = None,
        hold_others_at_token: int = 1,
        routed_experts: bool = False,
        lora_adapter: bool = False,
        test_router_choice_bias: tuple[int, float] | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoTokenizer

        torch.set_num_threads(max(1, num_threads))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model, image_prompts = load_model(model_path, trust_remote_code)
        if test_router_choice_bias is not None:  # tests: routes that differ from the trainer's by construction
            from areal_plugins.testing.router_bias import install_router_choice_bias

            expert, bias = test_router_choice_bias
            install_router_choice_bias(model, int(expert), float(bias))
        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(tokenizer.eos_token_id)
        holds = finish_first_groups(finish_groups_per_version, hold_others_at_token)
        self.engine = ContinuousBatchingEngine(
            model.eval(),
            eos_ids,
            max_batch_size=max_batch_size,
            seed=seed,
            batch_invariant=batch_invariant,
            holds=holds,
            step_delay_s=fault_plan().engine_step_delay_s,
            routed_experts=routed_experts,
            image_prompts=image_prompts,
        )
        self.response_length = response_length
        self.max_model_len = max_model_len
        self._init_gate(free_cache_engine)
        self.global_steps = 0
        self.replica_rank = replica_rank
        self.ignore_eos = ignore_eos
        self.lora_adapter = lora_adapter
        self.updates = 0  # weight updates received (base weights and adapters), for fault injection
        self.base_kept = lora.keep_base(model)  # each adapter update re-checks the base against the last full load
        record_weight_sync(replica_rank, self.engine.version, weights_checksum(model.state_dict()), "load")

    # ------------------------------------------------------------------ generation

    async def _generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        params: dict[str, Any],
        request_id: str,
        validation: bool = False,
        images: list[Any] | None = None,
    ):
        return await self.engine.generate(
            prompt_ids,
            max_tokens=max_tokens,
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            ignore_eos=bool(params.get("ignore_eos", False)),
            request_id=request_id,
            seed=params.get("seed"),
            validation=validation,
            images=images,
        )

    @property
    def served_version(self) -> int:
        return self.engine.version

    # ------------------------------------------------------------------ interruption

    async def _abort_in_flight(self) -> list[str]:
        request_ids = self.engine.abort_all()
        await self.engine.wait_idle()
        return request_ids

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        aborted = self.engine.abort(request_id)
        return {"aborted": aborted, "request_id": request_id} | ({} if aborted else {"error": "not in flight"})

    async def _resume_engine(self) -> None:
        if not self.engine.has_weights:
            raise WeightSyncError(
                f"replica {self.replica_rank} was asked to resume generation while asleep with no weights loaded "
                "since: the weight update must come before resume_generation"
            )

    async def wait_for_requests_to_drain(self) -> None:
        await self.engine.wait_idle()

    # ------------------------------------------------------------------ memory

    async def _release_memory(self, weights: bool = True) -> None:
        in_flight = self.engine.num_in_flight
        if in_flight:
            raise RuntimeError(
                f"replica {self.replica_rank}: sleep or KV-cache release with {in_flight} requests in flight; "
                "verl aborts them first (abort_all_requests)"
            )
        # Idle: no request holds a KV cache; the weights' storage goes too unless only the cache was asked.
        # A request arriving before the next update fails with that reason (the engine checks).
        if weights and not self.lora_adapter:
            await asyncio.to_thread(self.engine.release_weights)

    async def _restore_memory(self, tags: set[str]) -> None:
        # KV caches are allocated per request; weights' storage comes back with the next update_weights,
        # which fills it (a GPU engine's wake-up allocates it, then the update writes it).
        return None

    def _memory(self) -> dict[str, int]:
        return {"weight_bytes": self.engine.weight_bytes(), "kv_cache_bytes": self.engine.kv_cache_bytes()}

    async def clear_kv_cache(self) -> None:
        """Nothing to drop: the engine keeps no prefix cache, each request's KV cache ends with the request."""

    # ------------------------------------------------------------------ weights

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Load new weights between decode steps; return the version and weights checksum now served. Under LoRA this
        is verl's base sync (the base weights, once): the adapter, if any, is left as it is."""
        self.updates += 1
        state_dict = dict(fault_plan().received(state_dict.items(), self.updates))  # tests' faults (testing/faults.py)
        await asyncio.to_thread(self.engine.load_state_dict, state_dict, version)
        self.global_steps = version
        self.base_kept = lora.keep_base(self.engine.model)
        served = self.engine.base_state_dict()
        checksum = weights_checksum({k: held_tensor(served, lora.base_name(k)) for k in state_dict})
        record_weight_sync(self.replica_rank, version, checksum, "update")
        record_replica_event(  # generated_tokens: what it served so far (a replacement's first is 0)
            self.replica_rank,
            "update",
            version=version,
            generated_tokens=self.engine.generated_tokens,
            tensors=len(state_dict),  # what the checksum covers: every tensor that arrived
            **self._memory(),
        )
        return {"version": self.engine.version, "checksum": checksum}

    async def update_adapter(
        self, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any], version: int
    ) -> dict[str, Any]:
        """Load a LoRA adapter between decode steps onto the base weights (not written) and serve it as ``version``;
        return the version and this engine's report of each adapter tensor as it arrived and as its LoRA layer holds
        it after loading (:func:`~areal_plugins.rollout.cpu.lora.adapter_report`)."""
        self.updates += 1
        tensors = dict(fault_plan().received(tensors.items(), self.updates))  # tests' faults (testing/faults.py)
        unplaced = await asyncio.to_thread(self.engine.load_adapter, tensors, peft_config, version)
        self.global_steps = version
        held = self.engine.adapter_tensors()
        report = lora.adapter_report(tensors, held, self.replica_rank)
        report["base_recheck"] = lora.recheck_base(self.engine.model, self.base_kept)  # sent once: still as loaded?
        record_weight_sync(
            self.replica_rank,
            version,
            {"adapter": weights_checksum(held), "adapter_tensors": len(held), "unplaced": sorted(unplaced)},
            "update_adapter",
        )
        record_replica_event(
            self.replica_rank,
            "update",
            version=version,
            adapter=True,
            generated_tokens=self.engine.generated_tokens,
            **self._memory(),
        )
        return {"version": self.engine.version, "adapter_reports": [report], "ranks_per_replica": 1}

    @staticmethod
    def verify_adapter(reply: dict[str, Any], sent: dict[str, list[float]], version: int, where: str) -> dict[str, int]:
        """The adapter's check (:meth:`RolloutServer.verify_adapter`), then the base's, as on verl's vLLM: every base
        weight as it was right after the last full load (``base_rechecked``: how many were compared)."""
        from areal_plugins.weight_sync.adapter_check import check_base_rechecks

        checked = RolloutServer.verify_adapter(reply, sent, version, where)
        checked["base_rechecked"] = check_base_rechecks(reply["adapter_reports"], where, version, "engine")
        return checked

    @staticmethod
    def verify_weights(reply: dict[str, Any], state_dict: dict[str, torch.Tensor], version: int, where: str) -> None:
        expected = weights_checksum(state_dict)
        if reply["version"] != version or reply["checksum"] != expected:
            raise WeightSyncError(
                f"weight sync to {where} failed: the server reports version {reply['version']} checksum "
                f"{reply['checksum']}, the trainer sent version {version} checksum {expected}. The rollout would "
                "keep sampling stale weights; stopping."
            )

    async def get_version(self) -> int:
        return self.engine.version

    async def get_stats(self) -> dict[str, Any]:
        return {
            "generated_tokens": self.engine.generated_tokens,
            "in_flight": self.engine.num_in_flight,
            "busy_s": self.engine.busy_seconds,
            "version": self.engine.version,
            "weight_bytes": self.engine.weight_bytes(),
            "kv_cache_bytes": self.engine.kv_cache_bytes(),
        }
