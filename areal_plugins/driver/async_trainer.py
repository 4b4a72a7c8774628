"""``areal_async``: verl's V1 PPO trainer, run the AReaL way (arXiv 2505.24298 §4-5; docs/design.md).

Registered through verl's ``register_trainer`` seam; ``areal.enable: true`` with ``areal.mode:
async`` selects it. verl's step pipeline (old log-probs, advantages, actor update, weight sync,
validation, checkpoints, loggers) is reused as is; what changes:

- generation is fed continuously by an admission loop bounded by the staleness η
  (``StalenessController``), instead of one batch per step;
- the trainer takes accepted groups from the buffer ``areal_make_sample_buffer`` returns (by default the
  oldest head version first);
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
import time
from pathlib import Path
from typing import Any

import ray
import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, PPOTrainer, register_trainer
from verl.utils import tensordict_utils as tu
from verl.utils.debug import marked_timer

from areal_plugins.actors.progress_board import start_progress_board
from areal_plugins.agent_loop.partial_outputs import remove_rotated_partials
from areal_plugins.config.routing import ASYNC_MODE
from areal_plugins.config.settings import ArealConfigError, areal_settings
from areal_plugins.core.trajectory import keep_every_trajectory
from areal_plugins.driver.admission import require_single_prompt_fetches
from areal_plugins.driver.async_checkpoint import (
    DrawCounts,
    checkpoint_folder,
    restore_async_state,
    resume_folder,
    save_async_state,
)
from areal_plugins.driver.engine_stats import EngineStats
from areal_plugins.driver.hooked import HookedTrainerMixin
from areal_plugins.driver.kept_outputs import end_resumes, prepare_workers, save_partials
from areal_plugins.driver.limits import format_limits, run_limits
from areal_plugins.driver.phase_clock import PhaseClock
from areal_plugins.driver.placements import placement_for
from areal_plugins.driver.replica_lists import ReplicaLists
from areal_plugins.driver.replica_pool import ReplicaPool, RolloutServerDiedError, weight_group_rebuilt_each_sync
from areal_plugins.driver.replica_replacement import ReplicaReplacer
from areal_plugins.driver.schedule_source import LiveSchedule, ScheduleSource
from areal_plugins.driver.step_metrics import (
    admission_metrics,
    consumed_metrics,
    resume_metrics,
    run_state_metrics,
    write_accounting,
    write_samples,
    write_step_line,
)
from areal_plugins.driver.stop_control import stop_on_request, stop_requested
from areal_plugins.driver.supervision import Supervisor
from areal_plugins.hooks.contracts import RolloutManager as RolloutManagerContract
from areal_plugins.hooks.contracts import SampleBuffer as SampleBufferContract
from areal_plugins.hooks.contracts import StalenessControllerLike, require_contract, staleness_controller_of
from areal_plugins.plugin_manager import HOOKS
from areal_plugins.records.sink import start_record_sink
from areal_plugins.records.writer import RunRecorder
from areal_plugins.replay.driver_side import ReplayDriver
from areal_plugins.rollout.capabilities import check_backend_capabilities

logger = logging.getLogger(__name__)

#: How often the trainer, while waiting for samples, checks that the run can go on.
WAIT_CHECK_S = 1.0


def prompt_digest(prompt: Any) -> str:
    """A short content id of a prompt (chat messages or text), to trace prompts across a resume."""
    return hashlib.sha1(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:12]


def accept_trajectory(trajectory: Any) -> bool:
    """What the ``areal_accept_trajectory`` hooks say of ``trajectory`` (no answer keeps it)."""
    return HOOKS.accept_trajectory(trajectory=trajectory) is not False


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
    """verl's PPO trainer with staleness-bounded asynchronous generation (see module docstring).

    Its own job is the order of things around verl's step; the placement (placements.py), our part of a
    checkpoint (async_checkpoint.py), the detectors (supervision.py), the engines' statistics
    (engine_stats.py) and admission (the rollout manager a hook returns) each live in their own class.
    """

    def __init__(self, config: Any) -> None:
        self.areal = areal_settings(config)
        backend = str(config.actor_rollout_ref.rollout.name)
        waived = check_backend_capabilities(backend, self.areal.waive_capabilities)  # refuses what is missing
        if waived:
            logger.warning(
                "areal: running with rollout.name=%s WITHOUT %s (areal.waive_capabilities)%s",
                backend,
                ", ".join(waived),
                "; the watchdog judges progress by finished groups only" if "progress_stats" in waived else "",
            )
        if backend == "vllm":
            from areal_plugins.rollout.verl_vllm.server import use_checked_vllm_replicas

            use_checked_vllm_replicas()
        self.placement = placement_for(
            self.areal.placement, self.areal.weight_update.in_flight, self.areal.poll_interval_s
        )
        # verl builds engines in the trainer's workers only when this is True (colocated).
        self._enable_hybrid_replicas = self.placement.hybrid_replicas
        self.recorder = RunRecorder()
        self._resume_from: str | None = None  # the checkpoint folder this start resumed from
        self._resume_saved: dict[str, int] | None = None  # what it kept, until the first step asked for them
        self._resume_counts: dict[str, dict[str, int]] | None = None  # what it kept and what was continued
        if self.recorder.run_dir is not None:  # before verl creates the workers that send records to it
            start_record_sink(self.recorder.run_dir)
        super().__init__(config)
        self.version = 0  # the policy version the engines serve
        self.rollout_manager: Any = None  # areal_make_rollout_manager's (hooks/contracts.py), built in on_train_begin
        self.sample_buffer: Any = None
        self.counts = DrawCounts()
        self._submitted_groups = 0  # prompt groups handed to verl's agent loop, counted here, not derived
        self._wait_s = 0.0
        self._step_started = time.time()
        self._step_metrics: dict = {}  # this step's metrics dict, filled by verl's step()
        # Standalone replicas can die alone and be dropped, if the weight sync's group is built anew each time;
        # colocated ones share the trainer's workers.
        survives = self.placement.name == "separate" and weight_group_rebuilt_each_sync(
            config.actor_rollout_ref.rollout
        )
        # A replay follows the record of an earlier run (replay/driver_side.py); built before the engines start.
        self.schedule: ScheduleSource = (
            ReplayDriver(config, Path(self.areal.replay.run_dir), self.recorder)
            if self.areal.replay.run_dir
            else LiveSchedule()
        )
        self._build_replica_pool(survives, backend)
        if self.areal.max_rollout_replicas is not None and not survives:
            raise ArealConfigError(
                "areal.max_rollout_replicas adds replicas to the weight sync mid-run, which needs a checkpoint engine "
                "that builds its process group for every sync: areal_gloo, or verl's nccl with "
                "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nccl.rebuild_group=true"
            )
        self.engine_stats = EngineStats(backend, self.replica_pool, self.recorder, watchdog_s=self.areal.watchdog_s)
        self.supervisor = Supervisor(
            self,
            self.areal.watchdog_s,
            self.engine_stats,
            self.recorder,
            stop_on_request=self._stop_on_request,
            board=start_progress_board(),  # before verl creates the trainer workers that report to it
        )
        # What the CLI's Ctrl-C waits for: the longest phase and checkpoint measured (cli/control.py).
        self.phase_clock = PhaseClock(self.areal.watchdog_s, self.recorder)

    # ------------------------------------------------------------------ construction

    def _build_replica_pool(self, survives: bool, backend: str) -> None:
        """The pool that drops dead replicas and the replacer that starts new ones, both changing the replicas through
        one :class:`ReplicaLists` over the placement's server manager and the checkpoint manager that syncs them
        (driver/replica_lists.py: a replica leaves and joins the weight sync's group together with the servers)."""
        lists = ReplicaLists(lambda: self.rollout_servers, lambda: self.weight_sync)
        self.replica_pool = ReplicaPool(lists, self.recorder, survives, backend)
        replacing = survives and self.areal.replace_dead_replicas
        self.replacer = ReplicaReplacer(lists, self.recorder, enabled=replacing)
        self.replica_pool.on_drop = self.replacer.replace

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
        self.placement.setup(self)
        measured_start = None
        if self.placement.name == "separate":  # how long a replica started mid-run may take to start
            measured_start = self.placement.startup_s
            self.replacer.start_timeout_from(self.areal.replica_start_timeout_s, measured_start)
        # Every limit of the run and where it comes from: what `areal-plugins check` printed, with the start measured.
        limits = format_limits(run_limits(self.config, replica_start_s=measured_start))
        logger.info("areal: the run's limits:\n  %s", "\n  ".join(limits))
        from areal_plugins.driver.placement_report import record_ray_placement

        record_ray_placement(self.placement.name)

    @property
    def rollout_servers(self) -> Any:
        """The LLM server manager whose replicas generate."""
        return self.placement.rollout_servers(self)

    @property
    def weight_sync(self) -> Any:
        """The checkpoint manager that moves weights to :attr:`rollout_servers`."""
        return self.placement.weight_sync(self)

    def _rollout_server_managers(self) -> list:
        return [self.rollout_servers]

    def get_llm_client(self) -> Any:
        return self.rollout_servers.get_client(client_cls=self.schedule.client_class())

    def _get_n_gpus_for_throughput(self) -> int:
        """verl's ``perf/throughput`` is per device: the placement says which devices the run holds."""
        trainer_gpus = int(self.resource_pool_manager.get_n_gpus())
        return self.placement.devices(trainer_gpus, self.config.actor_rollout_ref.rollout)

    # ------------------------------------------------------------------ lifecycle

    def on_init_end(self) -> None:
        # The first sync is watched like any later one: a hang stops the run, a dead actor behind a failure is named.
        try:
            with self.supervisor.watching("first weight sync"):
                self.weight_sync.update_weights(self.global_steps)
        except BaseException as error:
            self.supervisor.stalled(error)
            if isinstance(error, ray.exceptions.RayActorError | RolloutServerDiedError):
                self.supervisor.explain()
            raise
        self.version = self.global_steps
        self.schedule.served(self.version)
        self.replacer.track(self.replica_pool.replicas)  # where their processes run, to end a dead one's leftovers
        super().on_init_end()  # HookedTrainerMixin: areal_on_weights_updated(version)

    def on_train_begin(self) -> None:
        # Built here, not in __init__: the plugin set is configured in init() (areal.plugins).
        self.sample_buffer = self.schedule.sample_buffer(self.config)  # a replay's: the record's groups by step
        require_contract(self.sample_buffer, SampleBufferContract, "areal_make_sample_buffer")
        self.rollout_manager = HOOKS.make_rollout_manager(
            config=self.config,
            buffer=self.sample_buffer,
            submit_prompts=self._add_prompts_to_generate,
            # No plugin asks about trajectories: the manager may skip reading them back (admission.py).
            accept_trajectory=(
                accept_trajectory if HOOKS.implemented("areal_accept_trajectory") else keep_every_trajectory
            ),
            reissue_prompts=self._reissue_prompts,
        )
        manager = self.rollout_manager
        require_contract(manager, RolloutManagerContract, "areal_make_rollout_manager")
        staleness_controller = staleness_controller_of(manager)
        require_contract(
            staleness_controller, StalenessControllerLike, "areal_make_rollout_manager (its staleness_controller)"
        )
        if self.version > 0:
            folder = resume_folder(self.config.trainer, self.version)
            self.counts = restore_async_state(folder, self.version, staleness_controller, self.recorder)
        self.rollout_manager.resume(self.version)
        self.rollout_manager.start()
        self.engine_stats.start()
        self.supervisor.start()
        logger.info(
            "areal_async: max_staleness=%d placement=%s batch=%d groups",
            self.areal.max_staleness,
            self.placement.name,
            self.config.data.train_batch_size,
        )

    def prepare_step(self) -> dict:
        return {}  # the admission loop submits prompts; nothing to do per step

    def on_step_begin(self) -> None:
        self._step_started = time.time()

    # ------------------------------------------------------------------ phase boundaries

    def _phase_end(self, phase: str, next_phase: str) -> None:
        """``phase`` ended: measure it (for the CLI's stop grace) and tell the stall guard what comes next."""
        self.phase_clock.end(phase)
        self.supervisor.phase(next_phase)

    def _in_phase(self, phases: tuple[str, str, str], compute: Any, batch: Any, metrics: dict, trained: bool) -> Any:
        """Run verl's ``compute`` as the middle of ``phases`` (the one before, its own, the one after); a stop
        requested meanwhile is honoured once it is done (:meth:`_stop_at_boundary`)."""
        before, phase, after = phases
        self._phase_end(before, phase)
        batch = compute(batch, metrics)
        self._phase_end(phase, after)
        self._stop_at_boundary(trained=trained)
        return batch

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        phases = ("reward and balance", "old log-probs", "advantages")
        return self._in_phase(phases, super()._compute_old_log_prob, batch, metrics, trained=False)

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        return self._in_phase(("advantages", "update", "checkpoint"), super()._update_actor, batch, metrics, True)

    def _stop_at_boundary(self, trained: bool) -> None:
        """A stop requested by the CLI, honoured at a phase boundary inside a step: ``trained``: this step's
        update is done (it is checkpointed and its line written), else the last finished step is."""
        if not stop_requested(self.recorder):
            return
        if trained:
            self._write_step_line(self._step_metrics, self.timing_raw, self.global_steps, time.time())
            self._stop_on_request(done=self.global_steps)
        self._stop_on_request()

    def on_sample_end(self) -> None:
        if self.placement.hybrid_replicas:  # colocated engines stop serving this version
            self.schedule.finish_version(self.version, self.supervisor.waiting())
        self.placement.after_sampling(self)

    def step(self, metrics: dict, timing_raw: dict) -> KVBatchMeta:
        self._step_metrics = metrics  # kept for the step line when the weight sync after it fails
        return super().step(metrics, timing_raw)

    def on_step_end(self) -> None:
        self._phase_end("checkpoint", "weight sync")  # verl's save, when this step had one, ran since the update
        new_version = self.global_steps
        with marked_timer("update_weights", self.timing_raw, color="red"), self.recorder.span("trainer", "update"):
            self.schedule.finish_version(self.version, self.supervisor.waiting())
            if self.schedule.pauses_admission_before_update or not self.placement.sync_pauses_admission:
                self.rollout_manager.pause()  # else the sync stops it just before the abort (weight_sync/staged.py)
            HOOKS.before_weight_update(version=new_version)
            # Interruption: colocated engines were aborted and put to sleep after sampling; standalone ones are
            # aborted by the checkpoint manager, before verl's transfers and after a staged one (areal_gloo).
            try:
                self.replica_pool.prune()  # the sync's process group is built from the replicas still serving
                self.replacer.grow(self.areal.max_rollout_replicas)  # a node joined: one more replica starts
                if self.replacer.join():  # replicas that have started take the new weights with the others
                    self.weight_sync.replicas_joined()
                self.weight_sync.update_weights(new_version)
                self.replacer.serve(new_version)  # and only then requests
            except Exception:
                self.rollout_manager.pause()  # a sync that failed before stopping admission: nothing more is drawn
                # The step is trained (and may be checkpointed): its line is written before the error stops
                # the run, so a resume shows no gap.
                self._write_step_line(self._step_metrics, self.timing_raw, new_version, time.time())
                raise
            self.version = new_version
            self.schedule.served(new_version)
            if self.weight_sync.backend == "naive":  # verl's other checkpoint engines resume the replicas themselves
                self.weight_sync.resume_generation_replicas()
            self.rollout_manager.resume(new_version)
        HOOKS.on_weights_updated(version=new_version)
        self._phase_end("weight sync", "validation and metrics")
        if stop_requested(self.recorder):
            self._write_step_line(self._step_metrics, self.timing_raw, new_version, time.time())
            self._stop_on_request(done=new_version)

    def _validate(self) -> dict[str, float]:
        # Validation's generation is judged by nothing else, and may be long; the stop is read after it.
        with self.phase_clock.timed("validation"), self.supervisor.paused():
            return super()._validate()

    def fit(self, agent_loop_manager: Any) -> None:
        # Before verl re-issues the prompts in flight: each agent-loop worker knows what the resumed checkpoint kept
        # that it can read, and the log says whether every node sees the checkpoint folder (kept_outputs.py).
        self._resume_saved = prepare_workers(
            str(self.config.trainer.default_local_dir),
            self._resume_from,
            agent_loop_manager.agent_loop_workers,
            self.recorder,
            checkpointing=float(self.config.trainer.save_freq or -1) > 0,
        )
        try:
            super().fit(agent_loop_manager)
        except (ray.exceptions.RayActorError, RolloutServerDiedError) as error:
            self.supervisor.stalled(error)
            # An actor was lost under a call (a weight sync to a lost node's engines, the step's look at the
            # engines' statistics): name it and its node.
            self.supervisor.explain()
            raise
        except BaseException as error:  # the stall guard's interrupt, or Ray's cancelled task under it
            self.supervisor.stalled(error)
            raise

    def stop_rollout(self) -> None:
        # Called by HookedTrainerMixin.fit before areal_on_shutdown: no trajectory is admitted after it.
        self.engine_stats.stop()
        self.supervisor.close()
        if self.rollout_manager is not None:
            self.rollout_manager.stop()
            self._write_accounting()

    # ------------------------------------------------------------------ prompts in, samples out

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's submission, recording which prompts were drawn (``areal_submissions.jsonl``)."""
        batch = self._next_train_batch(num_prompts)
        self.counts.submissions += 1
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

    def _take_train_batch(self, batch_size: int) -> tuple[KVBatchMeta, dict]:
        """Block until ``batch_size`` accepted groups are buffered; hand them out."""
        trainer_version = self.version
        check = self.supervisor.waiting()
        with self.recorder.span("trainer", "wait") as started:
            while True:
                check()
                groups, stale = self.sample_buffer.take(batch_size, trainer_version, timeout=WAIT_CHECK_S)
                if stale:  # past η at consumption: the rollout manager owns both of their paths
                    manager = self.rollout_manager
                    (manager.reissue_stale if self.areal.on_stale == "reissue" else manager.drop_stale)(stale)
                if groups:
                    break
        self._wait_s = time.time() - started
        self.phase_clock.restart()  # the wait reads the stop every second: not a phase to wait for
        self.supervisor.phase("reward and balance")
        self.counts.consumed_groups += len(groups)
        tq.kv_clear(keys=[g.group_id for g in groups], partition_id="train")
        metrics = consumed_metrics(groups, trainer_version)
        metrics |= admission_metrics(self.rollout_manager, self.sample_buffer)
        write_samples(self.recorder, groups, self.global_steps, trainer_version)
        keys = [key for group in groups for key in group.keys]
        tags = [tag for group in groups for tag in group.tags]
        return KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics

    # ------------------------------------------------------------------ checkpoints and stops

    def _save_checkpoint(self) -> None:
        """verl's checkpoint (weights, dataloader, TransferQueue) plus ours, taken at one quiet moment; its time is
        measured for the CLI's stop grace."""
        with self.phase_clock.timed("checkpoint"):
            self._save_checkpoint_now()

    def _save_checkpoint_now(self) -> None:
        """verl's checkpoint plus ours.

        The rollout manager is held between polls, so no prompt is drawn from the dataloader without being
        registered in TransferQueue (it would be lost) or registered after the dataloader state was saved
        (it would be drawn twice).
        """
        if self.rollout_manager is None:
            super()._save_checkpoint()
            return
        with self.rollout_manager.quiesce():
            # Ours first: verl writes latest_checkpointed_iteration.txt last, so a crash during the save leaves
            # the previous checkpoint the latest. The output so far of every answer in flight is copied before
            # verl's weights are written (a group settling meanwhile is then finished in TransferQueue and its
            # kept outputs go unused; the other order would lose them). partial_outputs.py.
            folder = checkpoint_folder(self.config.trainer, self.global_steps)
            os.makedirs(folder, exist_ok=True)
            partials = save_partials(folder, self.agent_loop_manager.agent_loop_workers)
            staleness_controller = staleness_controller_of(self.rollout_manager)
            save_async_state(folder, self.global_steps, self.counts, staleness_controller, partials)
            super()._save_checkpoint()
            remove_rotated_partials(self.config.trainer.default_local_dir)

    def _load_checkpoint(self) -> None:
        """verl's; then, on a resume, where its checkpoint is: the agent-loop workers continue the outputs it kept
        (told in :meth:`fit`, before any request is made)."""
        super()._load_checkpoint()
        self._resume_from = resume_folder(self.config.trainer, self.global_steps) if self.global_steps > 0 else None

    def _stop_on_request(self, done: int | None = None) -> None:
        """Checkpoint finished step ``done`` (if checkpoints are on), then stop. By default the step before the one
        verl counts (the stop is read in its batch wait, or after its old log-probs: its batch is not trained and
        a resume generates it anew)."""
        stop_on_request(self.config.trainer, self.global_steps - 1 if done is None else done, self._save_checkpoint_of)

    def _save_checkpoint_of(self, step: int) -> None:
        current, self.global_steps = self.global_steps, step
        try:
            self._save_checkpoint()
        finally:
            self.global_steps = current

    # ------------------------------------------------------------------ records

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> Any:
        now = time.time()
        try:
            metrics.update(self.engine_stats.step_rates(now))
        except Exception:
            # A dead server: this step is trained (and may be checkpointed), so its line is written
            # before the error stops the run; otherwise a resume would show a gap.
            self._write_step_line(metrics, timing_raw, global_steps, now)
            raise
        self._write_step_line(metrics, timing_raw, global_steps, now)
        result = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        self.schedule.check_step(global_steps, metrics)
        return result

    def _write_step_line(self, metrics: dict, timing_raw: dict, global_steps: int, now: float) -> None:
        metrics.update(run_state_metrics(self.engine_stats, len(self.replica_pool.replicas), self.replacer))
        if self._resume_saved is not None:  # after the first step every re-issued answer has asked: stop looking
            continued = end_resumes(self.agent_loop_manager.agent_loop_workers)
            self._resume_counts = {"saved": self._resume_saved, "continued": continued}
            self._resume_saved = None
        metrics.update(resume_metrics(self._resume_counts))
        step_s = timing_raw.get("step", 0.0)
        write_step_line(self.recorder, metrics, global_steps, step_s, self._wait_s, self._step_started, now)

    def _write_accounting(self) -> None:
        """Where every submitted rollout group ended up (``areal_accounting.jsonl``)."""
        submitted = self._submitted_groups  # this process's count; the restored groups of a resume excluded
        write_accounting(self.recorder, self.rollout_manager, self.sample_buffer, submitted, self.counts, self.version)


# Registered where it is defined (verl's own trainers use the same decorator), whichever module imports it first.
if ASYNC_MODE not in TRAINER_REGISTRY:
    register_trainer(ASYNC_MODE)(ArealAsyncTrainer)
