"""Async vs sync on the same hardware: ``python tools/bench.py`` (from a source checkout).

Trains the same recipe body (task, model, seeds, batch) in synchronous verl (``grpo_cpu_sync``,
our features off) and in our async trainer at each η and placement, repeats every configuration,
and writes ``bench.json`` + ``bench.png`` with medians and spread:

- the synchronous baseline is verl's own loop with its replay buffer polling every ``--sync-poll-s``
  (0.05 s, as our async trainer polls; verl's fixed 2 s would add ~1 s of idle per sync step);
- wall time of steps 2..N (step 1 also starts verl's agent-loop workers; it is excluded on both sides)
  and the tokens trained in those steps; ``speedup`` = sync seconds per trained token / async
  seconds per trained token (the same number of trained tokens on both sides, to first order:
  both consume the same batches of the same prompts);
- the ideal overlap bound from sync's own phase times, (T_gen + T_train) / max(T_gen, T_train);
- where the speedup comes from: the machine's busy CPU time over the counted steps (sampled every 0.5 s)
  splits it into *less CPU work per token* (e.g. ``prox_logp: loglinear`` skips the old-log-prob
  pass) x *busier cores* (overlap); ``sync_core_headroom`` = cores / sync's busy cores is the most overlap
  alone can gain while doing sync's work (``--prox-logp loglinear,recompute`` runs both modes);
- who did that work: CPU seconds per 1k trained tokens of each process role (Ray's ``ray::Class`` titles:
  the trainer's ``WorkerDict``, the engines, the agent-loop workers, the driver's ``TaskRunner``, Ray's own);
- trainer and rollout idle ratios of the async runs, final reward (last 3 steps' mean).
- staleness, one definition for every row (``tools/areal_bench/token_staleness.py``): per trained response token,
  the version the step's update starts from less the version that generated it (mean, max), and per trajectory from
  its oldest and its newest token; verl's rows record their tokens' versions read-only for it
  (``tools/areal_bench/verl_token_versions.py``). ``--recompute-staleness DIR`` fills an earlier bench's figures;
- ``--in-flight interrupt,wait`` runs our rows also with ``areal.weight_update.in_flight=wait`` (a weight update
  waits for the generations under way: the paper's interruption ablation), and every row reports the engines'
  generated tokens/s beside its trained tokens/s.

``--warmup-steps N`` leaves out the first N steps (an async run's backlog of rollouts in flight fills up over
its first steps); ``--frozen-policy`` trains at learning rate 0, so every configuration does the same work per
step on response lengths that do not drift apart as each run's policy learns.

Workloads: ``longtail`` (default; answers after a lognormal run of thinking tokens, so a batch waits for its
longest response, as in reasoning RL; its tiny model is built on first use, ~3 min) and ``addition`` (the
recipes' short answers). ``--quick`` (addition, 8 prompts per step, sync and async separate η = 4,
2 repeats, 4 steps) is the smoke version, under 10 minutes on 2 cores.

``--workload gpu-shaped --case paper-1.5b``: the engines are the paced stand-in decoding as the case's GPU engines
do (``tools/areal_bench/gpu_shaped.py``: the planner's decode model, the case's answer lengths times
``--length-scale``), so they use no CPU worth counting and the trainer (the recipes' tiny model) has the cores to
itself, as it has its GPUs on a cluster. Its time scale makes a synchronous step here divide between generation
and training as the case's does: from ``--trainer-step-s``, or measured first by a 3-step synchronous run
(``calibrate/``); ``bench.json`` states it under ``time_scale``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import areal_bench
from areal_bench.core_pinning import TRAINER_ROLES, CorePinner, split_cores
from areal_bench.token_staleness import DEFINITION as STALENESS_DEFINITION
from repeats import spread

from areal_plugins.records.writer import read_jsonl

if TYPE_CHECKING:
    from areal_bench.gpu_shaped import TimeScale

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
#: verl 0.9.1's sync ReplayBuffer poll interval (not a config key).
VERL_POLL_S = 2.0


@dataclass
class Config:
    name: str
    recipe: str
    overrides: list[str] = field(default_factory=list)
    eta: int | None = None
    placement: str | None = None
    micro_batching: str = "fixed"  # what the run used: "fixed" (the recipe's micro-batch size) or "budget N"


def sync_poll_overrides(poll_s: float) -> list[str]:
    """verl's sync replay buffer polling every ``poll_s`` (verl's own 2 s: no override; see baseline_sampler.py)."""
    if poll_s == VERL_POLL_S:
        return []
    return [
        "trainer.v1.sampler.custom_sampler.path=pkg://areal_bench.baseline_sampler",
        "trainer.v1.sampler.custom_sampler.name=PollingReplayBuffer",
        f"+trainer.v1.sampler.sampler_kwargs.poll_interval_s={poll_s}",
    ]


#: verl's own asynchronous trainers on the sync recipe (our features off), stock settings otherwise.
#: separate_async needs a standalone rollout pool (one fake GPU slot beside the trainer's) fed by a
#: checkpoint engine that is not "naive" (our areal_gloo on CPU); parameter_sync_step=1 keeps one optimizer
#: step per batch of 16 groups, the work of every other row (verl requires train_batch_size =
#: parameter_sync_step x ppo_mini_batch_size). Its hybrid replicas stay on (verl's default): verl 0.9.1's
#: hybrid_engine=false path fails at startup (trainer_separate_async.py passes flush=True to logger.info).
VERL_ASYNC = {
    "colocate_async": ["trainer.v1.trainer_mode=colocate_async"],
    "separate_async": [
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=areal_gloo",
        "ray_kwargs.ray_init.num_gpus=2",
        "++actor_rollout_ref.rollout.engine_kwargs.areal_cpu.num_threads=1",
        "++ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS='1'",
    ],
}


def configs(
    etas: list[int],
    placements: list[str],
    prox_logps: list[str],
    sync_poll_s: float,
    verl_async: list[str] = (),
    max_concurrent: list[int | None] = (None,),
    micro_batch_tokens: list[int | None] = (None,),
    verl_tuned_batches: float | None = None,
    split_engines: list[int] = (),
    split_eta: int = 2,
    in_flights: list[str] = ("interrupt",),
) -> list[Config]:
    """sync, verl's async modes, then ours per placement x η x proximal log-prob mode (the first mode's names
    carry no suffix). verl's rows poll their replay buffer as the sync baseline does.

    ``micro_batch_tokens``: None keeps the recipes' fixed micro-batches; N gives verl's async rows verl's own
    token-budget micro-batching (``use_dynamic_bsz``) at N tokens and ours ``areal.micro_batch.max_tokens=N``;
    with one budget only, the synchronous row gets it too (every row then trains with the same micro-batches).
    ``verl_tuned_batches``: each verl mode also runs ``-tuned``, with that many batches of prompts kept in flight
    ahead of the trainer (``num_warmup_batches``; verl's default 1). ``split_engines``: our separate placement
    also runs at ``split_eta`` with that many engines (``-engines{k}``), for other rollout:trainer splits.
    ``in_flights``: our rows run with each ``areal.weight_update.in_flight`` (``interrupt``: the paper's interruptible
    generation; ``wait``: the update waits for the generations under way, the paper's ablation, named ``-wait``).
    """

    def budget_keys(tokens: int | None) -> list[str]:
        if tokens is None:
            return []
        return [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens}",
        ]

    one_budget = micro_batch_tokens[0] if len(micro_batch_tokens) == 1 else None
    out = [
        Config(
            "sync",
            "grpo_cpu_sync.yaml",
            [*sync_poll_overrides(sync_poll_s), *budget_keys(one_budget)],
            micro_batching="fixed" if one_budget is None else f"budget {one_budget}",
        )
    ]
    for mode in verl_async:
        for tokens in micro_batch_tokens:
            overrides = [*sync_poll_overrides(sync_poll_s), *VERL_ASYNC[mode], *budget_keys(tokens)]
            suffix = "" if tokens is None or tokens == one_budget else f"-mb{tokens}"
            batching = "fixed" if tokens is None else f"budget {tokens}"
            out.append(Config(f"verl-{mode}{suffix}", "grpo_cpu_sync.yaml", overrides, micro_batching=batching))
            if verl_tuned_batches is not None:
                tuned = [*overrides, f"trainer.v1.{mode}.num_warmup_batches={verl_tuned_batches}"]
                out.append(Config(f"verl-{mode}{suffix}-tuned", "grpo_cpu_sync.yaml", tuned, micro_batching=batching))
    for placement in placements:
        recipe = "grpo_cpu_async_separate.yaml" if placement == "separate" else "grpo_cpu_async.yaml"
        for eta in etas:
            for prox in prox_logps:
                for limit, tokens, in_flight in itertools.product(max_concurrent, micro_batch_tokens, in_flights):
                    overrides = [f"areal.max_staleness={eta}", f"areal.loss.prox_logp={prox}"]
                    overrides.append(f"areal.weight_update.in_flight={in_flight}")
                    suffix = "" if prox == prox_logps[0] else f"-{prox}"
                    if limit is not None:  # areal.max_concurrent_rollouts; None: the default
                        overrides.append(f"areal.max_concurrent_rollouts={limit}")
                        suffix += f"-mcr{limit}"
                    # The async recipes ship a token budget: "fixed" must turn it off to mean what it says.
                    overrides.append(f"areal.micro_batch.max_tokens={'null' if tokens is None else tokens}")
                    if tokens is not None and tokens != one_budget:
                        suffix += f"-mb{tokens}"
                    if in_flight == "wait":  # the ablation; interrupt (the default) carries no suffix
                        suffix += "-wait"
                    batching = "fixed" if tokens is None else f"budget {tokens}"
                    name = f"async-{placement}-eta{eta}{suffix}"
                    out.append(Config(name, recipe, overrides, eta, placement, micro_batching=batching))
                    if placement == "separate" and eta == split_eta:
                        for engines in split_engines:
                            more = [
                                f"actor_rollout_ref.rollout.n_gpus_per_node={engines}",
                                f"ray_kwargs.ray_init.num_gpus={engines + 1}",
                            ]
                            out.append(
                                Config(f"{name}-engines{engines}", recipe, [*overrides, *more], eta, placement,
                                       micro_batching=batching)
                            )  # fmt: skip
    return out


def measure(run_dir: Path, warmup_steps: int = 1) -> dict:
    """Per-run figures from verl's metrics.jsonl (+ our areal_steps.jsonl for async runs), over the steps after
    the first ``warmup_steps`` (step 1 includes starting verl's agent-loop workers; an async run's backlog of
    rollouts in flight builds up over its first steps)."""
    steps = [row["data"] for row in read_jsonl(run_dir / "metrics.jsonl") if "timing_s/step" in row["data"]]
    counted = steps[warmup_steps:]
    if not counted:
        raise RuntimeError(
            f"{run_dir}: no step after the {warmup_steps} warm-up step(s) in metrics.jsonl; see {run_dir / 'train.log'}"
        )
    wall = sum(s["timing_s/step"] for s in counted)
    tokens = sum(s["perf/total_num_tokens"] for s in counted)
    gen = [s.get("timing_s/gen", 0.0) for s in counted]
    train = [s["timing_s/step"] - g for s, g in zip(counted, gen, strict=True)]
    result = {
        "wall_s": wall,
        "trained_tokens": tokens,
        "s_per_1k_tokens": 1000 * wall / tokens,
        "step_s_median": statistics.median(s["timing_s/step"] for s in counted),
        "gen_s_median": statistics.median(gen),
        "train_s_median": statistics.median(train),
        # The pass ``prox_logp: loglinear`` skips (0 when a run does not make it).
        "old_log_prob_s_median": statistics.median(s.get("timing_s/old_log_prob", 0.0) for s in counted),
        "overlap_bound": statistics.median((g + t) / max(g, t) for g, t in zip(gen, train, strict=True)),
        "final_reward": statistics.mean(s["critic/score/mean"] for s in steps[-3:]),
        # The length distribution, for tools/simulate.py --calibrate-from.
        "response_len_mean": statistics.median(s["response_length/mean"] for s in counted),
        "response_len_max": statistics.median(s["response_length/max"] for s in counted),
        "prompt_len_mean": statistics.median(s["prompt_length/mean"] for s in counted),
        # The mean lengths hold every trajectory of the step, so tokens / (their sum) counts them.
        "trained_trajectories": round(
            sum(s["perf/total_num_tokens"] / (s["prompt_length/mean"] + s["response_length/mean"]) for s in counted)
        ),
        "trajectories_per_step": statistics.median(
            s["perf/total_num_tokens"] / (s["prompt_length/mean"] + s["response_length/mean"]) for s in counted
        ),
    }
    result |= staleness_figures(run_dir, warmup_steps)
    # What a step's update waited for the generations under way (areal.weight_update.in_flight: wait).
    waits = [s["timing_s/wait_in_flight"] for s in counted if "timing_s/wait_in_flight" in s]
    if waits:
        result["wait_in_flight_s_median"] = statistics.median(waits)
    ours = read_jsonl(run_dir / "areal_steps.jsonl")[warmup_steps:]
    for key in (
        "areal/trainer_idle_ratio",
        "areal/rollout_idle_ratio",
        "areal/staleness_mean",
        "areal/interrupted_fraction",
        "areal/gen_tokens_per_s",  # tokens the engines generated per second (the interruption ablation's figure)
    ):
        values = [row[key] for row in ours if key in row]
        if values:
            result[key.split("/")[1]] = statistics.mean(values)
    return result


#: verl's V1 trainers' per-step staleness metrics (``trainer/ppo/v1/trainer_base.py:1966-1992``), logged for every
#: row (ours run through verl's V1 trainer too): the newest version (verl's lower bound) and the oldest (head).
VERL_STALENESS = {
    "verl_trajectory_staleness": "training/off_policy/trajectory_staleness",
    "verl_trajectory_staleness_worst": "training/off_policy/trajectory_staleness_worst",
}


def staleness_figures(run_dir: Path, warmup_steps: int) -> dict:
    """One run's staleness over the steps after the first ``warmup_steps``: the per-token and per-trajectory figures
    of every row (:mod:`areal_bench.token_staleness`, with their definitions), and verl's own two metrics.

    A run without per-trajectory records (before they were written) still gets its head staleness from verl's
    ``trajectory_staleness_worst`` (the same definition, averaged per step), and no per-token figure: verl's first and
    last version of a trajectory do not say how many of its tokens each generated."""
    from areal_bench.token_staleness import run_figures

    steps = [row["data"] for row in read_jsonl(run_dir / "metrics.jsonl") if "timing_s/step" in row["data"]]
    counted = steps[warmup_steps:]
    result: dict = {}
    for name, key in VERL_STALENESS.items():
        means = [s[f"{key}/mean"] for s in counted if f"{key}/mean" in s]
        if means:
            result[name] = statistics.mean(means)
            result[f"{name}_max"] = max(s[f"{key}/max"] for s in counted if f"{key}/max" in s)
    result |= run_figures(run_dir, warmup_steps)
    if "head_staleness_mean" not in result and "verl_trajectory_staleness_worst" in result:
        result["head_staleness_mean"] = result["verl_trajectory_staleness_worst"]
        result["head_staleness_max"] = result["verl_trajectory_staleness_worst_max"]
        result["staleness_source"] = "metrics.jsonl (head only)"
    return result


class CpuSampler:
    """Samples the machine's busy CPU seconds and the run's finished-step count (lines of verl's unbuffered
    ``metrics.jsonl``) every ``every_s``, so the busy cores over steps 2..N can be read afterwards; with
    ``root_pid`` set, also the CPU seconds of each process under it, by role (:func:`process_role`)."""

    def __init__(self, metrics: Path, every_s: float = 0.5) -> None:
        self.metrics, self.every_s = metrics, every_s
        self.samples: list[tuple[float, float, int]] = []  # (monotonic s, busy CPU s, steps finished)
        self.process_samples: list[tuple[int, dict[int, tuple[str, float]]]] = []  # (steps, pid -> (role, CPU s))
        self.root_pid: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.every_s):
            times = psutil.cpu_times()
            busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
            steps = len(self.metrics.read_bytes().splitlines()) if self.metrics.exists() else 0
            self.samples.append((time.monotonic(), busy, steps))
            if self.root_pid is not None:
                self.process_samples.append((steps, process_cpu(self.root_pid)))


def process_role(cmdline: list[str]) -> str:
    """What a process of a run is, from its command line: Ray titles its workers ``ray::Class.method``."""
    if not cmdline:
        return "other"
    title = cmdline[0]
    if title.startswith("ray::"):
        return title[len("ray::") :].split(".", 1)[0].split(" ", 1)[0]
    if any("areal_plugins.cli" in part for part in cmdline):
        return "driver"
    return Path(title).name


def process_cpu(root_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system CPU seconds) of ``root_pid`` and its descendants, now."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for process in processes:
        try:
            times = process.cpu_times()
            out[process.pid] = (process_role(process.cmdline()), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def cpu_by_role(
    process_samples: list[tuple[int, dict[int, tuple[str, float]]]], first_step: int, last_step: int
) -> dict[str, float] | None:
    """CPU seconds per role between the first samples showing ``first_step`` and ``last_step`` finished steps.

    A process that appeared in between counts from zero; one that ended in between counts up to its last
    sample (the run's actors exit within a sample of the last step's line)."""
    start_index = next((i for i, (steps, _) in enumerate(process_samples) if steps >= first_step), None)
    end_index = next((i for i, (steps, _) in enumerate(process_samples) if steps >= last_step), None)
    if start_index is None or end_index is None:
        return None
    start = process_samples[start_index][1]
    latest: dict[int, tuple[str, float]] = {}
    for _, processes in process_samples[start_index : end_index + 1]:
        latest.update(processes)
    roles: dict[str, float] = {}
    for pid, (role, cpu) in latest.items():
        before = start.get(pid)
        used = cpu - before[1] if before is not None and before[0] == role else cpu
        roles[role] = roles.get(role, 0.0) + max(used, 0.0)
    return roles


def busy_cores(samples: list[tuple[float, float, int]], first_step: int, last_step: int) -> float | None:
    """Mean busy cores between the first sample showing ``first_step`` finished steps and the first
    showing ``last_step`` (the counted steps: 2..N when ``first_step`` = 1)."""
    start = next((s for s in samples if s[2] >= first_step), None)
    end = next((s for s in samples if s[2] >= last_step), None)
    if start is None or end is None or end[0] <= start[0]:
        return None
    return (end[1] - start[1]) / (end[0] - start[0])


#: The paced workload's answers: this many tokens each, at this rate per answer (a GPU engine's per-sequence decode
#: rate at a large batch), so an answer takes 1.28 s whatever else is in flight.
PACED_TOKENS_PER_S = 50
PACED_RESPONSE_TOKENS = 64

#: Per workload: the tiny assets' directory and what its recipes must change.
WORKLOADS = {
    "addition": (REPO / ".areal" / "tiny", []),
    # Answers after a lognormal run of thinking tokens (median 8, capped at 200): room for the tail.
    "longtail": (REPO / ".areal" / "tiny_longtail", ["data.max_response_length=224"]),
    # The control plane through verl's trainers: engines with no model (areal_paced) that decode every answer to
    # the response limit at a GPU-like rate, and a trainer model of ~20k weights; both sides hold no real work, so
    # what the rows differ by is the driving of requests, batches and weight versions. The engine holds no
    # weights: our rows waive the two weight capabilities (named in their startup warning).
    # A GPU case's engines (areal_paced with engine_kwargs.areal_paced.case) and the recipes' tiny trainer: the case
    # name, its length and time scales are added by gpu_shaped_overrides (the time scale is measured per run).
    # Its trainer packs sequences (use_remove_padding), as GPU runs do: a step costs its tokens, not their padding.
    "gpu-shaped": (
        REPO / ".areal" / "tiny",
        [
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.rollout.name=areal_paced",
            "actor_rollout_ref.rollout.free_cache_engine=false",
            "areal.waive_capabilities=[weight_update,weight_checksum]",
        ],
    ),
    "paced": (
        REPO / ".areal" / "tiny_paced",
        [
            "actor_rollout_ref.rollout.name=areal_paced",
            "actor_rollout_ref.rollout.free_cache_engine=false",
            f"++actor_rollout_ref.rollout.engine_kwargs.areal_paced.tokens_per_s={PACED_TOKENS_PER_S}",
            f"data.max_response_length={PACED_RESPONSE_TOKENS}",
            "areal.waive_capabilities=[weight_update,weight_checksum]",
        ],
    ),
}


#: What a run does unless told otherwise: the full sweep, or ``--quick``'s smoke version.
FULL_DEFAULTS = {
    "steps": 12,
    "repeats": 3,
    "etas": "0,1,2,4,8",
    "placements": "separate,colocated",
    "workload": "longtail",
}
QUICK_DEFAULTS = {"steps": 4, "repeats": 2, "etas": "4", "placements": "separate", "workload": "addition"}

#: ``--frozen-policy``: every step's work is done (old log-probs, loss, backward, optimizer step, weight sync)
#: but the weights do not move, so response lengths stay the distribution of the start in every configuration.
FROZEN_POLICY = ["actor_rollout_ref.actor.optim.lr=0"]


def batch_overrides(prompts: int | None, answers: int | None) -> list[str]:
    """A step of ``prompts`` groups of ``answers``: one mini-batch per step in every row, as the recipes have
    (verl's separate_async needs train_batch_size = parameter_sync_step x ppo_mini_batch_size)."""
    out = []
    if prompts is not None:
        if prompts < 1:
            raise SystemExit(f"--prompts-per-step must be at least 1, got {prompts}")
        out += [f"data.train_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}"]
    if answers is not None:
        if answers < 2:
            raise SystemExit(f"--answers-per-prompt must be at least 2 (GRPO compares answers), got {answers}")
        out.append(f"actor_rollout_ref.rollout.n={answers}")
    return out


#: ``--quick``: 8 prompts per step (x 8 samples) instead of the recipes' 16.
QUICK_BATCH_PROMPTS = 8
QUICK_BATCH = [
    f"data.train_batch_size={QUICK_BATCH_PROMPTS}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={QUICK_BATCH_PROMPTS}",
]
#: Prompt tokens of an addition prompt where no run measured them (--trainer-step-s given): only the stand-in's
#: prefill depends on it (20 tokens on the 1.5B: 0.3 ms of a 5 ms step).
GPU_SHAPED_PROMPT_TOKENS = 20

#: Which tiny assets a workload trains on (its name in areal_plugins.tiny.model.WORKLOADS), where not its own name.
TINY_ASSETS = {"gpu-shaped": "addition"}
#: The recipes' batch, for the time scale where --prompts-per-step / --answers-per-prompt do not set it.
RECIPE_PROMPTS, RECIPE_ANSWERS = 16, 8
#: Steps of the synchronous run that measures the trainer's step for the gpu-shaped time scale (the first,
#: which starts verl's agent-loop workers, is left out).
CALIBRATION_STEPS = 3


def gpu_shaped_overrides(
    case: str, length_scale: float, time_scale: float, kv_capacity_tokens: float | None = None
) -> list[str]:
    """The gpu-shaped workload's engine keys: the case, its scales, answers capped at the case's cap x scale, and
    the engines' KV cache where one is given (a smaller engine than the case's)."""
    from areal_bench.gpu_shaped import case as find_case
    from areal_bench.gpu_shaped import scaled_lengths

    _, _, cap = scaled_lengths(find_case(case, "--case").workload, length_scale)
    key = "++actor_rollout_ref.rollout.engine_kwargs.areal_paced"
    return [
        f"{key}.case={case}",
        f"{key}.length_scale={length_scale!r}",
        f"{key}.time_scale={time_scale!r}",
        f"data.max_response_length={cap}",
        *([] if kv_capacity_tokens is None else [f"{key}.kv_capacity_tokens={kv_capacity_tokens!r}"]),
    ]


def gpu_shaped_time_scale(
    case: str,
    length_scale: float,
    trainer_step_s: float,
    prompts: int,
    answers: int,
    prompt_tokens: float,
    kv_capacity_tokens: float | None = None,
) -> TimeScale:
    """:func:`areal_bench.gpu_shaped.time_scale_for` for the bench's batch on one stand-in engine (every
    row's rollout pool: the colocated replica, or the separate pool's one slot)."""
    from areal_bench.gpu_shaped import StandInShape, time_scale_for
    from areal_bench.gpu_shaped import case as find_case

    shape = StandInShape(prompts, answers, round(prompt_tokens), length_scale, 1, kv_capacity_tokens)
    return time_scale_for(find_case(case, "--case"), trainer_step_s, shape)


@contextlib.contextmanager
def forwarding_signals(process: subprocess.Popen) -> Iterator[None]:
    """Ctrl-C or SIGTERM to the bench stops its current run too: the signal goes on to the ``train`` child (which
    stops verl and its Ray processes), the bench waits for it and exits with 128 + the signal."""
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        if process.poll() is None:
            process.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        process.wait()
        raise SystemExit(128 + received[0])


def run_one(
    config: Config,
    steps: int,
    repeat: int,
    seed: int,
    out_dir: Path,
    tiny_dir: Path,
    workload_overrides: list[str],
    warmup_steps: int = 1,
    trainer_cores: int | None = None,
) -> dict:
    run_dir = out_dir / f"{config.name}-r{repeat}"
    command = [
        sys.executable,
        "-m",
        "areal_plugins.cli",
        "train",
        str(RECIPES / config.recipe),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        *workload_overrides,
        *config.overrides,
        # The stand-ins in every process of the run; verl's rows (ours off) also record each trained token's version.
        *areal_bench.run_overrides(os.environ, token_versions=config.eta is None),
        "--run-dir",
        str(run_dir),
        "--tiny-dir",
        str(tiny_dir),
    ]
    started = time.monotonic()
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():  # a rerun into the same directory must not count the old steps
        metrics.rename(run_dir / "metrics.previous.jsonl")
    pinning = CorePinner(*split_cores(trainer_cores), process_role) if trainer_cores else contextlib.nullcontext()
    with CpuSampler(metrics) as cpu, pinning as pinner:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=areal_bench.run_environment(os.environ, token_versions=config.eta is None),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        cpu.root_pid = process.pid
        if pinner is not None:
            pinner.root_pid = process.pid
        with forwarding_signals(process):
            process.communicate()
    if process.returncode != 0:
        raise RuntimeError(
            f"{config.name} repeat {repeat} failed (exit {process.returncode}); see {run_dir / 'train.log'}"
        )
    if pinner is not None and not pinner.pinned:
        raise RuntimeError(
            f"{config.name} repeat {repeat}: --trainer-cores found no trainer worker to pin (a process titled "
            f"ray::{'/'.join(sorted(TRAINER_ROLES))}); the row would not be what it says"
        )
    figures = measure(run_dir, warmup_steps)
    figures["process_s"] = time.monotonic() - started
    if pinner is not None:
        figures["trainer_processes_pinned"] = len(pinner.pinned)
    cores = busy_cores(cpu.samples, warmup_steps, steps)
    if cores is not None:
        figures["busy_cores"] = cores
        figures["cpu_s_per_1k_tokens"] = figures["s_per_1k_tokens"] * cores  # the work, whoever did it
    roles = cpu_by_role(cpu.process_samples, warmup_steps, steps)
    if roles is not None:  # who did the work: the trainer's workers, the engines, the agent loops, the driver...
        for role, seconds in roles.items():
            figures[f"cpu_s_per_1k_tokens/{role}"] = 1000 * seconds / figures["trained_tokens"]
            figures[f"cpu_ms_per_trajectory/{role}"] = 1000 * seconds / figures["trained_trajectories"]
    return figures


def summarise(name: str, runs: list[dict], sync_runs: list[dict]) -> dict:
    keys = sorted({key for run in runs for key in run})
    row: dict = {"config": name}
    for key in keys:
        values = [run[key] for run in runs if key in run]
        # A label (where a figure came from) is listed; a number is spread over the repeats.
        row[key] = ", ".join(sorted(set(values))) if all(isinstance(v, str) for v in values) else spread(values)
    if sync_runs is not runs:
        sync_cost = statistics.median(run["s_per_1k_tokens"] for run in sync_runs)
        row["speedup"] = spread([sync_cost / run["s_per_1k_tokens"] for run in runs])
        # speedup = (sync CPU-s / async CPU-s per token) x (async busy cores / sync busy cores): exact for a
        # pair of runs, to within the spread against sync's medians. Less work vs busier cores (overlap).
        if all("busy_cores" in run for run in [*runs, *sync_runs]):
            sync_work = statistics.median(run["cpu_s_per_1k_tokens"] for run in sync_runs)
            sync_busy = statistics.median(run["busy_cores"] for run in sync_runs)
            row["speedup_from_less_work"] = spread([sync_work / run["cpu_s_per_1k_tokens"] for run in runs])
            row["speedup_from_busier_cores"] = spread([run["busy_cores"] / sync_busy for run in runs])
    return row


def _cell(figure: dict | None, form: str = "{:.2f}") -> str:
    """A spread as ``median (min-max)``; ``-`` where the row has none."""
    if not figure or figure.get("median") is None:
        return "-"
    centre, low, high = (form.format(figure[key]) for key in ("median", "min", "max"))
    return centre if low == high else f"{centre} ({low}-{high})"


def staleness_table(bench: dict) -> str:
    """Every row's trained and generated tokens per second and its staleness, measured one way for all rows (the
    definition printed under the table); medians over the repeats, min-max in brackets."""
    lines = [
        "| row | trained tokens/s | generated tokens/s | token staleness mean | token staleness max | head staleness "
        "mean | verl's trajectory_staleness | update waited for in-flight (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in bench["rows"]:
        cost = row["s_per_1k_tokens"]
        trained = {key: 1000 / cost[other] for key, other in (("median", "median"), ("min", "max"), ("max", "min"))}
        cells = [
            _cell(trained, "{:.0f}"),
            _cell(row.get("gen_tokens_per_s"), "{:.0f}"),
            _cell(row.get("token_staleness_mean")),
            _cell(row.get("token_staleness_max"), "{:.0f}"),
            _cell(row.get("head_staleness_mean")),
            _cell(row.get("verl_trajectory_staleness")),
            _cell(row.get("wait_in_flight_s_median")),
        ]
        lines.append(f"| {row['config']} | {' | '.join(cells)} |")
    return "\n".join([*lines, "", bench.get("staleness_definition", STALENESS_DEFINITION)])


def recompute_staleness(bench_dir: Path) -> int:
    """``--recompute-staleness``: fill the staleness figures of ``bench_dir/bench.json``'s runs from their run
    directories, re-summarise the rows, write it back and print :func:`staleness_table`. Runs whose directory is
    gone keep the figures they had."""
    path = bench_dir / "bench.json"
    if not path.exists():
        raise SystemExit(f"{path}: no bench.json; give the --out directory of an earlier tools/bench.py run")
    bench = json.loads(path.read_text())
    warmup, missing = bench.get("warmup_steps", 1), []
    for name, runs in bench["runs"].items():
        for repeat, figures in enumerate(runs):
            run_dir = bench_dir / f"{name}-r{repeat}"
            if (run_dir / "metrics.jsonl").exists():
                figures.update(staleness_figures(run_dir, warmup))
            else:
                missing.append(run_dir.name)
    kept = ("micro_batching", "recipe", "overrides")  # set by main, not by summarise
    extras = {row["config"]: {key: row[key] for key in kept if key in row} for row in bench["rows"]}
    sync_runs = bench["runs"]["sync"]
    bench["rows"] = [summarise(name, runs, sync_runs) | extras.get(name, {}) for name, runs in bench["runs"].items()]
    bench["staleness_definition"] = STALENESS_DEFINITION
    path.write_text(json.dumps(bench, indent=2))
    print(staleness_table(bench))
    if missing:
        print(f"no run directory with metrics.jsonl for {len(missing)} run(s), kept as they were: {', '.join(missing)}")
    print(f"rewrote {path}")
    return 0


def plot(bench: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = bench["rows"]
    names = [row["config"] for row in rows]
    cost = [row["s_per_1k_tokens"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    medians = [c["median"] for c in cost]
    errors = [
        [m - c["min"] for m, c in zip(medians, cost, strict=True)],
        [c["max"] - m for m, c in zip(medians, cost, strict=True)],
    ]
    colors = ["#8c8c8c" if n == "sync" else "#dd8452" if n.startswith("verl-") else "#4c72b0" for n in names]
    left.bar(names, medians, yerr=errors, capsize=4, color=colors)  # grey: sync, orange: verl's async, blue: ours
    left.set_ylabel("seconds per 1k trained tokens (lower is better)")
    left.set_title(f"{bench.get('workload', 'addition')} workload: training cost, median and min-max")
    left.tick_params(axis="x", rotation=30)
    async_rows = [row for row in rows if "speedup" in row]
    speed = [row["speedup"] for row in async_rows]
    right.bar(
        [row["config"] for row in async_rows],
        [x["median"] for x in speed],
        yerr=[[x["median"] - x["min"] for x in speed], [x["max"] - x["median"] for x in speed]],
        capsize=4,
        color=["#dd8452" if row["config"].startswith("verl-") else "#55a868" for row in async_rows],
    )
    right.axhline(
        bench["sync_overlap_bound"]["median"], color="#c44e52", ls="--", label="ideal overlap bound (sync phases)"
    )
    if math.isfinite(bench.get("sync_core_headroom", {}).get("median", math.nan)):  # older bench.json: none
        right.axhline(
            bench["sync_core_headroom"]["median"],
            color="#dd8452",
            ls=":",
            label="core headroom: overlap's most at sync's CPU work",
        )
    for i, row in enumerate(async_rows):  # where the speedup came from (bench docstring)
        if "speedup_from_less_work" in row:
            right.text(
                i,
                row["speedup"]["max"] + 0.03,
                f"work x{row['speedup_from_less_work']['median']:.2f}\n"
                f"cores x{row['speedup_from_busier_cores']['median']:.2f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_ylabel("speedup vs sync (same trained tokens)")
    right.set_title(bench["machine"])
    right.tick_params(axis="x", rotation=30)
    right.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def trainer_owns_the_cores(config: Config, cores: int | None = None) -> Config:
    """The gpu-shaped rows' trainer gets every core (or the ``--trainer-cores`` it is pinned to), as it has its GPUs
    on a cluster: the separate placements keep one core for a CPU engine (``OMP_NUM_THREADS=1``), which the stand-in
    does not need. Last, so that it wins."""
    threads = f"++ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS='{cores or os.cpu_count()}'"
    kept = [o for o in config.overrides if "OMP_NUM_THREADS" not in o]
    return dataclasses.replace(config, overrides=[*kept, threads])


def calibrated_gpu_shaped(
    args: argparse.Namespace, tiny_dir: Path, overrides: list[str], sync: Config
) -> tuple[list[str], TimeScale]:
    """The gpu-shaped overrides at the time scale for this box: from ``--trainer-step-s``, or measured by a short
    run of the bench's synchronous row ``sync`` (its micro-batching too; at time scale 1: the trainer's step does
    not depend on it)."""
    prompts = args.prompts_per_step or (QUICK_BATCH_PROMPTS if args.quick else RECIPE_PROMPTS)
    answers = args.answers_per_prompt or RECIPE_ANSWERS
    trainer_step_s, prompt_tokens = args.trainer_step_s, None
    if trainer_step_s is None:
        calibration = sync
        print(f"gpu-shaped: measuring the trainer's step ({CALIBRATION_STEPS} synchronous steps)...", flush=True)
        provisional = [*overrides, *gpu_shaped_overrides(args.case, args.length_scale, 1.0, args.kv_capacity_tokens)]
        figures = run_one(
            calibration, CALIBRATION_STEPS, 0, 0, args.out / "calibrate", tiny_dir, provisional, 1, args.trainer_cores
        )
        trainer_step_s, prompt_tokens = figures["train_s_median"], figures["prompt_len_mean"]
    scale = gpu_shaped_time_scale(
        args.case, args.length_scale, trainer_step_s, prompts, answers, prompt_tokens or GPU_SHAPED_PROMPT_TOKENS,
        args.kv_capacity_tokens,
    )  # fmt: skip
    print(f"gpu-shaped: {scale.describe()}", flush=True)
    keys = gpu_shaped_overrides(args.case, args.length_scale, scale.time_scale, args.kv_capacity_tokens)
    return [*overrides, *keys], scale


def main(argv: list[str] | None = None) -> int:
    from areal_bench.gpu_shaped import CASES
    from areal_bench.paced_engine import DEFAULT_LENGTH_SCALE

    parser = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run under 10 min: addition, 8 prompts/step, sync + async eta=4, 2 x 4 steps "
        "(options given explicitly still apply, e.g. --quick --etas 0,1,2,4,8 for a short sweep)",
    )
    parser.add_argument("--steps", type=int, help="steps per run (default 12; --quick: 4)")
    parser.add_argument("--repeats", type=int, help="runs per configuration (default 3; --quick: 2)")
    parser.add_argument(
        "--frozen-policy",
        action="store_true",
        help="learning rate 0 in every configuration: the same work per step, but response lengths do not drift "
        "apart between runs as each run's policy learns (a systems comparison, not a learning one)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        help="first steps of each run left out of the figures (default 1: agent-loop start-up; more lets an async "
        "run's backlog of rollouts in flight fill up before counting)",
    )
    parser.add_argument("--etas", help="comma list of max staleness values (default 0,1,2,4,8; --quick: 4)")
    parser.add_argument("--placements", help="separate and/or colocated (default both; --quick: separate)")
    parser.add_argument(
        "--prox-logp",
        default="loglinear",
        help="comma list of recompute/loglinear: recompute does sync's old-log-prob pass, loglinear skips it",
    )
    parser.add_argument(
        "--sync-poll-s",
        type=float,
        default=0.05,
        help="the sync baseline's replay-buffer poll (our async trainer's is 0.05 s); 2 = verl's default",
    )
    parser.add_argument(
        "--verl-async",
        default="",
        help="comma list of verl's own async modes to run beside ours: colocate_async, separate_async",
    )
    parser.add_argument(
        "--verl-tuned-batches",
        type=float,
        default=None,
        help="each --verl-async mode also runs '-tuned' with this many batches of prompts in flight ahead of its "
        "trainer (trainer.v1.<mode>.num_warmup_batches; verl's default 1)",
    )
    parser.add_argument(
        "--split-engines",
        default="",
        help="comma list of engine counts our separate placement also runs with (at --split-eta): other "
        "rollout:trainer splits (default: none; the recipe's 1 engine)",
    )
    parser.add_argument("--split-eta", type=int, default=2, help="the η of the --split-engines rows (default 2)")
    parser.add_argument(
        "--in-flight",
        default="interrupt",
        help="comma list of areal.weight_update.in_flight for our rows: interrupt (a weight update aborts the "
        "generations under way, which continue under the new weights) and/or wait (it waits for them to finish: "
        "the paper's ablation; rows named -wait)",
    )
    parser.add_argument(
        "--recompute-staleness",
        type=Path,
        metavar="BENCH_DIR",
        help="run nothing: fill the staleness figures of an earlier bench's bench.json from its run directories "
        "(BENCH_DIR/<row>-r<repeat>/) where their records allow, rewrite it and print the staleness table",
    )
    parser.add_argument(
        "--max-concurrent",
        default="default",
        help="comma list of areal.max_concurrent_rollouts for our rows; 'default' = (η+1) x train batch",
    )
    parser.add_argument(
        "--micro-batch-tokens",
        default="fixed",
        help="comma list: 'fixed' = the recipes' fixed micro-batches; N = token-budget micro-batches of N tokens "
        "(verl's async rows: use_dynamic_bsz; ours: areal.micro_batch.max_tokens)",
    )
    parser.add_argument(
        "--prompts-per-step",
        type=int,
        help="prompt groups per step (data.train_batch_size, one mini-batch of them; default: the recipes' 16, "
        "--quick: 8)",
    )
    parser.add_argument(
        "--answers-per-prompt", type=int, help="answers per prompt group (rollout.n; default: the recipes' 8)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        help="longtail (default; long-tailed lengths); --quick: addition; paced: engines with no model "
        "(rollout.name=areal_paced) and a ~20k-weight trainer model, to compare the control planes; gpu-shaped: "
        "engines decoding as a GPU case's (--case), the recipes' tiny trainer, the time scale stated",
    )
    parser.add_argument("--tiny-dir", type=Path, default=None, help="default: the workload's own directory")
    parser.add_argument(
        "--case",
        default="paper-1.5b",
        choices=sorted(CASES),
        help="gpu-shaped: the GPU case its engines decode as (default paper-1.5b)",
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        default=DEFAULT_LENGTH_SCALE,
        help="gpu-shaped: answers this share of the case's lengths (default 1/64: the paper's mean 2,117 -> 33 "
        "tokens, its cap 27,648 -> 432)",
    )
    parser.add_argument(
        "--kv-capacity-tokens",
        type=float,
        default=None,
        help="gpu-shaped: each engine's KV cache in tokens (default: the case engine's): a smaller engine, so that "
        "generation, not the trainer, can be the slower side (for --split-engines)",
    )
    parser.add_argument(
        "--trainer-step-s",
        type=float,
        default=None,
        help="gpu-shaped: a synchronous step's seconds without generation on this box, for the time scale; "
        f"default: measured first by a {CALIBRATION_STEPS}-step synchronous run",
    )
    parser.add_argument(
        "--trainer-cores",
        type=int,
        default=None,
        help="gpu-shaped: pin the trainer's workers to this many cores and every other process of a run to the rest "
        "(as a cluster gives the trainer its GPUs), the calibrating synchronous run too; default: all share all",
    )
    args = parser.parse_args(argv)
    if args.recompute_staleness is not None:
        return recompute_staleness(args.recompute_staleness)
    # --quick: addition (built by the setup; the long-tail build alone would take a third of the budget).
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workload != "gpu-shaped" and args.trainer_step_s is not None:
        parser.error("--trainer-step-s sizes the gpu-shaped workload's engines: add --workload gpu-shaped or drop it")
    if args.trainer_cores is not None:
        if args.workload != "gpu-shaped":
            parser.error("--trainer-cores pins the gpu-shaped workload's trainer: add --workload gpu-shaped or drop it")
        if args.trainer_step_s is not None:
            parser.error(
                "--trainer-cores with --trainer-step-s: the given step was measured on shared cores; drop "
                "--trainer-step-s so the calibrating run measures the pinned trainer"
            )
        try:
            split_cores(args.trainer_cores)
        except ValueError as error:
            parser.error(str(error))
    if not 0 < args.length_scale <= 1:
        parser.error(f"--length-scale is a share of the case's answer lengths, in (0, 1]; got {args.length_scale}")
    if not 1 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps must be at least 1 and below --steps ({args.steps}), got {args.warmup_steps}")
    from areal_plugins.cli.launch import ensure_tiny_assets

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")  # build progress

    default_dir, workload_overrides = WORKLOADS[args.workload]
    if (
        args.quick and args.prompts_per_step is None
    ):  # half-size steps: 4 verl startups (~95 s each) leave little of the 10 minutes
        workload_overrides = [*workload_overrides, *QUICK_BATCH]
    if args.frozen_policy:
        workload_overrides = [*workload_overrides, *FROZEN_POLICY]
    workload_overrides = [*workload_overrides, *batch_overrides(args.prompts_per_step, args.answers_per_prompt)]
    tiny_dir = ensure_tiny_assets(args.tiny_dir or default_dir, workload=TINY_ASSETS.get(args.workload, args.workload))
    etas = [int(x) for x in args.etas.split(",") if x]
    placements = [p for p in args.placements.split(",") if p]
    args.out.mkdir(parents=True, exist_ok=True)
    prox_logps = [p for p in args.prox_logp.split(",") if p]
    if not prox_logps or set(prox_logps) - {"recompute", "loglinear"}:
        parser.error(f"--prox-logp takes recompute and/or loglinear, got {args.prox_logp!r}")
    verl_async = [m for m in args.verl_async.split(",") if m]
    if set(verl_async) - set(VERL_ASYNC):
        parser.error(f"--verl-async takes {', '.join(VERL_ASYNC)}, got {args.verl_async!r}")
    limits = [None if x == "default" else int(x) for x in args.max_concurrent.split(",") if x]
    budgets = [None if x == "fixed" else int(x) for x in args.micro_batch_tokens.split(",") if x]
    split_engines = [int(x) for x in args.split_engines.split(",") if x]
    in_flights = [x for x in args.in_flight.split(",") if x]
    if not in_flights or set(in_flights) - {"interrupt", "wait"}:
        parser.error(f"--in-flight takes interrupt and/or wait, got {args.in_flight!r}")
    plan = configs(
        etas, placements, prox_logps, args.sync_poll_s, verl_async, limits, budgets,
        args.verl_tuned_batches, split_engines, args.split_eta, in_flights,
    )  # fmt: skip
    time_scale = None
    if args.workload == "gpu-shaped":
        plan = [trainer_owns_the_cores(config, args.trainer_cores) for config in plan]
        workload_overrides, time_scale = calibrated_gpu_shaped(args, tiny_dir, workload_overrides, plan[0])
    results: dict[str, list[dict]] = {c.name: [] for c in plan}
    total = len(plan) * args.repeats
    done = 0
    for repeat in range(args.repeats):  # interleave configurations so drift in the machine hits all alike
        for config in plan:
            print(f"[{done + 1}/{total}] {config.name} repeat {repeat}: running ({args.steps} steps)...", flush=True)
            figures = run_one(
                config, args.steps, repeat, repeat, args.out, tiny_dir, workload_overrides, args.warmup_steps,
                args.trainer_cores,
            )  # fmt: skip
            results[config.name].append(figures)
            done += 1
            print(
                f"[{done}/{total}] {config.name} repeat {repeat}: {figures['s_per_1k_tokens']:.2f} s/1k tokens, "
                f"step {figures['step_s_median']:.1f} s, reward {figures['final_reward']:.3f}",
                flush=True,
            )
    sync_runs = results["sync"]
    rows = [summarise(name, runs, sync_runs) for name, runs in results.items()]
    by_name = {config.name: config for config in plan}
    for row in rows:  # what each row's runs used, set by its overrides (the recipes' own default is a budget)
        row["micro_batching"] = by_name[row["config"]].micro_batching
        row["recipe"] = by_name[row["config"]].recipe
        row["overrides"] = by_name[row["config"]].overrides
    bench = {
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "workload": args.workload,
        **({"time_scale": {**dataclasses.asdict(time_scale), "stated": time_scale.describe()}} if time_scale else {}),
        "length_scale": args.length_scale,
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "batch": {
            "prompts": args.prompts_per_step or (QUICK_BATCH_PROMPTS if args.quick else RECIPE_PROMPTS),
            "answers": args.answers_per_prompt or RECIPE_ANSWERS,
            "prompt_tokens": statistics.median(r["prompt_len_mean"] for r in sync_runs),
        },
        "workload_overrides": workload_overrides,
        "steps_per_run": args.steps,
        "counted_steps": args.steps - args.warmup_steps,
        "warmup_steps": args.warmup_steps,
        "frozen_policy": args.frozen_policy,
        "repeats": args.repeats,
        "prox_logp": prox_logps,
        "in_flight": in_flights,
        "staleness_definition": STALENESS_DEFINITION,
        "sync_poll_s": args.sync_poll_s,
        "trainer_cores": args.trainer_cores,  # None: the trainer shared every core with the rest of the run
        "sync_wall_s": spread([r["wall_s"] for r in sync_runs]),
        "sync_overlap_bound": spread([r["overlap_bound"] for r in sync_runs]),
        # The most overlap alone can gain while doing sync's CPU work: cores / sync's busy cores.
        "sync_core_headroom": spread(
            [os.cpu_count() / r["busy_cores"] for r in sync_runs if "busy_cores" in r] or [math.nan]
        ),
        "rows": rows,
        "runs": results,
    }
    best = max((row for row in rows if "speedup" in row), key=lambda row: row["speedup"]["median"])
    bench["async_wall_s"] = best["wall_s"]
    bench["speedup"] = best["speedup"]
    bench["best_async_config"] = best["config"]
    bench["bound_reached"] = best["speedup"]["median"] / bench["sync_overlap_bound"]["median"]
    if args.workload == "gpu-shaped":  # the planner's prediction of each row, and the physical limit
        from bench_vs_planner import compare, format_table, rows_table
        from bench_vs_planner import plot as plot_planner

        bench["planner"] = compare(bench)
        print(rows_table(bench, bench["planner"]), format_table(bench["planner"]), sep="\n\n")
        plot_planner(bench, bench["planner"], args.out / "bench_vs_planner.png")
    (args.out / "bench.json").write_text(json.dumps(bench, indent=2))
    plot(bench, args.out / "bench.png")
    print(
        f"sync {bench['sync_wall_s']['median']:.1f} s for {args.steps - args.warmup_steps} steps; "
        f"best async {best['config']}: "
        f"speedup {best['speedup']['median']:.2f}x "
        f"(min {best['speedup']['min']:.2f}, max {best['speedup']['max']:.2f}); "
        f"ideal overlap bound {bench['sync_overlap_bound']['median']:.2f}x, "
        f"core headroom {bench['sync_core_headroom']['median']:.2f}x (sync kept "
        f"{statistics.median(r.get('busy_cores', math.nan) for r in sync_runs):.2f} of {os.cpu_count()} cores busy)"
    )
    if "speedup_from_less_work" in best:
        print(
            f"{best['config']}: {best['speedup_from_less_work']['median']:.2f}x from less CPU work per token x "
            f"{best['speedup_from_busier_cores']['median']:.2f}x from busier cores"
        )
    print(staleness_table(bench))
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
