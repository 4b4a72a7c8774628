"""``areal-plugins replay RUN_DIR``: run a recorded asynchronous run again by its record, and say where it differs.

Runs ``areal-plugins train`` with the recorded run's recipe and overrides (``run_args.json``) plus
``areal.replay.run_dir`` (the trainer then follows the record: replay/driver_side.py), into a run directory of
its own. The trainer stops at the first difference and writes it to ``areal_replay.jsonl``; after a replay that
ran to its end, the two runs' records are compared once more, whole (records/compare.py). docs/replay.md.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from areal_plugins.cli.launch import RECORD_FORMAT, RUN_ARGS_FILE, train
from areal_plugins.records.compare import compare_runs, read_samples
from areal_plugins.records.writer import read_jsonl

logger = logging.getLogger(__name__)

MATCHED, DIVERGED = 0, 1


#: Settings a replay may not change: they decide which prompts are drawn and when, or how a request is generated,
#: so the record could no longer be followed (the replay would wait for requests whose prompts never come).
FIXED_SETTINGS = (
    "data.",
    "areal.max_staleness",
    "areal.max_concurrent_rollouts",
    "areal.on_stale",
    "areal.placement",
    "areal.replay.",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.engine_kwargs",
    "trainer.total_training_steps",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.default_local_dir",
)
#: A replay does not validate: verl's validation asks the same agent loop, whose requests would take the recorded
#: trajectories of prompts the validation set shares with the training set.
NO_VALIDATION = ("trainer.val_before_train=false", "trainer.test_freq=-1")
#: Nor does it checkpoint: it cannot be resumed (a restart would pick up mid-record), and with the recorded run's own
#: trainer.default_local_dir it would write over the recorded checkpoints.
NO_CHECKPOINTS = ("trainer.save_freq=-1",)
#: Nor does its engine hold requests to make interruptions (testing/holds.py): the replay cuts each request
#: where the record says, and a held request would never reach its recorded end.
NO_HOLDS = ("++actor_rollout_ref.rollout.engine_kwargs.areal_cpu.finish_groups_per_version=null",)


def resume_from(run_dir: Path, recorded_overrides: list[str], step: int, until: int) -> list[str]:
    """The overrides that start a replay from the recorded run's checkpoint of ``step`` (refused without one)."""
    from areal_plugins.cli.cluster_env import override_value

    checkpoints = Path(override_value(recorded_overrides, "trainer.default_local_dir") or run_dir / "checkpoints")
    folder = checkpoints / f"global_step_{step}"
    if not (folder / "areal_state.json").is_file():
        saved = sorted(path.name for path in checkpoints.glob("global_step_*")) if checkpoints.is_dir() else []
        raise SystemExit(
            f"--from-checkpoint {step}: {folder} is not a checkpoint of this run (it has {saved or 'none'}; record "
            "with trainer.save_freq to keep some)"
        )
    if not step < until:
        raise SystemExit(f"--from-checkpoint {step} --until {until}: the replay would train no step")
    return [
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={folder}",
        f"areal.replay.from_step={step}",
    ]


def refused_overrides(overrides: list[str]) -> list[str]:
    """The overrides that change a setting a replay keeps as recorded."""
    keys = {override: override.split("=", 1)[0].lstrip("+~") for override in overrides}
    return [override for override, key in keys.items() if any(key.startswith(fixed) for fixed in FIXED_SETTINGS)]


def unseeded_adapter(recipe: Path, overrides: list[str]) -> str | None:
    """Why a replay from the start could not match a LoRA run recorded without verl's ``full_determinism`` (peft then
    draws the adapter's first ``lora_A`` from the process's random state: docs/replay.md); None where it could."""
    from areal_plugins.builtin.validation import lora_rank
    from areal_plugins.cli.preflight import compose
    from areal_plugins.config.errors import RecipeRefusedError

    try:
        config = compose(recipe, overrides)
    except RecipeRefusedError as error:
        raise SystemExit(f"cannot compose the recorded recipe: {error}") from None
    if lora_rank(config) == 0 or config.actor_rollout_ref.actor.fsdp_config.get("full_determinism", False):
        return None
    return (
        f"the recorded run trains a LoRA adapter (rank {lora_rank(config)}) without "
        "actor_rollout_ref.actor.fsdp_config.full_determinism=true, so its adapter started from unseeded random "
        "values that a replay from the start cannot draw again: replay from one of its checkpoints "
        "(--from-checkpoint STEP, which loads the adapter), or record the run again with full_determinism=true"
    )


def replay(
    run_dir: Path, out: Path | None, until: int | None, overrides: list[str], from_checkpoint: int | None = None
) -> int:
    """Replay ``run_dir`` into ``out`` up to step ``until`` (default: every recorded step) with ``overrides`` added
    (a changed setting), from its start or from its checkpoint of step ``from_checkpoint``; 0 when the replay matched
    the record, 1 when it left it, else verl's exit code."""
    run_dir = run_dir.resolve()
    args_path = run_dir / RUN_ARGS_FILE
    if not args_path.is_file():
        raise SystemExit(
            f"{args_path} is missing: replay needs a run directory written by areal-plugins train (by a version that "
            "records run_args.json, 2026-12-02 or later)"
        )
    if refused := refused_overrides(overrides):
        raise SystemExit(
            f"a replay keeps what decides which prompts are drawn, when, and how they are generated: drop {refused} "
            f"(allowed: the optimizer, the loss, the trainer's micro-batches and the like; use --until for the steps)"
        )
    recorded = json.loads(args_path.read_text())
    if recorded.get("record_format", 1) != RECORD_FORMAT:
        raise SystemExit(
            f"{run_dir} was recorded by an earlier version (record format {recorded.get('record_format', 1)}, this "
            f"version compares format {RECORD_FORMAT}: its token digests are computed another way), so no replay "
            "could match it; record the run again with this version"
        )
    if from_checkpoint is None and (reason := unseeded_adapter(Path(recorded["recipe"]), recorded["overrides"])):
        raise SystemExit(reason)
    try:
        steps = len(read_samples(run_dir / "areal_samples.jsonl"))
    except (OSError, ValueError) as error:
        raise SystemExit(f"cannot replay {run_dir}: {error}") from None
    until = steps if until is None else until
    if not 1 <= until <= steps:
        raise SystemExit(f"--until {until}: the record holds steps 1-{steps}")
    start = ["trainer.resume_mode=disable"]
    if from_checkpoint is not None:
        start = resume_from(run_dir, recorded["overrides"], from_checkpoint, until)
    out = (out or run_dir.parent / f"{run_dir.name}-replay").resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty (an earlier replay?): pass another --out, or remove it")
    tiny_dir = Path(recorded["tiny_dir"]) if recorded.get("tiny_dir") else None
    started = time.monotonic()
    code = train(
        Path(recorded["recipe"]),
        [
            *recorded["overrides"],
            *overrides,
            *NO_VALIDATION,
            *NO_CHECKPOINTS,
            *NO_HOLDS,
            f"areal.replay.run_dir={run_dir}",
            f"trainer.total_training_steps={until}",
            *start,
        ],
        out,
        tiny_dir,
        max_restarts=0,  # a restart would resume mid-record, where the replay cannot pick up
    )
    elapsed = time.monotonic() - started
    diverged = [line for line in read_jsonl(out / "areal_replay.jsonl") if line.get("matched") is False]
    if diverged:
        first = diverged[0]
        where = f"step {first['step']}" + (
            f", trajectory {first['trajectory']}" if first["trajectory"] is not None else ""
        )
        print(
            f"the replay left the record at {where}, {first['field']}: {first['recorded']!r} (recorded) vs "
            f"{first['replayed']!r} (replayed); replay in {out}"
        )
        return DIVERGED
    if code != 0:
        print(f"the replay stopped (exit code {code}) before it could be compared: {out / 'train.log'} says why")
        return code
    comparison = compare_runs(run_dir, out)
    if comparison.divergence is not None:
        print(f"the replay left the record at {comparison.divergence} (recorded vs replayed); replay in {out}")
        return DIVERGED
    print(
        f"the replay matched the record over {comparison.steps} steps and {comparison.trajectories} trained "
        f"trajectories, bit for bit, in {elapsed:.0f} s; replay in {out}"
    )
    return MATCHED
