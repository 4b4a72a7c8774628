"""A small continuous-batching generation engine on Hugging Face transformers, for CPUs.

verl registers no rollout backend that runs on CPU (docs/design.md, Engines). This engine is the zero-setup
default for tests and laptops: requests join and leave the running batch at every decode step,
each request keeps its own KV cache, every generated token carries its log-prob under the
temperature-scaled distribution (what verl's trainer recomputes) and the policy version that
produced it, and ``abort_all`` returns in-flight requests with their partial output (AReaL's
interruptible generation). Requests of verl's validation go first: each is admitted at the next free slot, ahead of
every waiting training request, and is never held (``generate(validation=True)``). Under LoRA it serves the base
model with the trainer's adapter in peft's LoRA layers (:meth:`ContinuousBatchingEngine.load_adapter`,
rollout/cpu/lora.py). It imports neither Ray nor verl.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from areal_plugins.core.trajectory_rows import images_digest
from areal_plugins.rollout.base import Generated
from areal_plugins.rollout.cpu import lora
from areal_plugins.rollout.cpu.experts import fuse_expert_tensors
from areal_plugins.rollout.cpu.vision import ImagePrompts, VisionPrompt
from areal_plugins.rollout.prompt_seeds import PromptSeeds
from areal_plugins.testing.holds import FinishFirstGroups

logger = logging.getLogger(__name__)

STOP_COMPLETED = "completed"
STOP_ABORTED = "aborted"


@dataclass(eq=False)  # identity semantics: requests are compared and hashed as objects
class _Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    ignore_eos: bool
    future: asyncio.Future
    seed: int
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    #: With router replay: the experts each token fed through the model was routed to, one
    #: (tokens, moe_layers, top_k) array per model step (the prompt's at prefill, then one row per decode step).
    routed: list[Any] | None = None
    # Per layer (keys, values), each (kv_heads, length, head_dim); None until prefilled.
    cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    aborted: bool = False
    hold: bool = False  # stop after the hold policy's tokens until aborted or new weights load (holds.py)
    validation: bool = False  # verl's validation: admitted ahead of waiting training requests, never held
    #: A vision-language model's request: its images and M-RoPE positions (rollout/cpu/vision.py) until prefilled;
    #: None: text only, or prefilled.
    vision: VisionPrompt | None = None
    #: Where a VLM request's positions after its prompt sit from its token indices (M-RoPE; 0 without images).
    rope_delta: int = 0

    @property
    def cache_length(self) -> int:
        assert self.cache is not None
        return self.cache[0][0].shape[1]


class ContinuousBatchingEngine:
    """Generate for many concurrent requests with one model, interruptibly.

    Args:
        model: a causal LM (``transformers`` ``PreTrainedModel``) in eval mode.
        eos_token_ids: tokens that end a response (kept in the output, as vLLM does).
        max_batch_size: most requests decoded together; the rest wait their turn.
        seed: base seed of sampling. Each request draws from its own generator seeded by this seed,
            its prompt tokens and how many times that prompt was asked before, so the same requests
            give the same samples whatever the batch they share or the order they arrive in (what
            makes η = 0 reproduce synchronous training sample for sample).
        version: policy version of the initial weights.
        batch_invariant: decode and sample each request alone, so its tokens and log-probs are bit for bit the
            same whatever else is in flight (a batched step left-pads the caches, and the kernels' results then
            depend on the batch's shapes in the last bits: measured up to 4e-6 in a log-prob on the tiny model).
            What a replay of an asynchronous run needs; costs the batching.
        holds: for tests, the requests of which prompt groups finish under each weight version; the others are held
            until aborted or new weights load (:mod:`areal_plugins.testing.holds`). None: every request runs.
        step_delay_s: for tests, seconds added to every model step (prefill or decode), to run a test suite with
            the engines slower than the trainer; 0 in use.
        routed_experts: record the experts a mixture-of-experts model routes each token to, as verl's vLLM server
            returns them for router replay (``enable_rollout_routing_replay``): ``Generated.routed_experts`` is an
            int32 array (prompt + generated tokens - 1, MoE layers, experts per token), a row for every token fed
            through the model, the last generated one never is (vLLM's ``CompletionOutput.routed_experts``).
            Needs a model whose forward returns ``router_logits`` (transformers' MoE models).
        image_prompts: a vision-language model's image handling
            (:class:`~areal_plugins.rollout.cpu.vision.ImagePrompts`): requests may then carry images, and every
            position is a multimodal (M-RoPE) one. None: a text model.
    """

    def __init__(
        self,
        model: Any,
        eos_token_ids: list[int],
        max_batch_size: int = 64,
        seed: int = 0,
        version: int = 0,
        batch_invariant: bool = False,
        holds: FinishFirstGroups | None = None,
        step_delay_s: float = 0.0,
        routed_experts: bool = False,
        image_prompts: ImagePrompts | None = None,
    ) -> None:
        if step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s}")
        self.experts_per_token = int(getattr(model.config, "num_experts_per_tok", 0) or 0) if routed_experts else 0
        if routed_experts and self.experts_per_token < 1:
            raise ValueError(
                f"routed experts were asked of a {type(model).__name__}, which routes to no experts: set "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=false or use a mixture-of-experts model"
            )
        self.model = model
        self.image_prompts = image_prompts
        self.holds = holds
        self.step_delay_s = step_delay_s
        self.batch_invariant = batch_invariant
        self.eos_token_ids = set(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.version = version
        self.seed = seed
        self._seeds = PromptSeeds(seed)
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._held: list[_Request] = []  # out of the batch (holds), their caches kept
        self._model_lock = threading.Lock()  # a step and a weight load never overlap
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.generated_tokens = 0
        self.busy_seconds = 0.0  # wall time spent in model steps (rollout idle ratio = 1 - busy / wall)
        self.weights_loaded = True  # False between release_weights() and the next load_state_dict()
        #: The LoRA adapter's shape (lora.shape_of) once one was loaded; None: the base model alone.
        self.adapter_shape: dict[str, Any] | None = None

    # ------------------------------------------------------------------ public API

    async def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        request_id: str = "",
        ignore_eos: bool = False,
        seed: int | None = None,
        validation: bool = False,
        images: list[Any] | None = None,
    ) -> Generated:
        """Generate up to ``max_tokens`` tokens after ``prompt_ids`` (past end-of-sequence tokens with
        ``ignore_eos``, as vLLM does); return when done or aborted. ``seed``: sample with this seed instead of the
        one derived from the prompt (a replay passes the recorded one).

        ``validation``: a request of verl's periodic validation. It waits behind the other validation requests only:
        the next slot that frees in the running batch is its, before any waiting training request's (at 7B scale
        tens of thousands of training requests are in flight, and a validation queued behind them lasted as long as
        draining them). The running batch is not preempted: its requests keep their slots, and their KV caches, to
        their end, so a validation request waits at most until the first of them ends (vLLM's ``priority`` policy
        does the same; docs/backends.md). It is never held (:mod:`~areal_plugins.testing.holds`), and takes no
        group among the ones that finish; an abort cuts it like any request, and its tokens carry their versions.

        ``images``: a vision-language model's images of the prompt, whose placeholder tokens ``prompt_ids`` already
        holds (verl's agent loop expands them); a resubmission after an interruption carries them again."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: the engine needs at least one prompt token")
        if not self.weights_loaded:
            raise RuntimeError("the engine's weights were released (sleep) and no weights were loaded since")
        if images and self.image_prompts is None:
            raise ValueError(f"a request with {len(images)} images reached a text-only model: drop its images")
        vision = self.image_prompts.prompt(prompt_ids, images) if self.image_prompts is not None else None
        loop = asyncio.get_running_loop()
        seed = self._seeds.next(prompt_ids) if seed is None else int(seed)
        request = _Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            ignore_eos=ignore_eos,
            future=loop.create_future(),
            seed=seed,
            generator=torch.Generator().manual_seed(seed),
            hold=not validation
            and self.holds is not None
            and self.holds.holds(prompt_ids, images_digest(images) or ""),
            routed=[] if self.experts_per_token else None,
            validation=validation,
            vision=vision,
        )
        if validation:  # behind the validation requests waiting (all at the head of the queue), before the rest
            first_training = next((i for i, r in enumerate(self._waiting) if not r.validation), len(self._waiting))
            self._waiting.insert(first_training, request)
        else:
            self._waiting.append(request)
        self._ensure_loop()
        assert self._wakeup is not None
        self._wakeup.set()
        return await request.future

    def abort_all(self) -> list[str]:
        """Finish every waiting and running request now with its partial output; return their ids."""
        aborted = [*self._running, *self._waiting, *self._held]
        for request in aborted:
            request.aborted = True
        # Requests that are not in a step finish at once; running ones finish after the current step.
        for request in [*self._waiting, *self._held]:
            self._finish(request, STOP_ABORTED)
        self._waiting.clear()
        self._held.clear()
        return [request.request_id for request in aborted]

    def abort(self, request_id: str) -> bool:
        """Finish the in-flight request ``request_id`` with its partial output; False if none is in flight."""
        for request in [*self._running, *self._waiting, *self._held]:
            if request.request_id == request_id and not request.aborted:
                request.aborted = True
                for idle in (self._waiting, self._held):
                    if request in idle:
                        idle.remove(request)
                        self._finish(request, STOP_ABORTED)
                return True
        return False

    async def wait_idle(self) -> None:
        """Return once no request is waiting or running."""
        while self._running or self._waiting or self._held:
            await asyncio.sleep(0.005)

    # ------------------------------------------------------------------ memory (sleep / wake-up)

    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV caches of in-flight requests (freed as each request finishes)."""
        return sum(k.nbytes + v.nbytes for r in [*self._running, *self._held] if r.cache for k, v in r.cache)

    def weight_bytes(self) -> int:
        """Bytes of parameter storage the engine holds (0 once :meth:`release_weights` ran)."""
        return sum(p.nbytes for p in self.model.parameters() if not p.is_meta)

    def release_weights(self) -> None:
        """Free the weights' storage (a GPU engine's sleep); the next :meth:`load_state_dict` brings them back."""
        if self.num_in_flight:
            raise RuntimeError(f"cannot release the weights with {self.num_in_flight} requests in flight: abort them")
        if self.adapter_shape is not None:
            raise RuntimeError(
                "cannot release the weights of an engine serving a LoRA adapter: verl sends the base weights once and "
                "then the adapter only, so they would not come back (the server keeps them through sleep under LoRA)"
            )
        with self._model_lock:
            # Buffers (rotary frequencies: not in any state dict) are tiny and kept to restore after the load.
            self._kept_buffers = {name: b.clone() for name, b in self.model.named_buffers()}
            self.model.to("meta")
            self.weights_loaded = False

    @property
    def has_weights(self) -> bool:
        return self.weights_loaded

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights between two decode steps and serve them as ``version``.

        Names are the model's own, or with ``.base_layer`` where verl's LoRA base sync puts it; with a LoRA adapter
        injected (:meth:`load_adapter`) they load into the wrapped layers' base weights and leave the adapter as it is.
        """
        with self._model_lock:
            released = not self.weights_loaded
            if released:  # storage was freed: allocate it again, then fill it
                self.model.to_empty(device="cpu")
            engine_names = self._base_names()
            # A MoE's experts arrive per expert, as its checkpoint names them; transformers holds them fused.
            state_dict = fuse_expert_tensors(state_dict, engine_names.values())
            resolved = {engine_names.get(lora.base_name(name), name): tensor for name, tensor in state_dict.items()}
            missing, unexpected = self.model.load_state_dict(resolved, strict=False)
            if released:
                self.model.tie_weights()
                for name, buffer in self._kept_buffers.items():
                    self.model.get_buffer(name).copy_(buffer)
            # Tied embeddings legitimately lack lm_head.weight, and a full update carries no adapter; anything else
            # is a sync bug.
            missing = [name for name in missing if name != "lm_head.weight" and not lora.is_adapter_parameter(name)]
            if missing or unexpected:
                raise RuntimeError(
                    f"weight update did not match the rollout model: missing {missing[:5]}, unexpected {unexpected[:5]}"
                )
            self._serve(version)

    def base_state_dict(self) -> dict[str, torch.Tensor]:
        """The base model's weights under their plain names, without any LoRA adapter's (what a full update sends)."""
        return {
            lora.base_name(name): tensor
            for name, tensor in self.model.state_dict().items()
            if not lora.is_adapter_parameter(name)
        }

    def _base_names(self) -> dict[str, str]:
        """The model's state-dict name of each base weight, by its plain name (they differ in LoRA-wrapped layers)."""
        return {lora.base_name(name): name for name in self.model.state_dict() if not lora.is_adapter_parameter(name)}

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any], version: int) -> list[str]:
        """Load a LoRA adapter's tensors (verl's names, ``base_model.model.<module>.lora_A.weight``) between two decode
        steps and serve the base model with it as ``version``; the base weights are not written. The first adapter
        injects peft's LoRA layers, configured by ``peft_config`` (verl's ``LoraConfig.to_dict()``); later ones must
        have the same shape. Returns the names the engine could not place (the per-update check names them).

        Raises:
            RuntimeError: the base weights were released (sleep) and never loaded since: an adapter cannot stand in.
            ValueError: a LoRA variant the engine does not serve, or an adapter whose shape changed mid-run.
        """
        config = lora.lora_config(peft_config)
        shape = lora.shape_of(config)
        with self._model_lock:
            if not self.weights_loaded:
                raise RuntimeError(
                    f"a LoRA adapter for version {version} arrived while the engine's base weights are released "
                    "(sleep): the adapter would apply to nothing. The server keeps the base weights through sleep "
                    "under LoRA (lora_adapter=True, which the replica sets from actor_rollout_ref.model.lora_rank)"
                )
            if self.adapter_shape is None:
                lora.inject(self.model, config)
                self.adapter_shape = shape
            elif shape != self.adapter_shape:
                changed = sorted(key for key in shape if shape[key] != self.adapter_shape[key])
                raise ValueError(
                    f"the LoRA adapter of version {version} differs from the one the engine serves in {changed} "
                    f"({[self.adapter_shape[key] for key in changed]} -> {[shape[key] for key in changed]}): one "
                    "adapter shape is served per run"
                )
            unplaced = lora.load_adapter(self.model, tensors)
            self._serve(version)
        return unplaced

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """What the engine's LoRA layers hold, by the trainer's tensor names (empty before the first adapter)."""
        with self._model_lock:
            return {name: tensor.clone() for name, tensor in lora.held_adapter(self.model).items()}

    def _serve(self, version: int) -> None:
        """Serve the weights just loaded as ``version`` (the model lock held): held requests go on under them."""
        self.version = version
        self.weights_loaded = True
        if self.holds is not None:  # held requests go on under the new weights; new groups are chosen
            self.holds.new_version()
            for request in self._held:
                request.hold = False
            if self._held:
                self._running.extend(self._held)
                self._held.clear()
                if self._loop is not None and self._wakeup is not None:  # loads may come from another thread
                    self._loop.call_soon_threadsafe(self._wakeup.set)

    @property
    def num_in_flight(self) -> int:
        return len(self._running) + len(self._waiting) + len(self._held)

    # ------------------------------------------------------------------ scheduling loop

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._loop_task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            admitted = self._admit()
            started = time.perf_counter()
            try:
                finished = await asyncio.to_thread(self._step, admitted)
            except Exception as error:  # fail the requests, keep the engine alive
                logger.exception("generation step failed")
                for request in [*self._running]:
                    if not request.future.done():
                        request.future.set_exception(error)
                self._running.clear()
                continue
            finally:
                self.busy_seconds += time.perf_counter() - started
            for request, reason in finished:
                self._running.remove(request)
                self._finish(request, reason)
            if self.holds is not None:
                for request in [r for r in self._running if r.hold and len(r.token_ids) >= self.holds.hold_at_token]:
                    self._running.remove(request)
                    self._held.append(request)

    def _admit(self) -> list[_Request]:
        room = self.max_batch_size - len(self._running)
        admitted, self._waiting = self._waiting[:room], self._waiting[room:]
        self._running.extend(admitted)
        return admitted

    def _finish(self, request: _Request, reason: str) -> None:
        request.cache = None
        if not request.future.done():
            result = Generated(request.token_ids, request.logprobs, request.versions, reason, request.seed)
            if request.routed and request.token_ids:  # vLLM returns none for a request aborted before a token
                result.routed_experts = np.concatenate(request.routed)
            request.future.set_result(result)

    # ------------------------------------------------------------------ model work (worker thread)

    @torch.no_grad()
    def _step(self, admitted: list[_Request]) -> list[tuple[_Request, str]]:
        """Prefill the admitted requests, decode one token for the others; return finished ones."""
        finished: dict[_Request, str] = {}
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        with self._model_lock:
            version = self.version
            sampling: list[_Request] = []
            rows: list[torch.Tensor] = []
            for request in admitted:
                if request.aborted:
                    finished[request] = STOP_ABORTED
                else:
                    sampling.append(request)
                    rows.append(self._prefill(request)[None])
            fresh = set(admitted)
            decoding = [r for r in self._running if r not in fresh and not r.aborted]
            if decoding:
                sampling.extend(decoding)
                if self.batch_invariant:
                    rows.extend(self._decode([request]) for request in decoding)
                else:
                    rows.append(self._decode(decoding))
            if sampling:
                drawn = self._sample(sampling, torch.cat(rows))
                for request, (token, logprob) in zip(sampling, drawn, strict=True):
                    if self._append_token(request, token, logprob, version):
                        finished[request] = STOP_COMPLETED
            for request in self._running:
                if request.aborted and request not in finished:
                    finished[request] = STOP_ABORTED
        return list(finished.items())

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> list[tuple[int, float]]:
        if self.batch_invariant:  # each row alone, as it was decoded
            return [sample_requests([r], row)[0] for r, row in zip(requests, logits.split(1), strict=True)]
        return sample_requests(requests, logits)

    def _prefill(self, request: _Request) -> torch.Tensor:
        ids = torch.tensor([request.prompt_ids], dtype=torch.long)
        media: dict[str, Any] = {}
        if request.vision is not None:
            media = {
                "pixel_values": request.vision.pixel_values,
                "image_grid_thw": request.vision.image_grid_thw,
                "position_ids": request.vision.positions,
            }
        elif self.image_prompts is not None:  # a text prompt to a VLM: every M-RoPE axis is the token's index
            media = {"position_ids": torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)}
        logits, cache, router_logits = self._forward(request.routed is not None, input_ids=ids, use_cache=True, **media)
        if request.vision is not None:  # the pixels are in the KV cache now
            request.rope_delta, request.vision = request.vision.rope_delta, None
        request.cache = _split_cache(cache, 0)
        if request.routed is not None:
            request.routed.append(self._top_experts(router_logits, rows=1)[0])
        return logits[0]

    def _forward(self, routed: bool, **inputs: Any) -> tuple[torch.Tensor, Any, Any]:
        """The last position's logits, the KV cache, and with ``routed`` the router logits of every token fed.

        With ``routed`` the decoder runs alone, then the output projection on the last position: the causal-LM
        wrapper would also compute the load-balancing loss from the router logits, which fails on a left-padded
        decode step (the attention mask covers the cache, the router logits the new tokens only)."""
        if not routed:
            # Only the last position's logits are sampled from: the vocabulary projection of the others would be
            # most of a prefill's work on a small model (what vLLM also skips).
            out = self.model(**inputs, logits_to_keep=1)
            return out.logits[:, -1], out.past_key_values, None
        out = self.model.get_decoder()(**inputs, output_router_logits=True)
        logits = self.model.get_output_embeddings()(out.last_hidden_state[:, -1])
        return logits, out.past_key_values, out.router_logits

    def _top_experts(self, router_logits: tuple[torch.Tensor, ...], rows: int) -> list[Any]:
        """Per batch row, the ``experts_per_token`` experts of each token and MoE layer, best first: an array
        (tokens, layers, k). ``router_logits``: per MoE layer, (rows x tokens, experts), as the model's router computed
        them (its softmax keeps their order, so the top-k of the logits is the router's choice)."""
        chosen = torch.stack(
            [torch.topk(layer.float(), self.experts_per_token, dim=-1).indices for layer in router_logits], 1
        )
        return list(chosen.to(torch.int32).numpy().reshape(rows, -1, *chosen.shape[1:]))

    def _decode(self, batch: list[_Request]) -> torch.Tensor:
        """One decode step for ``batch``: left-pad the caches, run the model, keep the new column."""
        from transformers import DynamicCache

        longest = max(r.cache_length for r in batch)
        num_layers = len(batch[0].cache or [])
        cache = DynamicCache()
        for layer in range(num_layers):
            keys = torch.stack([_left_pad(r.cache[layer][0], longest) for r in batch])  # type: ignore[index]
            values = torch.stack([_left_pad(r.cache[layer][1], longest) for r in batch])  # type: ignore[index]
            cache.update(keys, values, layer)
        mask = torch.zeros(len(batch), longest + 1, dtype=torch.long)
        for row, request in enumerate(batch):
            mask[row, longest - request.cache_length :] = 1
        input_ids = torch.tensor([[r.token_ids[-1]] for r in batch], dtype=torch.long)
        positions = torch.tensor([[r.cache_length + r.rope_delta] for r in batch], dtype=torch.long)
        if self.image_prompts is not None:  # M-RoPE: after the prompt every axis moves one per token
            positions = positions[None].expand(3, -1, -1)
        routed = batch[0].routed is not None
        logits, new_cache, router_logits = self._forward(
            routed,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        if routed:
            for request, experts in zip(batch, self._top_experts(router_logits, rows=len(batch)), strict=True):
                request.routed.append(experts)  # type: ignore[union-attr]
        for row, request in enumerate(batch):
            new = _split_cache(new_cache, row, last_only=True)
            request.cache = [
                (torch.cat([k, nk], dim=1), torch.cat([v, nv], dim=1))
                for (k, v), (nk, nv) in zip(request.cache, new, strict=True)  # type: ignore[arg-type]
            ]
        return logits

    def _append_token(self, request: _Request, token: int, logprob: float, version: int) -> bool:
        """Add one sampled token to ``request``; return True when the request is complete."""
        request.token_ids.append(token)
        request.logprobs.append(logprob)
        request.versions.append(version)
        self.generated_tokens += 1
        ended = token in self.eos_token_ids and not request.ignore_eos
        return ended or len(request.token_ids) >= request.max_tokens


def sample_requests(requests: list[_Request], logits: torch.Tensor) -> list[tuple[int, float]]:
    return sample_tokens(
        logits,
        [r.temperature for r in requests],
        [r.top_p for r in requests],
        [r.top_k for r in requests],
        [r.generator for r in requests],
    )


def sample_tokens(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    top_ks: list[int],
    generators: list[torch.Generator],
) -> list[tuple[int, float]]:
    """Sample one token per row of ``logits`` (rows, vocabulary); return each token and its log-prob under
    ``softmax(logits / T)``.

    The log-prob ignores top-p/top-k truncation, matching what verl's trainer recomputes
    (``log_softmax(logits / temperature)``). ``temperature <= 0`` means greedy (T = 1 log-probs).
    Each row draws its Gumbel noise from its own generator and takes ``argmax(log p + noise)`` (the
    Gumbel-max trick): the draw depends on the row alone, not on the batch it shares, and a float-level
    change in the logits flips a draw only at a near-tie of two perturbed scores, so runs whose weights
    differ by rounding (η = 0 against synchronous verl) keep the same samples. ``torch.multinomial``
    drew the same way but one row at a time, most of a decode step's time on a small model.
    """
    greedy = torch.tensor([t <= 0 for t in temperatures])
    scale = torch.tensor([1.0 if t <= 0 else t for t in temperatures])
    logprobs = torch.log_softmax(logits.float() / scale[:, None], dim=-1)
    tokens = torch.zeros(len(temperatures), dtype=torch.long)
    if greedy.any():
        tokens[greedy] = torch.argmax(logprobs[greedy], dim=-1)
    sampled = [row for row in range(len(temperatures)) if not greedy[row]]
    if sampled:
        scores = logprobs[sampled]
        for i, row in enumerate(sampled):
            if (0 < top_ks[row] < scores.shape[1]) or top_ps[row] < 1.0:
                scores[i] = torch.log(_truncate(scores[i].exp(), top_ps[row], top_ks[row]))
        uniform = torch.stack([torch.rand(scores.shape[1], generator=generators[row]) for row in sampled])
        tokens[sampled] = torch.argmax(scores - torch.log(-torch.log(uniform)), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    return list(zip(tokens.tolist(), chosen.tolist(), strict=True))


def _truncate(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """``probs`` with everything outside the top-k, then outside the top-p nucleus, set to zero."""
    if top_k is not None and 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p * sorted_probs.sum()
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = sorted_probs[keep]
        probs = filtered
    return probs


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - tensor.shape[1]
    if missing == 0:
        return tensor
    pad = tensor.new_zeros(tensor.shape[0], missing, tensor.shape[2])
    return torch.cat([pad, tensor], dim=1)


def _split_cache(cache: Any, row: int, last_only: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` of one batch row, each ``(kv_heads, length, head_dim)``."""
    layers = []
    for layer in cache.layers:
        keys, values = layer.keys[row], layer.values[row]
        if last_only:
            keys, values = keys[:, -1:], values[:, -1:]
        layers.append((keys.clone(), values.clone()))
    return layers
