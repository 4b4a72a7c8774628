"""``areal_async``: verl's V1 PPO trainer, run the AReaL way (arXiv 2505.24298 §4-5; docs/design.md).

Registered through verl's ``register_trainer`` seam; ``areal.enable: true`` with ``areal.mode:
async`` selects it. verl's step pipeline (old log-probs, advantages, actor update, weight sync,
validation, checkpoints, loggers) is reused as is; what changes:

- generation is fed continuously by an admission loop bounded by the staleness η
  (``StalenessController``), instead of one batch per step;
- the trainer takes the oldest accepted groups from a :class:`SampleBuffer`;
- a weight update pauses admission, interrupts in-flight requests (they come back as partial
  output and are re-submitted as prompt + partial by :class:`InterruptibleLLMClient`), loads the
  new weights and resumes; per-token versions record which policy produced each token;
- ``areal.placement: colocated`` interrupts the engines and puts them to sleep while the trainer
  computes (they share its devices; verl's colocated lifecycle); ``separate`` gives them a resource
  pool of their own (verl's standalone replicas, weights through a checkpoint engine), where they
  generate throughout (docs/design.md, Placements).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import ray
import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import tensordict_utils as tu
from verl.utils.debug import marked_timer

from areal_plugins.config.settings import ArealConfig
from areal_plugins.hooks.manager import call_hook
from areal_plugins.rollout.capabilities import check_backend_capabilities
from areal_plugins.run.control import STOP_REQUEST_FILE
from areal_plugins.run.record_sink import start_record_sink
from areal_plugins.run.records import RunRecorder, record_exists
from areal_plugins.trainers.actor_liveness import ActorLiveness
from areal_plugins.trainers.admission import require_single_prompt_fetches
from areal_plugins.trainers.hooked import HookedTrainerMixin
from areal_plugins.trainers.llm_client import InterruptibleLLMClient
from areal_plugins.trainers.step_metrics import consumed_metrics, rollout_rates
from areal_plugins.trainers.watchdog import StallGuard, Watchdog, stall_limit

logger = logging.getLogger(__name__)

#: How often the trainer, while waiting for samples, checks that the admission loop is alive.
WAIT_CHECK_S = 1.0
#: How often the engines' activity is sampled for the timeline.
MONITOR_S = 0.5
#: Our part of a checkpoint, next to verl's files in ``global_step_N/``.
ASYNC_STATE_FILE = "areal_state.json"


def prompt_digest(prompt: Any) -> str:
    """A short content id of a prompt (chat messages or text), to trace prompts across a resume."""
    return hashlib.sha1(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:12]


class RunStoppedOnRequestError(RuntimeError):
    """Ctrl-C or SIGTERM to ``areal-plugins train`` asked the trainer to stop between two steps."""


class RolloutServerDiedError(RuntimeError):
    """A rollout server actor is gone and nothing replaces it."""


def accept_trajectory(trajectory: Any) -> bool:
    """What the ``areal_accept_trajectory`` hooks say of ``trajectory`` (no answer keeps it)."""
    return call_hook("areal_accept_trajectory", trajectory=trajectory) is not False


class _ArealReplayBuffer(ReplayBuffer):
    """verl's sampler interface; training batches come from our buffer, validation from verl's."""

    def __init__(self, take_train_batch: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._take_train_batch = take_train_batch

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        if partition_id != "train":
            return super().sample(global_steps, partition_id, batch_size)
        return self._take_train_batch(batch_size)


class ArealAsyncTrainer(HookedTrainerMixin, PPOTrainer):
    """verl's PPO trainer with staleness-bounded asynchronous generation (see module docstring)."""

    def __init__(self, config: Any) -> None:
        self.areal = ArealConfig.from_node(config.areal)
        backend = str(config.actor_rollout_ref.rollout.name)
        waived = check_backend_capabilities(backend, self.areal.waive_capabilities)  # refuses what is missing
        if waived:
            logger.warning(
                "areal: running with rollout.name=%s WITHOUT %s (areal.waive_capabilities)%s",
                backend,
                ", ".join(waived),
                "; the watchdog judges progress by finished groups only" if "progress_stats" in waived else "",
            )
        # separate: no engines on the trainer's devices (verl builds none when this is False); they get a
        # standalone pool of their own in _setup, fed by a checkpoint engine (docs/design.md, Placements).
        self._enable_hybrid_replicas = self.areal.placement == "colocated"
        self.recorder = RunRecorder()
        if self.recorder.run_dir is not None:  # before verl creates the workers that send records to it
            start_record_sink(self.recorder.run_dir)
        super().__init__(config)
        self.version = 0  # the policy version the engines serve
        self.manager: Any = None
        self._last_stats: dict[str, Any] | None = None
        self._last_stats_time = time.time()
        self._wait_s = 0.0
        self._consumed_groups = 0
        self._submissions = 0  # prompt batches drawn from the dataloader (areal_submissions.jsonl lines)
        self._submitted_groups = 0  # prompt groups handed to verl's agent loop, counted here, not derived
        self._monitor_stop = threading.Event()
        self._step_started = time.time()
        self._actor_liveness = ActorLiveness()
        self._stall_guard: StallGuard | None = None
        self._stats_errors = 0  # looks at the engines' statistics that failed (areal/rollout_stats_errors)
        self._step_metrics: dict = {}  # this step's metrics dict, filled by verl's step()

    # ------------------------------------------------------------------ construction

    def _build_replay_buffer(self) -> ReplayBuffer:
        sampler = self.config.trainer.v1.sampler
        return _ArealReplayBuffer(
            take_train_batch=self._take_train_batch,
            trainer_mode="sync",  # verl's sync semantics for the validation partition
            trainer_config={},
            max_off_policy_threshold=None,
            max_off_policy_strategy=sampler.max_off_policy_strategy,
            sampler_kwargs=sampler.sampler_kwargs,
            poll_interval=self.areal.poll_interval_s,
            refill_fn=self._add_prompts_to_generate,
        )

    def _setup(self) -> None:
        super()._setup()
        require_single_prompt_fetches(self.config.data)  # set by verl's _init_dataloader, read by admission
        if self.areal.placement == "separate":
            self._setup_standalone_rollout()
        from areal_plugins.trainers.placement_report import record_ray_placement

        record_ray_placement(self.areal.placement)

    def _setup_standalone_rollout(self) -> None:
        """verl's own standalone machinery: replicas on a resource pool of their own, weights by a checkpoint engine."""
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.rollout.llm_server import LLMServerManager

        self.standalone_server_manager = LLMServerManager.create(config=self.config, start_rank=0)
        engine_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
        self.standalone_checkpoint_manager = CheckpointEngineManager(
            config=engine_config,
            actor_wg=self.actor_rollout_wg,
            replicas=self.standalone_server_manager.get_replicas(),
        )
        logger.info(
            "areal_async separate: %d standalone rollout replicas, weights by checkpoint engine %s",
            len(self.standalone_server_manager.get_replicas()),
            engine_config.backend,
        )

    @property
    def rollout_servers(self) -> Any:
        """The LLM server manager whose replicas generate (standalone in ``separate``)."""
        return self.standalone_server_manager if self.areal.placement == "separate" else self.llm_server_manager

    @property
    def weight_sync(self) -> Any:
        """The checkpoint manager that moves weights to :attr:`rollout_servers`."""
        return self.standalone_checkpoint_manager if self.areal.placement == "separate" else self.checkpoint_manager

    def _rollout_server_managers(self) -> list:
        return [self.rollout_servers]

    def get_llm_client(self) -> Any:
        return self.rollout_servers.get_client(client_cls=InterruptibleLLMClient)

    # ------------------------------------------------------------------ lifecycle

    def on_init_end(self) -> None:
        self.weight_sync.update_weights(self.global_steps)
        self.version = self.global_steps
        super().on_init_end()  # HookedTrainerMixin: areal_on_weights_updated(version)

    def on_train_begin(self) -> None:
        # Built here, not in __init__: the plugin set is configured in init() (areal.plugins).
        self.sample_buffer = call_hook("areal_make_sample_buffer", config=self.config)
        self.manager = call_hook(
            "areal_make_rollout_manager",
            config=self.config,
            buffer=self.sample_buffer,
            submit_prompts=self._add_prompts_to_generate,
            accept_trajectory=accept_trajectory,
            reissue_prompts=self._reissue_prompts,
        )
        if self.areal.on_stale == "reissue" and not hasattr(self.manager, "reissue_stale"):
            raise RuntimeError(
                f"areal.on_stale=reissue needs a rollout manager with reissue_stale(groups); the plugin's "
                f"{type(self.manager).__name__} has none: use areal.on_stale=wait or drop"
            )
        if self.version > 0:
            self._resume_async_state()
        self.manager.resume(self.version)
        self.manager.start()
        self._last_stats, self._last_stats_time = self._rollout_stats(), time.time()
        threading.Thread(target=self._monitor_rollout, name="areal-rollout-monitor", daemon=True).start()
        self._stall_guard = StallGuard(
            stall_limit(self.areal.watchdog_s), self._trainer_stall_report, probe=self._actor_liveness.dead_actor
        )
        self._stall_guard.start()
        logger.info(
            "areal_async: max_staleness=%d placement=%s batch=%d groups",
            self.areal.max_staleness,
            self.areal.placement,
            self.config.data.train_batch_size,
        )

    def prepare_step(self) -> dict:
        return {}  # the admission loop submits prompts; nothing to do per step

    # ------------------------------------------------------------------ checkpoints

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's submission, recording which prompts were drawn (``areal_submissions.jsonl``)."""
        batch = self._next_train_batch(num_prompts)
        self._submissions += 1
        prompts = batch["raw_prompt"] if "raw_prompt" in batch.keys() else batch["uid"]
        self.recorder.write(
            "areal_submissions.jsonl",
            {"time": time.time(), "version": self.version, "uids": list(batch["uid"])}
            | {"prompts": [prompt_digest(prompt) for prompt in prompts]},
        )
        sent = self._submit_batch_to_rollout(batch)
        self._submitted_groups += len(batch["uid"])
        return sent

    def _reissue_prompts(self, uids: list[str]) -> None:
        """Send prompt groups (failed, or past η under on_stale: reissue) for generation again, from TransferQueue.

        The way verl re-issues in-flight prompts on resume (``_reissue_inflight_prompts``): the prompt
        stays registered throughout, so a checkpoint taken meanwhile keeps it and a resume redraws it.
        """
        batch = tq.kv_batch_get(keys=uids, partition_id="train")
        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": self.global_steps} for _ in uids]
        tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)
        self.recorder.write("areal_reissued.jsonl", {"time": time.time(), "version": self.version, "uids": uids})
        self.agent_loop_manager.generate_sequences(batch)

    def _save_checkpoint(self) -> None:
        """verl's checkpoint (weights, dataloader, TransferQueue) plus ours, taken at one quiet moment.

        The admission loop is held between polls, so no prompt is drawn from the dataloader without
        being registered in TransferQueue (it would be lost) or registered after the dataloader
        state was saved (it would be drawn twice). verl's TransferQueue checkpoint holds the accepted
        groups and the prompts in flight; ``areal_state.json`` holds the counters a resume restores (and the
        controller's, for the audit in ``areal_restored.jsonl``).
        """
        if self.manager is None:
            super()._save_checkpoint()
            return
        with self.manager.quiesce():
            super()._save_checkpoint()
            state = {
                "version": self.global_steps,
                "consumed_groups": self._consumed_groups,
                "submissions": self._submissions,
                "controller": self.manager.controller.state_dict(),
            }
            path = os.path.join(self._checkpoint_folder(self.global_steps), ASYNC_STATE_FILE)
            with open(path, "w") as handle:
                json.dump(state, handle)

    def _checkpoint_folder(self, step: int) -> str:
        trainer = self.config.trainer
        if trainer.resume_mode == "resume_path" and step == self.version and trainer.resume_from_path:
            return str(trainer.resume_from_path)
        return os.path.join(trainer.default_local_dir, f"global_step_{step}")

    def _resume_async_state(self) -> None:
        """Counters after a resume at version v (docs/design.md, Admission): accepted = v·B, then the restored groups.

        verl restored TransferQueue (finished groups) and re-issued the prompts that were in flight;
        all are counted as running, so the admission loop settles each exactly once and the
        staleness bound holds from the first new submission.
        """
        path = os.path.join(self._checkpoint_folder(self.version), ASYNC_STATE_FILE)
        if not os.path.exists(path):
            raise RuntimeError(
                f"resuming an areal_async run at step {self.version} needs {path}, which this checkpoint lacks "
                "(it was written by another trainer mode); resume it with that mode or set trainer.resume_mode=disable"
            )
        with open(path) as handle:
            saved = json.load(handle)
        if saved["version"] != self.version:
            raise RuntimeError(f"{path} is for version {saved['version']}, the weights are version {self.version}")
        listing = (tq.kv_list(partition_id="train") or {}).get("train", {})
        restored = sorted(uid for uid, tag in listing.items() if tag.get("is_prompt", False))
        controller = self.manager.controller
        controller.recover(self.version)
        if restored:
            controller.on_submit(len(restored))
        self._consumed_groups = saved["consumed_groups"]
        self._submissions = saved["submissions"]
        self.recorder.write("areal_restored.jsonl", {"version": self.version, "uids": restored, "saved": saved})
        logger.info(
            "areal_async: resumed at version %d with %d restored prompt groups (finished or re-issued)",
            self.version,
            len(restored),
        )

    def on_sample_end(self) -> None:
        if self.areal.placement == "colocated":
            # verl's colocated lifecycle: the engines share the devices with training, so they are
            # interrupted and put to sleep (weights and KV caches released under free_cache_engine)
            # until on_step_end's update wakes them with the new weights.
            self.manager.pause()
            with self.recorder.span("rollout", "paused_for_training"):
                self.checkpoint_manager.abort_replicas()
                self.checkpoint_manager.sleep_replicas()
            # Nothing finishes while the engines sleep; a rollout manager without this keeps polling.
            suspend_polling = getattr(self.manager, "suspend_polling", None)
            if suspend_polling is not None:
                suspend_polling()

    def step(self, metrics: dict, timing_raw: dict) -> KVBatchMeta:
        self._step_metrics = metrics  # kept for the step line when the weight sync after it fails
        return super().step(metrics, timing_raw)

    def on_step_end(self) -> None:
        new_version = self.global_steps
        with marked_timer("update_weights", self.timing_raw, color="red"), self.recorder.span("trainer", "update"):
            self.manager.pause()
            call_hook("areal_before_weight_update", version=new_version)
            # Interruption: colocated engines were aborted and put to sleep at on_sample_end; verl's
            # checkpoint manager aborts standalone ones itself before a non-naive sync.
            try:
                self.weight_sync.update_weights(new_version)
            except Exception:
                # The step is trained (and may be checkpointed): its line is written before the error stops
                # the run, so a resume shows no gap.
                self._write_step_line(self._step_metrics, self.timing_raw, new_version, time.time())
                raise
            self.version = new_version
            if self.weight_sync.backend == "naive":  # verl's other checkpoint engines resume the replicas themselves
                self.weight_sync.resume_generation_replicas()
            self.manager.resume(new_version)
        call_hook("areal_on_weights_updated", version=new_version)

    def _validate(self) -> dict[str, float]:
        if self._stall_guard is None:
            return super()._validate()
        with self._stall_guard.paused():  # validation's generation is judged by nothing else; it may be long
            return super()._validate()

    def fit(self, agent_loop_manager: Any) -> None:
        try:
            super().fit(agent_loop_manager)
        except (ray.exceptions.RayActorError, RolloutServerDiedError):
            # An actor was lost under a call (a weight sync to a lost node's engines, the step's look at the
            # engines' statistics): name it and its node.
            self._actor_liveness.explain()
            raise

    def stop_rollout(self) -> None:
        # Called by HookedTrainerMixin.fit before areal_on_shutdown: no trajectory is admitted after it.
        self._monitor_stop.set()
        if self._stall_guard is not None:
            self._stall_guard.close()
        if self.manager is not None:
            self.manager.stop()
            self._write_accounting()

    def _write_accounting(self) -> None:
        """Where every submitted rollout group ended up (``areal_accounting.json`` lines)."""
        counts = self.manager.controller.state_dict()
        record = {
            "submitted": self._submitted_groups,  # this process's count; the restored groups of a resume excluded
            **counts,
            "consumed": self._consumed_groups,
            "buffered": len(self.sample_buffer),
            "failed_groups": getattr(self.manager, "failed_groups", 0),
            "reissued_groups": getattr(self.manager, "reissued_groups", 0),
            "reissued_stale_groups": getattr(self.manager, "reissued_stale_groups", 0),
            "rejected_trajectories": getattr(self.manager, "rejected_trajectories", 0),
            "version": self.version,
        }
        self.recorder.write("areal_accounting.jsonl", record)
        logger.info("areal_async accounting: %s", record)

    # ------------------------------------------------------------------ sampling

    def _take_train_batch(self, batch_size: int) -> tuple[KVBatchMeta, dict]:
        """Block until ``batch_size`` accepted groups are buffered; hand out the oldest."""
        trainer_version = self.version
        watchdog = Watchdog(self.areal.watchdog_s)
        with self.recorder.span("trainer", "wait") as started:
            while True:
                if self._stall_guard is not None:
                    self._stall_guard.beat()
                if self.recorder.run_dir is not None and record_exists(STOP_REQUEST_FILE, self.recorder.run_dir):
                    self._stop_on_request()
                self._check_admission_alive()
                self._actor_liveness.check()
                watchdog.check(self._progress_marker, self._stuck_report)
                groups, stale = self.sample_buffer.take(batch_size, trainer_version, timeout=WAIT_CHECK_S)
                if stale and self.areal.on_stale == "reissue":
                    self.manager.reissue_stale(stale)
                elif stale:
                    self.manager.controller.on_drop_accepted(len(stale))
                    tq.kv_clear(keys=[k for g in stale for k in (g.group_id, *g.keys)], partition_id="train")
                if groups:
                    break
        self._wait_s = time.time() - started
        self._consumed_groups += len(groups)
        tq.kv_clear(keys=[g.group_id for g in groups], partition_id="train")
        keys = [key for group in groups for key in group.keys]
        tags = [tag for group in groups for tag in group.tags]
        metrics = consumed_metrics(groups, trainer_version)
        controller = self.manager.controller
        metrics.update(
            {
                "areal/buffer_size": float(len(self.sample_buffer)),
                "areal/running": float(controller.running),
                "areal/accepted": float(controller.accepted),
                "areal/rejected": float(controller.rejected),
                "areal/dropped_stale": float(len(stale)),
                "areal/rejected_trajectories": float(getattr(self.manager, "rejected_trajectories", 0)),
                "areal/failed_groups": float(getattr(self.manager, "failed_groups", 0)),
                "areal/reissued_groups": float(getattr(self.manager, "reissued_groups", 0)),
                "areal/reissued_stale_groups": float(getattr(self.manager, "reissued_stale_groups", 0)),
                "areal/over_stale_trained": float(getattr(self.sample_buffer, "over_stale_kept", 0)),
            }
        )
        for group in groups:
            for key, info in zip(group.keys, group.info, strict=True):
                self.recorder.write(
                    "areal_samples.jsonl",
                    {"step": self.global_steps, "trainer_version": trainer_version, "group": group.group_id}
                    | {"key": key}
                    | info,
                )
        return KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics

    def _stop_on_request(self) -> None:
        """Between two steps: checkpoint the last finished step (if checkpoints are on), then stop."""
        done = self.global_steps - 1  # verl counts the step being waited for
        saved = ""
        latest = Path(self.config.trainer.default_local_dir) / "latest_checkpointed_iteration.txt"
        already = latest.exists() and latest.read_text().strip() == str(done)
        if self.config.trainer.save_freq > 0 and done > 0 and not already:
            self.global_steps = done
            try:
                self._save_checkpoint()
            finally:
                self.global_steps = done + 1
            saved = f"; a checkpoint of step {done} was saved"
        elif already:
            saved = f"; step {done} was already checkpointed"
        raise RunStoppedOnRequestError(
            f"areal: stopped on request (Ctrl-C or SIGTERM) after step {done}{saved}; "
            "the same command with trainer.resume_mode=auto resumes"
        )

    def _trainer_stall_report(self, idle: float) -> str:
        guard_span = self._stall_guard.longest_span_s if self._stall_guard is not None else 0.0
        return (
            f"areal watchdog: the trainer has been computing step {self.global_steps} for {idle:.0f} s without "
            f"finishing it (limit: areal.watchdog_s = {self.areal.watchdog_s:.0f} with time left to stop within it, "
            f"or 3x the longest step computed so far, {guard_span:.0f} s): a trainer worker (old log-probs, "
            "update, weight sync) is "
            "stuck. Stopping the run; resume from the last checkpoint (trainer.resume_mode=auto), and raise "
            "areal.watchdog_s if one step legitimately takes this long"
        )

    def _check_admission_alive(self) -> None:
        """The admission loop's error; when an actor's death caused it, the error names that actor."""
        try:
            self.manager.check_alive()
        except RuntimeError:
            self._actor_liveness.explain()  # raises RunActorDiedError when a dead actor is behind it
            raise

    def _progress_marker(self) -> tuple:
        """Changes whenever rollout work moves: groups settled, tokens generated."""
        stats = self._rollout_stats() or {}
        return (getattr(self.manager, "last_progress", None), stats.get("generated_tokens"))

    def _stuck_report(self, waited: float) -> str:
        controller = self.manager.controller
        stats = self._rollout_stats()
        engines = (
            f"engines: {stats['in_flight']} requests in flight, {stats['generated_tokens']} tokens generated in total"
            if stats
            else "engines: no activity statistics (verl's own engines keep none)"
        )
        return (
            f"areal watchdog: the trainer waited {waited:.0f} s (areal.watchdog_s) for "
            f"{self.config.data.train_batch_size} groups at version {self.version} and no rollout progressed. "
            f"Admission: {controller.running} groups in flight, {controller.accepted} accepted, "
            f"{controller.rejected} rejected, {len(self.sample_buffer)} buffered; "
            f"{engines}. Likely stuck: "
            + (
                "the rollout engines or agent-loop workers (requests in flight, no tokens)"
                if controller.running
                else "admission (nothing in flight: is areal.max_concurrent_rollouts or the staleness bound too tight?)"
            )
        )

    # ------------------------------------------------------------------ metrics

    def _rollout_stats(self) -> dict[str, Any] | None:
        """Summed ``get_stats`` of our rollout servers; None for verl's own engines, which keep none."""
        import ray

        from areal_plugins.rollout.verl_registration import BACKENDS

        if self.config.actor_rollout_ref.rollout.name not in BACKENDS:
            return None
        replicas = self.rollout_servers.get_replicas()
        servers = [(replica.replica_rank, s) for replica in replicas for s in replica.servers]
        try:
            stats: list[dict[str, Any]] = ray.get([server.get_stats.remote() for _, server in servers], timeout=60)
        except ray.exceptions.RayActorError as error:
            raise RolloutServerDiedError(
                f"a rollout server of {self.config.actor_rollout_ref.rollout.name} (replicas "
                f"{[rank for rank, _ in servers]}) died and this backend does not restart it: "
                f"{str(error).splitlines()[0]}. Stopping the run; resume from the last checkpoint "
                "(trainer.resume_mode=auto) once the cause (memory? a kill?) is fixed"
            ) from error
        total = {"replicas": len(stats), "busy_s": 0.0, "generated_tokens": 0, "in_flight": 0, "restarts": 0}
        for item in stats:
            for key in ("busy_s", "generated_tokens", "in_flight"):
                total[key] += item[key]
            total["restarts"] += item.get("restarts", 0)  # engines that can die and be replaced (vLLM)
        return total

    def _monitor_rollout(self) -> None:
        """Sample the engines' activity for the timeline picture (own thread, every MONITOR_S)."""
        last_error = ""
        while self.manager is not None and not self._monitor_stop.wait(MONITOR_S):
            try:
                stats = self._rollout_stats()
            except Exception as error:  # a dead or hung server: the trainer's own calls report it
                self._stats_errors += 1
                if repr(error) != last_error:  # once per distinct error, not twice a second
                    logger.warning("rollout statistics unavailable (%r); the timeline has a gap", error)
                    last_error = repr(error)
                continue
            if stats is None:
                return
            self.recorder.write(
                "timeline.jsonl",
                {"who": "rollout", "time": time.time(), "in_flight": stats["in_flight"], "busy_s": stats["busy_s"]},
            )

    def on_step_begin(self) -> None:
        self._step_started = time.time()

    def _get_n_gpus_for_throughput(self) -> int:
        """verl's ``perf/throughput`` is per device: in ``separate`` the engines' pool counts too (as in verl's
        ``separate_async``), else 6 generating and 2 training GPUs would report 4x the real rate."""
        trainer_gpus = int(self.resource_pool_manager.get_n_gpus())
        if self.areal.placement != "separate":
            return trainer_gpus
        rollout = self.config.actor_rollout_ref.rollout
        return trainer_gpus + int(rollout.nnodes) * int(rollout.n_gpus_per_node)

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> Any:
        now = time.time()
        try:
            stats = self._rollout_stats()
        except Exception:
            # A dead server: this step is trained (and may be checkpointed), so its line is written
            # before the error stops the run; otherwise a resume would show a gap.
            self._stats_errors += 1
            self._write_step_line(metrics, timing_raw, global_steps, now)
            raise
        wall = now - self._last_stats_time
        metrics.update(rollout_rates(self._last_stats, stats, wall))
        self._last_stats, self._last_stats_time = stats, now
        self._write_step_line(metrics, timing_raw, global_steps, now)
        return super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)

    def _write_step_line(self, metrics: dict, timing_raw: dict, global_steps: int, now: float) -> None:
        """Our per-step record (``areal_steps.jsonl``) and the trainer's span on the timeline."""
        metrics["areal/rollout_stats_errors"] = float(self._stats_errors)
        step_s = timing_raw.get("step", 0.0)
        if step_s > 0:
            metrics["areal/trainer_idle_ratio"] = min(1.0, self._wait_s / step_s)
            metrics["areal/train_tokens_per_s"] = metrics.get("areal/consumed_response_tokens", 0.0) / step_s
        self.recorder.write(
            "timeline.jsonl",
            {"who": "trainer", "what": "step", "start": self._step_started, "end": now, "step": global_steps},
        )
        self.recorder.write(
            "areal_steps.jsonl",
            {"step": global_steps, "time": now} | {k: v for k, v in metrics.items() if k.startswith("areal/")},
        )
