"""verl's vLLM server and replica under ``areal_async``: our worker extension, weight reports, token counts.

:class:`ArealVLLMReplica` is verl's ``vLLMReplica`` building :class:`ArealVLLMHttpServer` actors instead of
verl's; the async trainer registers it for ``rollout.name: vllm`` in its own driver only
(:func:`use_areal_vllm_replicas`), so verl's own trainers keep verl's classes.
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from areal_plugins.rollout.activity import RequestActivity

EXTENSION_CLASS = "areal_plugins.rollout.verl_vllm.worker_extension.ArealVLLMWorkerExtension"


class ArealVLLMHttpServer(vLLMHttpServer):
    """verl's server; its vLLM workers get our extension, and it counts what it generates."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generated_tokens = 0
        self.activity = RequestActivity()

    def _get_worker_extension_cls(self) -> str:
        return EXTENSION_CLASS

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.activity.enter()
        try:
            output = await super().generate(*args, **kwargs)
        finally:
            self.activity.leave()
        self.generated_tokens += len(getattr(output, "token_ids", None) or [])
        return output

    async def get_stats(self) -> dict[str, Any]:
        """What the watchdog and the step metrics read (the same keys as our own servers report)."""
        return {
            "generated_tokens": self.generated_tokens,
            "in_flight": self.activity.in_flight,
            "busy_s": self.activity.busy_seconds(),
            "restarts": 0,
        }

    async def areal_weight_reports(self) -> list[dict[str, Any]]:
        """Each vLLM worker's checksums of the weights it received in the last update (verl's ``collective_rpc``
        wrapper drops the workers' answers, so the engine is asked directly)."""
        return list(await self.engine.collective_rpc("areal_weight_report"))


class ArealVLLMReplica(vLLMReplica):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import ray

        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(ArealVLLMHttpServer)


def use_areal_vllm_replicas() -> None:
    """Make ``rollout.name: vllm`` build :class:`ArealVLLMReplica` in this process (the async trainer's driver)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register("vllm", lambda: ArealVLLMReplica)
