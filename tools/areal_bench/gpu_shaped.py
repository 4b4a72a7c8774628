"""The GPU cases the paced engine can stand in for, and the time scale that sizes it to this box's trainer.

A *case* is a cluster the planner models (``areal_plugins/planning``): its GPUs, its model, the fitted
efficiencies, its workload's length distribution and how its synchronous baseline splits the GPUs. The paced
engine with ``engine_kwargs.areal_paced.case`` set decodes as one of the case's engines does (the planner's
:class:`~areal_plugins.planning.hardware.DecodeCost`), answers as long as the case's answers times
``length_scale``, and every second of the case's decoding lasts ``time_scale`` seconds here.

The time scale is what makes the box's step look like the case's: on the cluster a synchronous step generates
until its longest answer is done, then trains (the paper's 1.5B: 148 s a step, most of it generation); here the
trainer is a small model on CPU cores, whose step takes what it takes. :func:`time_scale_for` picks the scale at
which the stand-in's generation of a step stands to the measured trainer step as the case's generation stands to
its training, both from the planner's simulator (:func:`~areal_plugins.planning.cluster_sim.simulate_sync`)::

    time_scale = (case generate_s / case train_s) x trainer_step_s / stand-in generate_s at time scale 1

Tokens are the stand-in's own: a shorter answer holds a shorter KV cache and a continued one recomputes fewer
tokens than the case's would. At the bench's batch that is little: 128 answers of ~50 tokens hold 6.4k tokens,
whose read (55 µs on an H800) is 1% of the 1.5B's 5.6 ms step.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from areal_plugins.planning.cluster_sim import Cluster, Workload, simulate_sync


@dataclass(frozen=True)
class GpuCase:
    """A cluster the stand-in can emulate.

    Attributes:
        name: the key of :data:`CASES` (``engine_kwargs.areal_paced.case``, ``tools/bench.py --case``).
        description: one line for reports.
        cluster: the GPUs, model and fitted efficiencies (``rollout_gpus``: the asynchronous split).
        workload: the case's batch and response-length distribution.
        sync_generating_gpus: GPUs that generate in its synchronous baseline while the rest train afterwards;
            None: every GPU generates, then every GPU trains (verl's colocated trainer).
    """

    name: str
    description: str
    cluster: Cluster
    workload: Workload
    sync_generating_gpus: int | None


def _paper_1_5b() -> GpuCase:
    from areal_bench.paper import PAPER_WORKLOAD, paper_cluster
    from areal_plugins.planning.calibration import paper_sync_generating_gpus
    from areal_plugins.planning.plan import PAPER_FIT

    cluster = paper_cluster(PAPER_FIT)
    return GpuCase(
        name="paper-1.5b",
        description="the paper's 1.5B on 128 H800 (96 generate, 32 train); synchronous AReaL: 64 generate, 64 train",
        cluster=cluster,
        workload=PAPER_WORKLOAD,
        sync_generating_gpus=paper_sync_generating_gpus(cluster),
    )


#: name -> how to build it (the planner's modules load only when a case is asked for).
CASES = {"paper-1.5b": _paper_1_5b}


def case(name: str, key: str = "actor_rollout_ref.rollout.engine_kwargs.areal_paced.case") -> GpuCase:
    """The case named ``name``; an unknown name is refused naming ``key`` and the known cases."""
    if name not in CASES:
        raise ValueError(f"{key}: unknown GPU case {name!r}; choose one of {', '.join(sorted(CASES))}")
    return CASES[name]()


def scaled_lengths(work: Workload, length_scale: float) -> tuple[float, float, int]:
    """(μ, σ, cap) of the case's response lengths times ``length_scale``: X·s is log-normal(μ + ln s, σ)."""
    if not 0 < length_scale <= 1:
        raise ValueError(f"length_scale must be in (0, 1] (a share of the case's lengths), got {length_scale!r}")
    mu, sigma = work.lognormal()
    return mu + math.log(length_scale), sigma, max(1, round(work.max_response * length_scale))


@dataclass(frozen=True)
class StandInShape:
    """The box's side: a step's batch, its prompts, the answers' scale and the number of stand-in engines."""

    batch: int  # prompt groups per step (data.train_batch_size)
    group: int  # answers per prompt (rollout.n)
    prompt: int  # prompt tokens of an answer (their mean)
    length_scale: float
    engines: int = 1
    kv_capacity_tokens: float | None = None  # the stand-in's KV cache (engine_kwargs.areal_paced); None: the case's


@dataclass(frozen=True)
class TimeScale:
    """:func:`time_scale_for`'s answer, with what it came from."""

    case: str
    time_scale: float  # seconds here per second of the case's decoding
    case_generate_s: float  # a synchronous step's generation on the case's cluster (its longest answer)
    case_train_s: float  # its training and weight load
    stand_in_generate_s: float  # the stand-in's generation of one of the box's steps at time scale 1
    trainer_step_s: float  # the box's measured trainer step (everything of a sync step but generation)

    @property
    def ratio(self) -> float:
        """Generation over training in a synchronous step: the case's, and at ``time_scale`` the box's."""
        return self.case_generate_s / self.case_train_s

    def describe(self) -> str:
        return (
            f"time scale {self.time_scale:.3g}: a second of {self.case}'s decoding lasts {self.time_scale:.3g} s "
            f"here. Its synchronous step generates {self.case_generate_s:.1f} s and trains {self.case_train_s:.1f} s "
            f"({self.ratio:.2f}:1); here the trainer's {self.trainer_step_s:.2f} s stands for the training, so a "
            f"step's generation ({self.stand_in_generate_s * 1e3:.1f} ms on the case's GPU) is paced to "
            f"{self.stand_in_generate_s * self.time_scale:.2f} s"
        )


def stand_in_cluster(gpu_case: GpuCase, shape: StandInShape) -> tuple[Cluster, Workload]:
    """The planner's model of the stand-in: ``shape.engines`` of the case's engines, the box's batch, the case's
    lengths scaled (colocated sync: every engine generates)."""
    mu, sigma, cap = scaled_lengths(gpu_case.workload, shape.length_scale)
    engine = gpu_case.cluster.engine()
    cluster = replace(
        gpu_case.cluster,
        gpus=shape.engines * engine.tensor_parallel,
        rollout_gpus=0,
        kv_capacity_tokens=shape.kv_capacity_tokens,
    )
    work = Workload(
        batch=shape.batch,
        group=shape.group,
        response_mean=gpu_case.workload.response_mean * shape.length_scale,
        truncated_fraction=gpu_case.workload.truncated_fraction,
        max_response=cap,
        prompt=shape.prompt,
        log_mu=mu,
        log_sigma=sigma,
    )
    return cluster, work


#: Steps the planner simulates to average the box's generation of a step (a short batch's longest answer varies).
STAND_IN_STEPS = 400


def time_scale_for(
    gpu_case: GpuCase, trainer_step_s: float, shape: StandInShape, steps: int = STAND_IN_STEPS, seed: int = 0
) -> TimeScale:
    """The stand-in's ``time_scale`` at which a synchronous step here divides as the case's does.

    Args:
        gpu_case: the case (:func:`case`).
        trainer_step_s: a synchronous step's time without its generation, measured on this box (verl's
            ``timing_s/step`` - ``timing_s/gen``): the old log-probs, the update and the weight sync.
        shape: the box's batch and the stand-in's engines.
        steps: steps of the box's batch to average its generation over (the case's: 3, as the planner's
            synchronous baseline runs; its batch of 8,192 answers varies little).
        seed: the simulations' seed.

    Raises:
        ValueError: a trainer step that is not a positive number of seconds.
    """
    if not trainer_step_s > 0:
        raise ValueError(f"the trainer's step must be a positive number of seconds, got {trainer_step_s!r}")
    run = simulate_sync(
        gpu_case.cluster, gpu_case.workload, steps=3, seed=seed, generating_gpus=gpu_case.sync_generating_gpus
    )
    weight_load = gpu_case.cluster.engine().weight_load_time()
    case_generate = statistics.fmean(run.generate_s)
    case_train = statistics.fmean(run.train_s) + weight_load
    cluster, work = stand_in_cluster(gpu_case, shape)
    stand_in_generate = statistics.fmean(simulate_sync(cluster, work, steps=steps, seed=seed).generate_s)
    return TimeScale(
        case=gpu_case.name,
        time_scale=case_generate / case_train * trainer_step_s / stand_in_generate,
        case_generate_s=case_generate,
        case_train_s=case_train,
        stand_in_generate_s=stand_in_generate,
        trainer_step_s=trainer_step_s,
    )
