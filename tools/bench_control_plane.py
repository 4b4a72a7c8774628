"""The control plane under load: our admission loop, sample buffer, rollout client and the engines' control calls.

What runs is the async trainer's rollout side with the model taken out (docs/results/control_plane.md):

- in the driver (this process): :class:`AdmissionLoop` (``driver/admission.py``) with the default
  :class:`StalenessController` and :class:`OldestFirstBuffer`, polling the real TransferQueue every 50 ms as the
  default rollout manager does (``builtin/async_rollout.py``); a trainer loop that takes batches from the buffer
  as ``ArealAsyncTrainer._take_train_batch`` does, "trains" for ``--train-s`` seconds, then runs the weight
  update's control calls (abort every engine, update, resume) and reads every engine's statistics;
- rollout workers (Ray actors standing for verl's ``AgentLoopWorkerTQ``): per prompt group, ``n`` calls of our
  :class:`InterruptibleLLMClient` through verl's own load balancer, and the trajectories written to TransferQueue
  with the tags verl's agent loop writes;
- engines: :class:`areal_bench.paced_engine.PacedRolloutServer` Ray actors, sized as our trainer sizes
  them (``rollout/server_slots.py``), that return tokens at ``--tokens-per-s`` per request with no model.

It measures, per configuration (B prompts x n answers, η, engines): the driver's CPU seconds per step and per 1k
trajectories (``time.process_time`` of this process: admission thread, trainer loop, statistics thread and
Ray's client threads), the admission thread's CPU per poll and how much of it listing the partition takes,
admission latency (prompt admitted by the staleness controller -> its first request reaches an engine), batch
ready -> trainer has it, and the latency of abort, resume and statistics calls under load. Configurations are
interleaved within each repeat; each row gives the median over repeats and the spread (min-max).

``--rig local`` runs the same driver code with the engines, workers and load balancer on an event loop in this
process and an in-memory TransferQueue (``areal_plugins.testing.InMemoryTransferQueue``): no Ray, so a unit
test can run it in seconds; its driver CPU includes the workers and engines, so its rows are not comparable.

    .venv/bin/python tools/bench_control_plane.py --configs 32x4:1:2 --repeats 3
    .venv/bin/python tools/bench_control_plane.py --table docs/results/control_plane.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import areal_bench
from repeats import spread

REPO = Path(__file__).resolve().parents[1]
PARTITION = "train"
#: The admission loop's default poll interval (areal.poll_interval_s).
POLL_S = 0.05
#: Seconds between the statistics thread's looks at the engines while they generate (engine_stats.py's rate).
STATS_EVERY_S = 1.0
#: Seconds the driver's CPU is measured with everything up and nothing submitted (``--idle-s``).
IDLE_S = 2.0


# ---------------------------------------------------------------------------------------------- arithmetic


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values."""
    values = list(values)
    return statistics.median(values) if values else None


def cpu_per_step(cpu_marks: list[float], trajectories_per_step: int) -> tuple[float, float]:
    """Driver CPU per step and per 1,000 trajectories from the process's CPU time at each counted step boundary.

    ``cpu_marks[0]`` is taken when the first counted step begins and ``cpu_marks[k]`` when step ``k`` ends.
    """
    if len(cpu_marks) < 2:
        raise ValueError("need the CPU time at the start and at the end of at least one step")
    per_step = (cpu_marks[-1] - cpu_marks[0]) / (len(cpu_marks) - 1)
    return per_step, 1000.0 * per_step / trajectories_per_step


def admission_latencies(decided: dict[int, float], arrivals: Iterable[dict[int, float]]) -> list[float]:
    """Per group: admitted (``decided``) -> its first request reached any engine (earliest of ``arrivals``).

    Groups with no arrival yet (still queued when measured) or no decision time (an earlier step's) are left out.
    """
    first: dict[int, float] = {}
    for engine in arrivals:
        for group, at in engine.items():
            if group not in first or at < first[group]:
                first[group] = at
    return [first[group] - decided[group] for group in sorted(first) if group in decided]


def ready_to_trainer(ready_at: float, asked_at: float, has_at: float) -> float:
    """Batch ready -> trainer has it: from the later of "the buffer holds a batch" and "the trainer asks for one"."""
    return has_at - max(ready_at, asked_at)


@dataclass(frozen=True)
class Config:
    """One configuration: ``batch`` prompt groups of ``answers`` trajectories per step, η, engines."""

    batch: int
    answers: int
    eta: int
    engines: int
    listing: bool = False  # the admission loop lists TransferQueue on every poll instead of reading the reports
    rows: bool = False  # an accept hook is installed: every settled group's rows are read back (reports or listing)

    @property
    def name(self) -> str:
        found_by = " listing" if self.listing else ""
        read_back = " rows" if self.rows or self.listing else ""
        return f"{self.batch}x{self.answers} eta={self.eta} engines={self.engines}{found_by}{read_back}"

    @property
    def reads_rows(self) -> bool:
        """Whether the admission loop reads the trajectories back (an accept hook; listing predates summaries)."""
        return self.rows or self.listing

    @property
    def trajectories_per_step(self) -> int:
        return self.batch * self.answers

    @property
    def requests_bound(self) -> int:
        """Requests the admission bound allows in flight: (η + 1) x B groups x n answers (server_slots.py)."""
        return (self.eta + 1) * self.batch * self.answers

    @classmethod
    def parse(cls, text: str) -> Config:
        """``BxN:ETA:ENGINES``, e.g. ``512x16:4:8``; ``:listing`` after it lists TransferQueue on every poll and
        reads every group's rows (the admission loop before the workers reported settled groups), ``:rows`` reads
        the rows of each reported group (a run with an ``areal_accept_trajectory`` hook)."""
        try:
            shape, eta, engines, *mode = text.split(":")
            if mode not in ([], ["listing"], ["rows"]):
                raise ValueError(mode)
            batch, answers = shape.lower().split("x")
            listing, rows = mode == ["listing"], mode == ["rows"]
            return cls(int(batch), int(answers), int(eta), int(engines), listing=listing, rows=rows)
        except ValueError:
            raise SystemExit(f"--configs: {text!r} is not BxN:ETA:ENGINES[:listing|:rows] (e.g. 32x4:1:2)") from None


def summarize(config: Config, repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the repeats of one configuration (each a :func:`run_once` result)."""
    row: dict[str, Any] = {"config": asdict(config), "name": config.name, "repeats": len(repeats)}
    for key in MEASURES:
        row[key] = spread((repeat[key] for repeat in repeats), count="repeats")
    row["steps_per_repeat"] = repeats[0]["steps"] if repeats else 0
    row["repeat_results"] = repeats
    roles = sorted({role for repeat in repeats for role in repeat.get("other_processes_cpu_s_per_step_by_role", {})})
    row["other_processes_cpu_s_per_step_by_role"] = {
        role: spread(
            (repeat["other_processes_cpu_s_per_step_by_role"].get(role) for repeat in repeats), count="repeats"
        )
        for role in roles
    }
    return row


#: Per-repeat measures (each a number; the row gives their median and spread over repeats).
MEASURES = (
    "cpu_s_per_step",
    "cpu_s_per_1k_trajectories",
    "step_wall_s",
    "admission_s",
    "admission_p90_s",
    "submit_s",
    "ready_to_trainer_s",
    "poll_cpu_ms",
    "kv_list_ms",
    "listing_entries",
    "admission_cpu_s_per_step",
    "trainer_cpu_s_per_step",
    "stats_thread_cpu_s_per_step",
    "client_threads_cpu_s_per_step",
    "other_processes_cpu_s_per_step",
    "idle_cpu_s_per_s",
    "abort_s",
    "resume_s",
    "stats_at_update_s",
    "stats_under_load_s",
    "stats_under_load_max_s",
    "in_flight_peak",
)


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


# ---------------------------------------------------------------------------------------------- the rollout side


class RolloutWorker:
    """Stands for verl's ``AgentLoopWorkerTQ``: runs each prompt group's ``n`` requests through our client and
    writes the trajectories as verl's agent loop does (``agent_loop_tq.py``, ``_run_prompt`` and
    ``_agent_loop_postprocess``). ``store`` is TransferQueue's module (None: attach to the running one)."""

    def __init__(self, load_balancer: Any, response_length: int, store: Any = None, report: bool = False) -> None:
        from omegaconf import OmegaConf

        from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient

        if store is None:
            import transfer_queue as tq

            tq.init()  # attaches to the driver's TransferQueue
            store = tq
        self.store = store
        config = {"actor_rollout_ref": {"rollout": {"name": "areal_paced", "response_length": response_length}}}
        self.client = InterruptibleLLMClient(OmegaConf.create(config), load_balancer)
        self.tasks: set[asyncio.Task] = set()
        self.failures = 0
        self.report = report  # tell the admission loop of each settled group, as our agent-loop workers do

    async def generate_sequences(self, groups: list[tuple[str, int, list[int]]], version: int) -> None:
        """Start each ``(uid, group index, response lengths)`` group in the background, as verl's worker does."""
        for uid, index, lengths in groups:
            task = asyncio.create_task(self._run_group(uid, index, lengths, version))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run_group(self, uid: str, index: int, lengths: list[int], version: int) -> None:
        from areal_plugins.core.trajectory_rows import output_summary

        await self.store.async_kv_put(key=uid, partition_id=PARTITION, tag={"status": "running"})
        prompt = [index, 1, 2, 3]  # the paced engine stamps each group's first arrival by prompt_ids[0]
        calls = [
            self.client.generate(
                f"{uid}_{i}", prompt_ids=prompt, sampling_params={"max_tokens": length, "logprobs": True}
            )
            for i, length in enumerate(lengths)
        ]
        outputs = await asyncio.gather(*calls, return_exceptions=True)
        keys: list[str] = []
        summaries = None
        if any(isinstance(output, BaseException) for output in outputs):
            self.failures += 1
            await self.store.async_kv_put(key=uid, partition_id=PARTITION, tag={"status": "failure"})
        else:
            keys = [f"{uid}_{i}_0" for i in range(len(outputs))]
            await self.store.async_kv_batch_put(
                keys=keys,
                fields=trajectory_fields(prompt, outputs),
                tags=[trajectory_tag(prompt, output, version) for output in outputs],
                partition_id=PARTITION,
            )
            await self.store.async_kv_put(key=uid, partition_id=PARTITION, tag={"status": "finished"})
            summaries = [output_summary(uid, as_agent_loop_output(prompt, output)) for output in outputs]
        if self.report:
            from areal_plugins.actors.settled_groups import report_settled

            await report_settled(uid, keys, summaries)

    def stats(self) -> dict[str, int]:
        return {"groups_running": len(self.tasks), "failures": self.failures}

    async def cancel_all(self) -> int:
        """Cancel every group still running (the end of a configuration), so none writes to the next one."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)


def trajectory_fields(prompt: list[int], outputs: list[Any]) -> Any:
    """The fields verl's agent loop writes that our admission loop reads, plus ``input_ids``."""
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = []
    for output in outputs:
        prompts = torch.tensor(prompt, dtype=torch.int64)
        responses = torch.tensor(output.token_ids, dtype=torch.int64)
        scores = torch.zeros(len(output.token_ids), dtype=torch.float32)
        if len(output.token_ids):
            scores[-1] = 1.0
        rows.append(
            {
                "prompts": prompts,
                "responses": responses,
                "response_mask": torch.ones_like(responses),
                "input_ids": torch.cat([prompts, responses]),
                "rollout_log_probs": torch.tensor(output.log_probs or [], dtype=torch.float32),
                "rm_scores": scores,
                "extra_fields": dict(output.extra_fields),
            }
        )
    return list_of_dict_to_tensordict(rows)


def as_agent_loop_output(prompt: list[int], output: Any) -> Any:
    """The engine's output as the fields of verl's ``AgentLoopOutput`` that our worker summarizes (the reward 1.0
    at the last token, as :func:`trajectory_fields` writes it)."""
    from types import SimpleNamespace

    tokens = list(output.token_ids)
    return SimpleNamespace(
        prompt_ids=prompt,
        response_ids=tokens,
        response_mask=[1] * len(tokens),
        response_logprobs=list(output.log_probs or []),
        reward_score=1.0 if tokens else 0.0,
        extra_fields=dict(output.extra_fields),
    )


def trajectory_tag(prompt: list[int], output: Any, version: int) -> dict[str, Any]:
    extra = output.extra_fields
    return {
        "status": "success",
        "prompt_len": len(prompt),
        "response_len": len(output.token_ids),
        "seq_len": len(prompt) + len(output.token_ids),
        "global_steps": version,
        "min_global_steps": extra.get("min_global_steps"),
        "max_global_steps": extra.get("max_global_steps"),
    }


# ---------------------------------------------------------------------------------------------- rigs


class RayRig:
    """Real Ray and TransferQueue: engines, rollout workers and verl's load balancer as actors."""

    def __init__(self, workers: int, response_length: int, tq_storage_units: int = 1) -> None:
        import ray
        import transfer_queue as tq
        from omegaconf import OmegaConf

        self.ray = ray
        # Our actors ask for no CPU; TransferQueue's two and the load balancer need one each to be scheduled.
        # More logical CPUs would make Ray start idle worker processes for nothing.
        # The engines' class is the bench's (tools/areal_bench): Ray ships that package to the workers.
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=areal_bench.runtime_env(),
        )
        storage = {"num_data_storage_units": tq_storage_units, "total_storage_size": 400_000}
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": storage}}))
        self.store = tq
        self.workers: list[Any] = []
        self.engines: list[Any] = []
        self._rollout_side = (workers, response_length)
        from areal_plugins.actors.settled_groups import drain_reports, start_inbox

        self.inbox = start_inbox()
        self.settled_reports = lambda: drain_reports(self.inbox)  # the workers report settled groups, as in a run

    def _start_rollout_side(self) -> None:
        """verl's load balancer and the rollout workers, once (each imports verl: ~10 s of CPU)."""
        from verl.workers.rollout.router import get_router_handle

        workers, response_length = self._rollout_side
        self.balancer = get_router_handle(servers={})
        worker_cls = self.ray.remote(RolloutWorker).options(num_cpus=0, max_concurrency=100_000)
        self.workers = [worker_cls.remote(self.balancer, response_length, report=True) for _ in range(workers)]
        self.ray.get([worker.stats.remote() for worker in self.workers])

    def start_engines(self, count: int, tokens_per_s: float, slots: int) -> None:
        from areal_bench.paced_engine import PacedRolloutServer

        if not self.workers:
            self._start_rollout_side()
        engine_cls = self.ray.remote(PacedRolloutServer).options(num_cpus=0, max_concurrency=slots)
        self.engines = [engine_cls.remote(tokens_per_s=tokens_per_s, replica_rank=i) for i in range(count)]
        self.ray.get([engine.get_version.remote() for engine in self.engines])
        self.ray.get(self.balancer.add_servers.remote({f"paced-{i}": e for i, e in enumerate(self.engines)}))

    def stop_engines(self) -> None:
        self.ray.get([worker.cancel_all.remote() for worker in self.workers])
        self.ray.get(self.balancer.remove_servers.remote([f"paced-{i}" for i in range(len(self.engines))]))
        for engine in self.engines:
            self.ray.kill(engine)
        self.engines = []
        clear_partition(self.store)

    def dispatch(self, groups: list[tuple[str, int, list[int]]], version: int) -> None:
        """verl's ``AgentLoopManagerTQ.generate_sequences``: chunks to the workers, waits until they took them."""
        chunks = split(groups, len(self.workers))
        self.ray.get([w.generate_sequences.remote(c, version) for w, c in zip(self.workers, chunks, strict=True) if c])

    def call_engines(self, method: str, *args: Any) -> list[tuple[float, Any]]:
        """Call ``method`` on every engine at once; each engine's (seconds to answer, answer)."""
        started = time.perf_counter()
        refs = {getattr(engine, method).remote(*args): i for i, engine in enumerate(self.engines)}
        out: list[tuple[float, Any]] = [(0.0, None)] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=120)
            if not ready:
                raise TimeoutError(f"{method}: {len(pending)} engine(s) did not answer in 120 s (starved?)")
            out[refs[ready[0]]] = (time.perf_counter() - started, self.ray.get(ready[0]))
        return out

    def close(self) -> None:
        self.ray.shutdown()


class LocalRig:
    """The same parts on an event loop in this process and an in-memory TransferQueue: no Ray (unit tests)."""

    def __init__(self, workers: int, response_length: int) -> None:
        from verl.workers.rollout.router import GlobalRequestLoadBalancer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="local-rig", daemon=True)
        self.thread.start()
        self.store = LockedMemoryStore()
        self._balancer = GlobalRequestLoadBalancer(servers={})
        balancer = LocalHandle(self._balancer)
        self.workers = [RolloutWorker(balancer, response_length, store=self.store) for _ in range(workers)]
        self.engines: list[Any] = []
        self.settled_reports = None  # no Ray: the admission loop lists the in-memory store
        self.inbox = None

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def start_engines(self, count: int, tokens_per_s: float, slots: int) -> None:
        from areal_bench.paced_engine import PacedRolloutServer

        self.engines = [PacedRolloutServer(tokens_per_s=tokens_per_s, replica_rank=i) for i in range(count)]
        self._balancer.add_servers({f"paced-{i}": LocalHandle(e) for i, e in enumerate(self.engines)})

    def stop_engines(self) -> None:
        for worker in self.workers:
            self._run(worker.cancel_all())
        self._balancer.remove_servers([f"paced-{i}" for i in range(len(self.engines))])
        self.engines = []
        clear_partition(self.store)

    def dispatch(self, groups: list[tuple[str, int, list[int]]], version: int) -> None:
        for worker, chunk in zip(self.workers, split(groups, len(self.workers)), strict=True):
            if chunk:
                self._run(worker.generate_sequences(chunk, version))

    def call_engines(self, method: str, *args: Any) -> list[tuple[float, Any]]:
        out = []
        for engine in self.engines:
            started = time.perf_counter()
            result = getattr(engine, method)(*args)
            if asyncio.iscoroutine(result):
                result = self._run(result)
            out.append((time.perf_counter() - started, result))
        return out

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class LocalHandle:
    """``handle.method.remote(...)`` on a plain object in the running event loop, as Ray's actor handles answer."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._target, name)

        class _Remote:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                result = method(*args, **kwargs)
                if asyncio.iscoroutine(result):
                    return asyncio.ensure_future(result)
                done = asyncio.get_running_loop().create_future()
                done.set_result(result)
                return done

        return _Remote


class LockedMemoryStore:
    """:class:`InMemoryTransferQueue` behind a lock, with the put calls verl's agent loop and trainer make."""

    def __init__(self) -> None:
        from areal_plugins.testing.memory_transfer_queue import InMemoryTransferQueue

        self.queue = InMemoryTransferQueue()
        self.lock = threading.Lock()

    def kv_list(self, partition_id: str) -> Any:
        with self.lock:
            return self.queue.kv_list(partition_id)

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> Any:
        with self.lock:
            return self.queue.kv_batch_get(keys, partition_id, select_fields)

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        with self.lock:
            self.queue.kv_clear(keys, partition_id)

    def kv_tags(self, keys: list[str], partition_id: str) -> Any:
        with self.lock:
            return self.queue.kv_tags(keys, partition_id)

    def kv_batch_put(self, keys: list[str], partition_id: str, tags: list[dict], fields: Any = None) -> None:
        with self.lock:
            for row, (key, tag) in enumerate(zip(keys, tags, strict=True)):
                self.queue.tags.setdefault(key, {}).update(tag)
                if fields is not None:
                    self.queue.rows[key] = {name: fields[name][row] for name in fields.keys()}

    async def async_kv_put(self, key: str, partition_id: str, tag: dict) -> None:
        with self.lock:
            self.queue.tags.setdefault(key, {}).update(tag)

    async def async_kv_batch_put(self, keys: list[str], fields: Any, tags: list[dict], partition_id: str) -> None:
        self.kv_batch_put(keys, partition_id, tags, fields)


def split(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous chunks of near-equal size (as ``TensorDict.chunk``)."""
    size = -(-len(items) // parts) if items else 0
    return [items[i * size : (i + 1) * size] for i in range(parts)]


def clear_partition(store: Any) -> None:
    keys = list((store.kv_list(partition_id=PARTITION) or {}).get(PARTITION, {}))
    if keys:
        store.kv_clear(keys=keys, partition_id=PARTITION)


# ---------------------------------------------------------------------------------------------- the driver


class TimedStore:
    """TransferQueue as the admission loop sees it, counting the CPU its listing costs this thread."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.list_s: list[float] = []
        self.listing_entries: list[int] = []

    def kv_list(self, partition_id: str) -> Any:
        started = time.perf_counter()  # wall: TransferQueue's client does part of the work in a thread of its own
        listing = self.store.kv_list(partition_id=partition_id)
        self.list_s.append(time.perf_counter() - started)
        self.listing_entries.append(len((listing or {}).get(partition_id, {})))
        return listing

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> Any:
        return self.store.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=select_fields)

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        self.store.kv_clear(keys=keys, partition_id=partition_id)

    def __getattr__(self, name: str) -> Any:  # reads by key (``get_client``, ``kv_tags``): not timed
        return getattr(self.store, name)


def others_cpu() -> dict[int, tuple[str, float]]:
    """Role and CPU seconds so far of every process below this one (Ray's: engines, workers, TransferQueue,
    the load balancer, raylet)."""
    import psutil

    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            out[child.pid] = (process_role(child.cmdline(), child.name()), times.user + times.system)
        except psutil.Error:  # gone meanwhile
            continue
    return out


def process_role(cmdline: list[str], name: str) -> str:
    """``ray::PacedRolloutServer.generate`` -> ``PacedRolloutServer``; otherwise the executable's name."""
    title = cmdline[0] if cmdline else ""
    if title.startswith("ray::"):
        return title[len("ray::") :].split(".")[0].split(" ")[0] or "ray worker"
    return name


def cpu_of_others(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role of the other processes spent between two :func:`others_cpu` readings (a process started
    meanwhile counts from zero; one gone by the second reading is not counted)."""
    roles: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        roles[role] = roles.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return roles


def timed_admission_loop(*args: Any, **kwargs: Any) -> Any:
    """Our :class:`AdmissionLoop`, counting the admission thread's CPU per poll."""
    from areal_plugins.driver.admission import AdmissionLoop

    class TimedAdmissionLoop(AdmissionLoop):
        poll_cpu_s: list[float]

        def poll_once(self) -> None:
            started = time.thread_time()
            super().poll_once()
            self.poll_cpu_s.append(time.thread_time() - started)

    loop = TimedAdmissionLoop(*args, **kwargs)
    loop.poll_cpu_s = []
    return loop


def timed_buffer(max_staleness: int) -> Any:
    """Our :class:`OldestFirstBuffer`, noting when it first holds ``want`` groups."""
    from areal_plugins.core.buffer import OldestFirstBuffer

    class TimedBuffer(OldestFirstBuffer):
        want = 1
        ready_at: float | None = None

        def put(self, group: Any) -> None:
            super().put(group)
            if self.ready_at is None and len(self) >= self.want:
                self.ready_at = time.perf_counter()

        def expect(self, want: int) -> None:
            with self._ready:
                self.want = want
                self.ready_at = time.perf_counter() if len(self._groups) >= want else None

    return TimedBuffer(max_staleness)


def run_once(
    rig: Any,
    config: Config,
    steps: int,
    warmup: int,
    tokens_per_s: float,
    lengths: tuple[int, int],
    train_s: float,
    update_s: float,
    seed: int,
    idle_s: float = IDLE_S,
) -> dict[str, Any]:
    """One repeat of one configuration: ``warmup`` steps, then ``steps`` counted ones; the repeat's measures."""
    from areal_plugins.core.staleness import StalenessController
    from areal_plugins.rollout.server_slots import CONTROL_SLOTS

    rng = random.Random(seed)
    run_tag = f"r{time.monotonic_ns()}"  # uids unique across configurations and repeats
    rig.start_engines(config.engines, tokens_per_s, max(1000, config.requests_bound + CONTROL_SLOTS))
    controller = StalenessController(config.eta, config.batch, (config.eta + 1) * config.batch)
    buffer = timed_buffer(config.eta)
    store = TimedStore(rig.store)
    decided: dict[int, float] = {}
    submits: list[float] = []  # seconds each submission took in the driver (register the prompts, hand them out)
    counter = iter(range(1 << 62))
    version = {"now": 0}

    def submit(count: int) -> int:  # ArealAsyncTrainer._add_prompts_to_generate -> verl's _submit_batch_to_rollout
        now = time.time()
        groups = []
        for _ in range(count):
            index = next(counter)
            decided[index] = now
            groups.append((f"{run_tag}g{index}", index, [rng.randint(*lengths) for _ in range(config.answers)]))
        tags = [{"is_prompt": True, "status": "pending", "global_steps": version["now"]} for _ in groups]
        rig.store.kv_batch_put(keys=[uid for uid, _, _ in groups], partition_id=PARTITION, tags=tags)
        rig.dispatch(groups, version["now"])
        submits.append(time.time() - now)
        return count

    if rig.settled_reports is not None:
        rig.settled_reports()  # reports left by the previous configuration's groups
    loop = timed_admission_loop(
        controller,
        buffer,
        submit,
        (lambda _: True) if config.reads_rows else None,
        POLL_S,
        store,
        failure_limit=2 * config.batch,
        settled_reports=None if config.listing else rig.settled_reports,
    )
    stats_latency: list[float] = []
    in_flight: list[int] = []
    stop = threading.Event()

    stats_cpu = {"s": 0.0}

    def watch_stats() -> None:  # engine_stats.py's monitor: every engine's get_stats, while they generate
        while not stop.wait(STATS_EVERY_S):
            answers = rig.call_engines("get_stats")
            stats_latency.extend(seconds for seconds, _ in answers)
            in_flight.append(sum(stats["in_flight"] for _, stats in answers))
            stats_cpu["s"] = time.thread_time()

    watcher = threading.Thread(target=watch_stats, name="bench-stats", daemon=True)
    idle_from = time.process_time()
    time.sleep(idle_s)  # engines and workers up, nothing submitted: what the driver process spends anyway
    idle_cpu = (time.process_time() - idle_from) / idle_s
    loop.resume(0)
    loop.start()
    watcher.start()
    cpu_marks: list[float] = []
    stats_cpu_from = 0.0
    others_from: dict[int, tuple[str, float]] = {}
    others_to: dict[int, tuple[str, float]] = {}
    trainer_cpu: list[float] = []
    walls: list[float] = []
    ready: list[float] = []
    aborts: list[float] = []
    resumes: list[float] = []
    stats_at_update: list[float] = []
    admission: list[float] = []
    polls_before = 0
    try:
        for step in range(warmup + steps):
            counted = step >= warmup
            if step == warmup:
                cpu_marks.append(time.process_time())
                trainer_cpu.append(time.thread_time())
                stats_cpu_from = stats_cpu["s"]
                others_from = others_cpu()
                polls_before = len(loop.poll_cpu_s)
                del stats_latency[:], in_flight[:], store.list_s[:], store.listing_entries[:], submits[:]
            started = time.perf_counter()
            buffer.expect(config.batch)
            asked = time.perf_counter()
            while True:  # ArealAsyncTrainer._take_train_batch
                loop.check_alive()
                groups, _ = buffer.take(config.batch, version["now"], timeout=1.0)
                if groups:
                    break
            rig.store.kv_clear(keys=[g.group_id for g in groups], partition_id=PARTITION)
            keys = [key for g in groups for key in g.keys]
            tags = [tag for g in groups for tag in g.tags]  # with keys, the KVBatchMeta handed to verl
            if len(keys) != len(tags) or len(keys) != config.trajectories_per_step:
                raise RuntimeError(f"step {step}: {len(keys)} trajectories, expected {config.trajectories_per_step}")
            has = time.perf_counter()
            time.sleep(train_s)  # the trainer's step on its devices
            rig.store.kv_clear(keys=keys, partition_id=PARTITION)  # verl clears a trained batch
            # The weight update (ArealAsyncTrainer.on_step_end, verl's checkpoint manager): pause admission, abort
            # the engines, update, resume; then the step reads the engines' statistics.
            loop.pause()
            abort = rig.call_engines("abort_all_requests")
            version["now"] += 1
            rig.call_engines("update_weights", {}, version["now"])
            time.sleep(update_s)
            resume = rig.call_engines("resume_generation")
            loop.resume(version["now"])
            stats = rig.call_engines("get_stats")
            arrivals = [answer for _, answer in rig.call_engines("take_arrivals")]
            if counted:
                cpu_marks.append(time.process_time())
                trainer_cpu.append(time.thread_time())
                others_to = others_cpu()
                walls.append(time.perf_counter() - started)
                ready.append(ready_to_trainer(buffer.ready_at or asked, asked, has))
                aborts.extend(seconds for seconds, _ in abort)
                resumes.extend(seconds for seconds, _ in resume)
                stats_at_update.extend(seconds for seconds, _ in stats)
                admission.extend(admission_latencies(decided, arrivals))
            for group in {group for engine in arrivals for group in engine}:
                decided.pop(group, None)
    finally:
        stop.set()
        watcher.join(timeout=30)
        loop.stop()
        rig.stop_engines()
    per_step, per_1k = cpu_per_step(cpu_marks, config.trajectories_per_step)
    polls = loop.poll_cpu_s[polls_before:]
    roles = {role: seconds / steps for role, seconds in cpu_of_others(others_from, others_to).items()}
    own_threads = sum(polls) / steps + (trainer_cpu[-1] - trainer_cpu[0]) / steps
    own_threads += (stats_cpu["s"] - stats_cpu_from) / steps
    return {
        "steps": steps,
        "cpu_s_per_step": per_step,
        "cpu_s_per_1k_trajectories": per_1k,
        "step_wall_s": statistics.mean(walls),  # a mean: at η >= 1 short and long steps alternate
        "admission_s": median(admission),
        "admission_p90_s": p90(admission),
        "submit_s": median(submits),
        "ready_to_trainer_s": median(ready),
        "poll_cpu_ms": None if not polls else 1000 * statistics.mean(polls),
        "kv_list_ms": None if not store.list_s else 1000 * statistics.mean(store.list_s),
        "listing_entries": median(store.listing_entries),
        "admission_cpu_s_per_step": sum(polls) / steps,
        "trainer_cpu_s_per_step": (trainer_cpu[-1] - trainer_cpu[0]) / steps,
        "stats_thread_cpu_s_per_step": (stats_cpu["s"] - stats_cpu_from) / steps,
        "client_threads_cpu_s_per_step": per_step - own_threads,
        "other_processes_cpu_s_per_step": sum(roles.values()),
        "other_processes_cpu_s_per_step_by_role": roles,
        "idle_cpu_s_per_s": idle_cpu,
        "abort_s": median(aborts),
        "resume_s": median(resumes),
        "stats_at_update_s": median(stats_at_update),
        "stats_under_load_s": median(stats_latency),
        "stats_under_load_max_s": max(stats_latency, default=None),
        "in_flight_peak": max(in_flight, default=None),
    }


# ---------------------------------------------------------------------------------------------- poll scale


def poll_scale_once(
    store: Any,
    groups: int,
    answers: int,
    response_tokens: int,
    polls: int,
    reports: bool = False,
    inbox: Any = None,
    summaries: bool = False,
) -> dict[str, Any]:
    """Our admission loop against a partition holding ``groups`` finished groups of ``answers`` trajectories.

    ``reports``: the loop learns which groups settled from the workers' reports (actors/settled_groups.py, as
    in a run, through the ``inbox`` actor when given), having made its first look at the partition while it was
    still empty; else it lists the partition on every poll. ``summaries``: the reports carry each trajectory's
    summary and no accept hook is installed, so no row is read back (else one is, and every row is read). The first
    poll settles them all (fetch, build each :class:`Trajectory`, the accept hook, the buffer; or the summaries):
    its CPU per trajectory. Then ``polls`` polls with nothing
    new, as while the trainer trains and the engines generate: what one look costs with that many entries held.
    CPU is the whole process's (TransferQueue's client works in a thread of its own); nothing else runs meanwhile.
    """
    from types import SimpleNamespace

    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from areal_plugins.core.staleness import StalenessController
    from areal_plugins.core.trajectory_rows import output_summary

    clear_partition(store)
    settled: list[tuple[str, list[str], list[dict[str, Any]] | None]] = []
    tag = f"s{time.monotonic_ns()}"
    uids = [f"{tag}g{g}" for g in range(groups)]
    store.kv_batch_put(keys=uids, partition_id=PARTITION, tags=[{"is_prompt": True, "status": "pending"}] * groups)
    tokens = torch.full((response_tokens,), 7, dtype=torch.int64)
    extra = {"token_versions": [0] * response_tokens, "min_global_steps": 0, "max_global_steps": 0}
    row = {
        "prompts": torch.tensor([1, 2, 3, 4]),
        "responses": tokens,
        "response_mask": torch.ones_like(tokens),
        "rollout_log_probs": torch.full((response_tokens,), -0.5),
        "rm_scores": torch.zeros(response_tokens),
        "extra_fields": extra,
    }
    chunk = max(1, 4096 // answers)  # groups per put
    for first in range(0, groups, chunk):
        batch = uids[first : first + chunk]
        keys = [f"{uid}_{i}_0" for uid in batch for i in range(answers)]
        store.kv_batch_put(
            keys=keys,
            partition_id=PARTITION,
            tags=[{"status": "success", "min_global_steps": 0, "max_global_steps": 0}] * len(keys),
            fields=list_of_dict_to_tensordict([row] * len(keys)),
        )
        store.kv_batch_put(keys=batch, partition_id=PARTITION, tags=[{"status": "finished"}] * len(batch))
        settled += [(uid, [f"{uid}_{i}_0" for i in range(answers)], None) for uid in batch]
    if summaries:  # what each worker computed of its own trajectories (their CPU is not the driver's)
        written = SimpleNamespace(
            prompt_ids=[1, 2, 3, 4], response_ids=tokens.tolist(), response_mask=[1] * response_tokens,
            response_logprobs=[-0.5] * response_tokens, reward_score=0.0, extra_fields=extra,
        )  # fmt: skip
        summary = output_summary("g", written)
        settled = [(uid, keys, [dict(summary or {}) for _ in keys]) for uid, keys, _ in settled]
    controller = StalenessController(0, groups, groups)
    controller.on_submit(groups)
    buffer = timed_buffer(0)
    timed = TimedStore(store)
    accept = None if summaries else (lambda _: True)
    loop = timed_admission_loop(controller, buffer, lambda n: n, accept, POLL_S, timed, 2 * groups)
    loop.pause()  # nothing is submitted: only the look at the partition is measured
    if reports and inbox is not None:
        import ray

        from areal_plugins.actors.settled_groups import drain_reports

        drain_reports(inbox)  # nothing left from an earlier shape
        ray.get([inbox.report.remote(*report) for report in settled])
        loop.settled_reports = lambda: drain_reports(inbox)
    elif reports:
        loop.settled_reports = lambda: [settled.pop() for _ in range(len(settled))][::-1]
        loop._next_listing = time.monotonic() + 3600  # its first look, at an empty partition, was before the groups
    cpu, wall = time.process_time(), time.perf_counter()
    loop.poll_once()
    settle_cpu, settle_wall = time.process_time() - cpu, time.perf_counter() - wall
    if len(buffer) != groups:
        raise RuntimeError(f"the first poll buffered {len(buffer)} groups, expected {groups}")
    del timed.list_s[:]
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(polls):
        loop.poll_once()
    poll_cpu, poll_wall = (time.process_time() - cpu) / polls, (time.perf_counter() - wall) / polls
    list_wall = statistics.mean(timed.list_s) if timed.list_s else 0.0
    clear_partition(store)
    return {
        "reports": reports,
        "summaries": summaries,
        "settle_cpu_ms_per_trajectory": 1000 * settle_cpu / (groups * answers),
        "settle_wall_ms_per_trajectory": 1000 * settle_wall / (groups * answers),
        "idle_poll_cpu_ms": 1000 * poll_cpu,
        "idle_poll_wall_ms": 1000 * poll_wall,
        "idle_poll_kv_list_wall_ms": 1000 * list_wall,
        "core_share_at_poll_interval": poll_cpu / (POLL_S + poll_wall),
    }


POLL_MEASURES = (
    "settle_cpu_ms_per_trajectory",
    "settle_wall_ms_per_trajectory",
    "idle_poll_cpu_ms",
    "idle_poll_wall_ms",
    "idle_poll_kv_list_wall_ms",
    "core_share_at_poll_interval",
)


def poll_scale(rig: Any, shapes: list[tuple[int, int, int]], repeats: int, polls: int, out: Callable) -> list:
    """:func:`poll_scale_once` per ``(groups, answers, response tokens)``, listing and with the workers' reports,
    shapes and modes interleaved within each repeat."""
    modes = ((False, False), (True, False), (True, True))  # (reports, summaries)
    cases = [(*shape, *mode) for shape in shapes for mode in modes]
    results: dict[tuple[int, int, int, bool, bool], list[dict[str, Any]]] = {case: [] for case in cases}
    for _ in range(repeats):
        for case in cases:
            result = poll_scale_once(
                rig.store, *case[:3], polls=polls, reports=case[3], inbox=rig.inbox, summaries=case[4]
            )
            results[case].append(result)
            out(f"poll scale {case}: {json.dumps(result)}")
    rows = []
    for (groups, answers, tokens, reports, summaries), repeat_results in results.items():
        row: dict[str, Any] = {"groups": groups, "answers": answers, "response_tokens": tokens}
        found_by = "the workers' reports" if reports else "listing every poll"
        row["finds_settled_groups_by"] = found_by + (", with their summaries (no rows read)" if summaries else "")
        row |= {"entries": groups * (answers + 1), "repeats": len(repeat_results), "polls": polls}
        row |= {key: spread((result[key] for result in repeat_results), count="repeats") for key in POLL_MEASURES}
        rows.append(row)
    return rows


def poll_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "groups × answers (entries held)", "finds settled groups by", "response tokens", "repeats",
        "settle CPU ms / trajectory",
        "idle poll CPU ms", "idle poll wall ms", "of it: kv_list wall ms", "share of a core at 50 ms polls",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{row['groups']} × {row['answers']} ({row['entries']})", row["finds_settled_groups_by"]]
        cells += [str(row["response_tokens"])]
        cells += [str(row["repeats"]), fmt(row["settle_cpu_ms_per_trajectory"]), fmt(row["idle_poll_cpu_ms"])]
        cells += [fmt(row["idle_poll_wall_ms"]), fmt(row["idle_poll_kv_list_wall_ms"])]
        cells += [fmt(row["core_share_at_poll_interval"], digits=2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- output


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_at_start": os.getloadavg(),
    }


def fmt(cell: dict[str, Any], scale: float = 1.0, digits: int = 3) -> str:
    if cell["median"] is None:
        return "—"
    m, lo, hi = (cell[k] * scale for k in ("median", "min", "max"))
    if cell["repeats"] == 1:
        return f"{m:.{digits}g}"
    return f"{m:.{digits}g} ({lo:.{digits}g}–{hi:.{digits}g})"


CPU_COLUMNS = (
    ("driver CPU s / step", "cpu_s_per_step", 1.0),
    ("driver CPU s / 1k traj.", "cpu_s_per_1k_trajectories", 1.0),
    ("of it: admission thread", "admission_cpu_s_per_step", 1.0),
    ("of it: trainer loop", "trainer_cpu_s_per_step", 1.0),
    ("of it: statistics thread", "stats_thread_cpu_s_per_step", 1.0),
    ("of it: Ray's and TransferQueue's client threads", "client_threads_cpu_s_per_step", 1.0),
    ("driver idle CPU s / s", "idle_cpu_s_per_s", 1.0),
    ("poll CPU ms", "poll_cpu_ms", 1.0),
    ("kv_list ms (wall)", "kv_list_ms", 1.0),
    ("entries listed / poll", "listing_entries", 1.0),
    ("other processes CPU s / step", "other_processes_cpu_s_per_step", 1.0),
    ("step wall s", "step_wall_s", 1.0),
)
LATENCY_COLUMNS = (
    ("admission ms", "admission_s", 1000.0),
    ("admission p90 ms", "admission_p90_s", 1000.0),
    ("of it: the driver's submit ms", "submit_s", 1000.0),
    ("batch ready → trainer ms", "ready_to_trainer_s", 1000.0),
    ("abort ms", "abort_s", 1000.0),
    ("resume ms", "resume_s", 1000.0),
    ("stats ms at update", "stats_at_update_s", 1000.0),
    ("stats ms under load", "stats_under_load_s", 1000.0),
    ("stats ms under load, max", "stats_under_load_max_s", 1000.0),
    ("requests in flight, peak", "in_flight_peak", 1.0),
)


def table(rows: list[dict[str, Any]], columns: tuple[tuple[str, str, float], ...] = CPU_COLUMNS) -> str:
    """A results table as Markdown: each cell the median over repeats and (min–max)."""
    header = ["B×n, η, engines", "repeats × steps", *[title for title, _, _ in columns]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["name"], f"{row['repeats']} × {row['steps_per_repeat']}"]
        cells += [fmt(row[key], scale) for _, key, scale in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(rows: list[dict[str, Any]]) -> str:
    return table(rows, CPU_COLUMNS) + "\n\n" + table(rows, LATENCY_COLUMNS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=[], help="BxN:ETA:ENGINES, e.g. 512x16:4:8")
    parser.add_argument(
        "--poll-scale",
        nargs="*",
        default=[],
        help="GROUPSxANSWERS:TOKENS, e.g. 2560x16:16: one admission poll against that many finished groups",
    )
    parser.add_argument("--polls", type=int, default=20, help="idle polls measured per --poll-scale shape")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="counted steps per repeat")
    parser.add_argument("--warmup", type=int, default=1, help="steps before counting (the pipeline fills)")
    parser.add_argument("--tokens-per-s", type=float, default=200.0, help="decode rate of one request")
    parser.add_argument("--lengths", default="32:256", help="MIN:MAX response tokens, uniform per request")
    parser.add_argument("--train-s", type=float, default=1.0, help="the trainer's step on its devices (a sleep)")
    parser.add_argument("--update-s", type=float, default=0.2, help="the weight transfer (a sleep)")
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="seconds the idle driver's CPU is measured")
    parser.add_argument("--workers", type=int, default=2, help="rollout workers (verl's agent-loop workers)")
    parser.add_argument("--rig", choices=("ray", "local"), default="ray")
    parser.add_argument("--out", type=Path, help="write (or with --append, extend) this JSON")
    parser.add_argument("--append", action="store_true", help="add the rows to --out's existing ones")
    parser.add_argument("--table", type=Path, help="print the Markdown table of this JSON and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> dict[str, Any]:
    args = parse_args(argv)
    if args.table:
        result = json.loads(args.table.read_text())
        out(tables(result["rows"]) + "\n\n" + poll_table(result.get("poll_rows", [])))
        return result
    configs = [Config.parse(text) for text in args.configs]
    shapes = [parse_shape(text) for text in args.poll_scale]
    if not configs and not shapes:
        raise SystemExit("nothing to run: give --configs and/or --poll-scale")
    low, high = (int(x) for x in args.lengths.split(":"))
    rig = RayRig(args.workers, high) if args.rig == "ray" else LocalRig(args.workers, high)
    per_config: dict[Config, list[dict[str, Any]]] = {config: [] for config in configs}
    wall_started = time.time()
    cpu_started = resource.getrusage(resource.RUSAGE_SELF)
    poll_rows = []
    try:
        if shapes:
            poll_rows = poll_scale(rig, shapes, args.repeats, args.polls, out)
        for repeat in range(args.repeats if configs else 0):  # configurations interleaved within each repeat
            for config in configs:
                result = run_once(
                    rig, config, args.steps, args.warmup, args.tokens_per_s, (low, high), args.train_s,
                    args.update_s, seed=repeat, idle_s=args.idle_s,
                )  # fmt: skip
                per_config[config].append(result)
                out(f"repeat {repeat} {config.name}: {json.dumps(result)}")
    finally:
        rig.close()
    used = resource.getrusage(resource.RUSAGE_SELF)
    run = {
        "command": "tools/bench_control_plane.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "rig": args.rig,
        "machine": machine(),
        "tokens_per_s": args.tokens_per_s,
        "lengths": [low, high],
        "train_s": args.train_s,
        "update_s": args.update_s,
        "workers": args.workers,
        "wall_s": time.time() - wall_started,
        "driver_cpu_s_total": used.ru_utime + used.ru_stime - cpu_started.ru_utime - cpu_started.ru_stime,
    }
    rows = [summarize(config, repeats) | {"run": run} for config, repeats in per_config.items()]
    poll_rows = [row | {"run": run} for row in poll_rows]
    result = {"rows": rows, "poll_rows": poll_rows}
    if args.out:
        if args.append and args.out.exists():
            before = json.loads(args.out.read_text())
            result = {"rows": before["rows"] + rows, "poll_rows": before.get("poll_rows", []) + poll_rows}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if rows:
        out(tables(rows))
    if poll_rows:
        out(poll_table(poll_rows))
    return result


def parse_shape(text: str) -> tuple[int, int, int]:
    """``GROUPSxANSWERS:TOKENS`` of ``--poll-scale``."""
    try:
        shape, tokens = text.split(":")
        groups, answers = shape.lower().split("x")
        return int(groups), int(answers), int(tokens)
    except ValueError:
        raise SystemExit(f"--poll-scale: {text!r} is not GROUPSxANSWERS:TOKENS (e.g. 2560x16:16)") from None


if __name__ == "__main__":
    main()
