"""What ``areal_async`` needs from a rollout backend, what each backend provides, and the startup check.

Every guarantee of the async trainer rests on one of these. Our backends declare what they provide on their
server class (:attr:`RolloutServer.capabilities <areal_plugins.rollout.base.RolloutServer.capabilities>`):
each capability is kept by abstract methods of the server contract (:data:`CONTRACT_METHODS`), so a class
that declares one cannot be built without them. verl 0.9.1's own
``vllm`` and ``sglang`` servers provide what their code shows (read in ``vllm_async_server.py`` and
``async_sglang_server.py``); what they lack is refused at startup unless the recipe waives it by name
(``areal.waive_capabilities``), and a waived capability is named in the startup warning.
"""

from __future__ import annotations

from areal_plugins.config.settings import ArealConfigError

CAPABILITIES = {
    "abort_keeps_partial": "an abort returns the tokens and behaviour log-probs generated so far",
    "resume": "generation resumes after a weight update, continuing the aborted requests",
    "weight_update": "new weights load into the running engine",
    "version_stamps": "every generated token carries the policy version that generated it",
    "weight_checksum": "the engine checksums the weights it received or loaded, compared with what was sent",
    "progress_stats": "the engine counts generated tokens, so the watchdog judges progress by tokens",
}

#: The abstract methods of :class:`~areal_plugins.rollout.base.RolloutServer` that keep each capability.
CONTRACT_METHODS = {
    "abort_keeps_partial": ("_abort_in_flight", "abort_request"),
    "resume": ("_resume_engine",),
    "weight_update": ("update_weights",),
    "version_stamps": ("_generate", "served_version"),
    "weight_checksum": ("verify_weights",),
    "progress_stats": ("get_stats",),
}

#: verl's own servers. vllm: an abort returns the partial output with its log-probs (finish_reason
#: "abort"), and our client stamps each chunk with the version it ran under; under areal_async its server is
#: ours (rollout/verl_vllm/: each worker's checksum of the weights it received, compared with the trainer's,
#: and generated tokens counted). sglang: its abort may return partial tokens without their log-probs ("an
#: abort may leave an empty logprob payload"), so a resumed trajectory could miss them; nothing reports a
#: checksum or counts tokens.
VERL_BACKENDS = {
    "vllm": frozenset(
        {
            "abort_keeps_partial",
            "resume",
            "weight_update",
            "version_stamps",
            "weight_checksum",
            "progress_stats",
            "lora_adapter_check",  # ours: each worker's LoRA slots read back (rollout/verl_vllm/loaded_adapter.py)
            "moe_weight_check",  # ours: fused expert parameters against their experts' tensors (loaded_weights.py)
            "validation_first",  # ours: validation requests at vLLM's lowest priority (rollout/verl_vllm/server.py)
            # vLLM's enable_return_routed_experts, which verl sets (tests/verl_vllm/test_vllm_routed_experts.py); on
            # its CPU build only with enforce_eager (rollout/verl_vllm/cpu_settings.py), and the client refuses a
            # route no top-k router can have chosen (agent_loop/routed_experts.py).
            "routed_experts",
        }
    ),
    "sglang": frozenset({"resume", "weight_update", "version_stamps"}),
}


#: What some setups need beyond :data:`CAPABILITIES`: a backend declares the ones it has beside those (its server
#: class's ``capabilities``; :data:`VERL_BACKENDS`), and a recipe using the setup with a backend that lacks it is
#: refused at startup (:func:`require_feature`; docs/support.md). Not waivable: each stands for a check that would
#: otherwise be missing, or for inputs the engine would silently ignore.
FEATURE_CAPABILITIES = {
    "routed_experts": "returns the experts each token was routed to, as verl's router replay reads them",
    "moe_weight_check": "compares every expert tensor of a mixture-of-experts model after each weight update",
    "lora_adapter_check": "compares every LoRA adapter tensor each engine rank holds after each update",
    "images": "serves a vision-language model's images (the prompt's placeholders filled from image_data)",
    "audio": "serves audio inputs",
}


#: What the trainer uses where a backend declares it, and goes without where it does not (nothing is refused).
OPTIONAL_CAPABILITIES = {
    "validation_first": "admits verl's validation requests ahead of the waiting training requests and never holds "
    "them (without it a validation queues behind the whole training backlog)",
}


def provided_capabilities(backend: str) -> frozenset[str]:
    """What ``backend`` provides: its server class's declaration for ours, the table above for verl's, nothing
    for others."""
    from areal_plugins.rollout.verl_registration import backends, server_class

    if backend in backends():
        return server_class(backend).capabilities
    return VERL_BACKENDS.get(backend, frozenset())


def require_feature(backend: str, feature: str, used: str, fix: str) -> None:
    """Raise unless ``backend`` declares ``feature`` (a name of :data:`FEATURE_CAPABILITIES`): one line naming what
    the recipe uses (``used``), what the backend lacks, and the setting that avoids it (``fix``)."""
    if feature not in FEATURE_CAPABILITIES:
        raise KeyError(f"{feature!r} is not a feature capability; known: {', '.join(FEATURE_CAPABILITIES)}")
    if feature not in provided_capabilities(backend):
        raise ArealConfigError(
            f"{used} needs a rollout backend that {FEATURE_CAPABILITIES[feature]}, and "
            f"actor_rollout_ref.rollout.name={backend} does not ({feature}): {fix}"
        )


def check_backend_capabilities(backend: str, waived: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Raise unless ``backend`` provides every capability not in ``waived``; return the waived missing ones."""
    unknown = sorted(set(waived) - set(CAPABILITIES))
    if unknown:
        raise ArealConfigError(
            f"areal.waive_capabilities names {unknown}, which are not capabilities; known: {', '.join(CAPABILITIES)}"
        )
    missing = [name for name in CAPABILITIES if name not in provided_capabilities(backend)]
    refused = [name for name in missing if name not in waived]
    if refused:
        lines = "\n".join(f"  - {name}: {CAPABILITIES[name]}" for name in refused)
        raise ArealConfigError(
            f"actor_rollout_ref.rollout.name={backend} lacks what areal_async relies on:\n{lines}\n"
            "Use a backend that has all of it (verl's vllm, whose server areal_async extends; areal_cpu on CPU), "
            "or set areal.enable=false for verl's own trainers, or accept running without these guarantees: "
            f"areal.waive_capabilities=[{','.join(refused)}]"
        )
    return missing
