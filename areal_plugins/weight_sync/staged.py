"""Weight updates of standalone engines that pause them only for the load: the transfer runs while they generate.

verl's ``CheckpointEngineManager.update_weights`` aborts every replica first and resumes them after the load, so
under ``placement: separate`` the engines stand idle for the whole transfer (the network time between nodes). With
a checkpoint engine that can stage an update (it declares ``stages_weights`` and has a ``stage`` method, as
``areal_gloo`` does), :class:`StagedCheckpointEngineManager` orders the same steps differently:

1. build the process group and transfer the whole update into each rollout worker's stage (host memory of the
   checkpoint-engine worker, one copy of the model per worker), checked on arrival; the engines keep generating;
2. abort the replicas (our clients keep the partial outputs and continue them under the new version);
3. load from the stage through verl's server adapter (its own transport to the engine, checked by ours);
4. resume.

Every other backend (verl's ``nccl``, ``nixl``, ...) and ``naive`` run verl's order unchanged. Where the checkpoint
engine keeps checksums of its leg (``areal_gloo``; verl's ``nccl`` with our mixin, weight_sync/checked_transfer.py),
what each rollout worker received is compared with what the trainer sent: before the load when staged, after
verl's update otherwise (the run stops before the next step trains).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.utils.ray_utils import auto_await

from areal_plugins.records.writer import append_record
from areal_plugins.weight_sync.checked_transfer import check_transfer_reports
from areal_plugins.weight_sync.lora_updates import RESEND_BASE_ATTRIBUTE

logger = logging.getLogger(__name__)

#: One line per staged update: how long the transfer ran beside generation, how long the engines were paused.
RECORD = "weight_transfers.jsonl"


def stages_weights(backend_cls: Any) -> bool:
    """Whether a checkpoint engine class can receive an update ahead of its load."""
    return bool(getattr(backend_cls, "stages_weights", False)) and callable(getattr(backend_cls, "stage", None))


class StagedCheckpointEngineManager(CheckpointEngineManager):
    """verl's manager; with a staging checkpoint engine the engines pause only for the load (module docstring).

    ``before_pause`` (set by the async trainer): called just before the engines are aborted, so that prompts are
    still submitted while a staged update crosses (the trainer stops its admission there, not before the transfer).
    """

    before_pause: Callable[[], None] | None = None

    def _pausing(self) -> None:
        if self.before_pause is not None:
            self.before_pause()

    def _rollout_group(self) -> Any:
        """Every replica's checkpoint-engine workers as one group, as verl's update builds it."""
        from verl.checkpoint_engine.base import _worker_cls

        workers = [worker for replica in self.replicas for worker in replica.workers]
        group: Any = RayWorkerGroup(worker_handles=workers, ray_cls_with_init=RayClassWithInitArgs(cls=_worker_cls))
        return group

    def _actor_group(self) -> Any:
        return self.actor_wg  # typed by verl as the base group; its methods are the workers' registered ones

    @staticmethod
    def _finalize(actor_wg: Any, rollout: Any) -> None:
        ray.get(
            actor_wg.execute_checkpoint_engine(["finalize"] * actor_wg.world_size)
            + rollout.execute_checkpoint_engine(["finalize"] * rollout.world_size)
        )

    def _check_transfer(self, rollout: Any | None) -> int | None:
        """What each rollout worker received against what the trainer sent, where the engine keeps both; the
        tensors compared per worker (None: this engine keeps no checksums). ``rollout``: the update's group, or
        None to build one (verl's update keeps its own)."""
        if not getattr(self.backend_cls, "reports_transfer_checksums", False):
            return None
        rollout = self._rollout_group() if rollout is None else rollout
        method, actor_wg = "areal_transfer_checksums", self._actor_group()
        trainer = ray.get(actor_wg.execute_checkpoint_engine([method] * actor_wg.world_size))
        workers = ray.get(rollout.execute_checkpoint_engine([method] * rollout.world_size))
        for report, name in zip(workers, self._worker_names(), strict=True):
            report["name"] = name
        return check_transfer_reports(trainer, workers, str(self.backend))

    def _worker_names(self) -> list[str]:
        """Replica and worker of each rollout worker, in the group's order (that of verl's update)."""
        return [
            f"replica {getattr(replica, 'replica_rank', index)}, its worker {position}"
            for index, replica in enumerate(self.replicas)
            for position in range(len(replica.workers))
        ]

    def replicas_joined(self) -> None:
        """Replicas that started mid-run join the next update: a LoRA trainer sends them the base weights again
        before the adapter (they may have started from dummy weights; patches/lora_separate_sync.py reads the flag)."""
        if self.backend == "naive":
            return
        actor_wg = self._actor_group()
        n = actor_wg.world_size
        ray.get(actor_wg.execute_checkpoint_engine(["__setattr__"] * n, [RESEND_BASE_ATTRIBUTE] * n, [True] * n))

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict:
        if self.backend == "naive" or not stages_weights(self.backend_cls):
            self._pausing()  # verl's order: the engines are aborted first
            metrics = await CheckpointEngineManager.update_weights.__wrapped__(self, global_steps)  # type: ignore[attr-defined]
            if self.backend != "naive":
                self._check_transfer(None)
            return metrics
        rollout, actor_wg = self._rollout_group(), self._actor_group()
        started_at, started = time.time(), time.monotonic()
        n = rollout.world_size
        try:
            self.build_process_group(rollout)
            results = ray.get(
                actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
                + rollout.execute_checkpoint_engine(["stage"] * n, [global_steps] * n)
            )
            staged_bytes = [int(value) for value in results[actor_wg.world_size :]]
            checked_tensors = self._check_transfer(rollout)  # before any engine loads it
            staged = time.monotonic()
            self._pausing()
            await self.abort_replicas()  # the engines generated until now
            await self.release_kv_cache_replicas()
            ray.get(rollout.update_weights(global_steps=global_steps))  # each worker loads its stage
            await self.resume_kv_cache_replicas()
            await self.resume_generation_replicas()
            resumed = time.monotonic()
        except Exception:
            # The stages (a model's size each) and the group go after a failed update too; the update's own error
            # is what the run reports, not a dead worker's refusal to finalize. (An interrupt goes straight out:
            # finalizing may wait on the very workers that hung.)
            try:
                self._finalize(actor_wg, rollout)
            except Exception:
                logger.warning("after the failed weight update, finalizing the transfer failed too", exc_info=True)
            raise
        self._finalize(actor_wg, rollout)
        record = {
            "time": time.time(),
            "version": global_steps,
            "started": round(started_at, 3),
            "backend": self.backend,
            "staged_s": round(staged - started, 4),
            "engines_paused_s": round(resumed - staged, 4),
            "staged_bytes_per_worker": max(staged_bytes, default=0),
            "transfer_checked_tensors": checked_tensors,
            "workers": n,
        }
        append_record(RECORD, record)
        logger.info(
            "weights v%s: transferred beside generation in %.2f s, engines paused %.2f s for the load",
            global_steps,
            record["staged_s"],
            record["engines_paused_s"],
        )
        sync_metrics: dict = {}
        for result in results[: actor_wg.world_size]:
            if isinstance(result, dict):
                sync_metrics.update(result)
        return sync_metrics
