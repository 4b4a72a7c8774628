"""``areal-plugins train``: check the recipe, prepare the run's folder and environment, run verl's ``main_ppo``
in a process group of its own, print its progress and stop it cleanly (docs/guides/own_recipe.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal_plugins.cli.bounded_log import BoundedLog
from areal_plugins.cli.cluster_env import (
    cluster_address,
    has_accelerator,
    job_env_overrides,
    join_cluster_overrides,
    override_value,
    with_ray_defaults,
)
from areal_plugins.cli.control import (
    RunStopper,
    end_run_leftovers,
    new_group_dying_with_parent,
)
from areal_plugins.cli.progress import (
    MILESTONES,
    STEP_LINE,
    error_in,
    format_progress,
    recipe_files,
    total_steps,
)
from areal_plugins.records.control_files import STOP_REQUEST_FILE

logger = logging.getLogger("areal_plugins.cli")

DEFAULT_TINY_DIR = Path(".areal/tiny")


#: Environment variable a recipe reads its tiny assets from -> (workload built there, default directory).
#: None: whatever workload is built there (addition if none).
TINY_ASSET_VARIABLES: dict[str, tuple[str | None, Path]] = {
    "AREAL_TINY_DIR": (None, DEFAULT_TINY_DIR),
    "AREAL_TINY_CALCULATOR_DIR": ("calculator", Path(".areal/tiny_calculator")),
    "AREAL_TINY_VISION_DIR": ("vision", Path(".areal/tiny_vision")),
}


#: Exit code of a run refused at startup (argparse's for bad usage).
REFUSED_EXIT_CODE = 2


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` while the recipe is checked here as the run's processes will see it."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ensure_tiny_assets(tiny_dir: Path, force: bool = False, workload: str | None = None) -> Path:
    """Build the tiny model and data of ``workload`` under ``tiny_dir`` unless already there.

    ``workload=None`` (training): whatever is built there, else the addition workload.
    """
    stamp = tiny_dir / "BUILT.json"
    if stamp.exists() and not force:
        return _built(tiny_dir, workload)
    # Two runs started at once with the same folder (two demos, two test files) build it once: the
    # second waits for the first's stamp instead of writing the same files beside it.
    tiny_dir.mkdir(parents=True, exist_ok=True)
    with open(tiny_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and not force:
            return _built(tiny_dir, workload)
        return _build_tiny_assets(tiny_dir, workload)


def _built(tiny_dir: Path, workload: str | None) -> Path:
    """``tiny_dir``, once its stamp says it holds ``workload`` (any, if None)."""
    built = json.loads((tiny_dir / "BUILT.json").read_text()).get("workload", "addition")
    if workload is not None and built != workload:
        raise SystemExit(f"{tiny_dir} holds the {built!r} workload, not {workload!r}: pass another directory")
    return tiny_dir


def _build_tiny_assets(tiny_dir: Path, workload: str | None) -> Path:
    from areal_plugins.tiny.model import WORKLOADS, build_tiny_model
    from areal_plugins.tiny.task import write_dataset

    stamp = tiny_dir / "BUILT.json"
    start = time.monotonic()
    workload = workload or "addition"
    spec = WORKLOADS[workload]
    logger.info("building the tiny model and data (%s) in %s (1-3 min on 2 cores)", workload, tiny_dir)
    metrics = build_tiny_model(tiny_dir / "model", spec)
    if spec.task == "calculator":
        from areal_plugins.tiny.calculator import write_calculator_dataset

        write_calculator_dataset(tiny_dir / "data", train_size=4096, test_size=256, seed=spec.seed)
    elif spec.task == "vision":
        from areal_plugins.tiny.vision_task import write_picture_dataset

        write_picture_dataset(tiny_dir / "data", train_size=4096, test_size=256, seed=spec.seed)
    else:
        write_dataset(tiny_dir / "data", train_size=4096, test_size=256, seed=spec.seed)
    record = {"workload": workload, "spec": spec.__dict__, **metrics, "seconds": time.monotonic() - start}
    stamp.write_text(json.dumps(record, indent=2))
    return tiny_dir


def checked_recipe(
    recipe: Path, overrides: list[str], tiny_dir: Path | None, local_accelerator: bool
) -> tuple[Any, dict[str, tuple]]:
    """The recipe composed and through every startup check, and the tiny assets it reads (variable -> (workload,
    folder); not built here). Raises ``RecipeRefusedError``."""
    from areal_plugins.cli.preflight import RecipeRefusedError, check_recipe, not_a_recipe

    refusal = not_a_recipe(recipe) if recipe.is_file() else None  # before anything parses it as one
    if refusal:
        raise RecipeRefusedError(refusal)
    recipe_text = "".join(path.read_text() for path in recipe_files(recipe)) if recipe.is_file() else ""
    tiny_assets = {
        variable: (workload, (default_dir if tiny_dir is None else tiny_dir).resolve())
        for variable, (workload, default_dir) in TINY_ASSET_VARIABLES.items()
        if f"oc.env:{variable}" in recipe_text
    }
    # verl is imported here only to check the recipe: on a machine without a GPU, as the CPU platform.
    checking = {variable: str(directory) for variable, (_, directory) in tiny_assets.items()}
    if "VERL_PLATFORM" not in os.environ and not local_accelerator:
        checking["VERL_PLATFORM"] = "cpu"
    with _environment(checking):
        return check_recipe(recipe, overrides, supplied_settings), tiny_assets


def supplied_settings(config: Any) -> list[str]:
    """What ``train`` adds before the user's overrides for a recipe on the CPU (``trainer.device=cpu``;
    rollout/verl_vllm/cpu_settings.py): the checks see it too. By the recipe, not ``VERL_PLATFORM``, which a check
    sets to import verl on a machine without a GPU."""
    from areal_plugins.rollout.verl_vllm.cpu_settings import cpu_vllm_overrides

    return cpu_vllm_overrides(config, "cpu" if str(config.trainer.device) == "cpu" else None, dict(os.environ))


def stops_with_a_checkpoint(config: Any) -> bool:
    """Whether Ctrl-C asks the trainer to checkpoint and stop between two steps: only the areal_async trainer
    reads that request, and only a recipe that checkpoints has something to save. Others get SIGTERM at once
    (verl's own trainers, ``areal.mode: sync``; a plain verl recipe has no ``areal`` node)."""
    from omegaconf import OmegaConf

    from areal_plugins.config.settings import areal_settings

    checkpoints = float(OmegaConf.select(config, "trainer.save_freq", default=-1) or -1) > 0
    return areal_settings(config).async_trainer and checkpoints


def train(
    recipe: Path, overrides: list[str], run_dir: Path | None, tiny_dir: Path | None, max_restarts: int | None = None
) -> int:
    """Run verl's ``main_ppo`` on ``recipe``, restarted from its last checkpoint after a failure up to
    ``max_restarts`` times (default: the recipe's ``areal.max_restarts``, else 0); return the exit code."""
    from omegaconf import OmegaConf

    from areal_plugins.cli.preflight import RecipeRefusedError, run_platform
    from areal_plugins.cli.restarts import RESUME_OVERRIDE, RestartPolicy, SignalLatch
    from areal_plugins.config.settings import areal_settings
    from areal_plugins.rollout.verl_vllm.cpu_settings import cpu_vllm_overrides, missing_cpu_vllm

    recipe = recipe.resolve()
    env = with_ray_defaults(dict(os.environ))
    try:  # before anything is built or started: a bad recipe costs seconds, and says what to change
        local_accelerator = has_accelerator()
        config, tiny_assets = checked_recipe(recipe, overrides, tiny_dir, local_accelerator)
        address = cluster_address(env, overrides)
        platform = run_platform(str(config.trainer.device), local_accelerator, address, env.get("VERL_PLATFORM"))
        if missing := missing_cpu_vllm(config, platform):
            raise RecipeRefusedError(missing)
        if max_restarts is None:
            max_restarts = areal_settings(config).max_restarts
        if max_restarts > 0 and float(OmegaConf.select(config, "trainer.save_freq", default=-1) or -1) <= 0:
            raise RecipeRefusedError(
                f"--max-restarts {max_restarts} resumes from the last checkpoint, and this recipe writes none: set "
                "trainer.save_freq to a number of steps (e.g. trainer.save_freq=10), or --max-restarts 0"
            )
        run_dir = (run_dir or Path("runs") / f"{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        # Where verl writes checkpoints: ours, unless the user's trainer.default_local_dir (it comes later, so wins).
        checkpoints = Path(override_value(overrides, "trainer.default_local_dir") or run_dir / "checkpoints")
        if max_restarts > 0 and address is not None:
            require_shared_checkpoints(max_restarts, checkpoints, address)
    except RecipeRefusedError as refusal:
        logger.error("refused: %s", refusal)
        return REFUSED_EXIT_CODE
    if platform is not None and "VERL_PLATFORM" not in env:
        env["VERL_PLATFORM"] = platform
        logger.info("trainer.device=%s: verl runs on the CPU platform in every process (VERL_PLATFORM=cpu)", platform)
    for variable, (workload, chosen) in tiny_assets.items():
        env[variable] = str(ensure_tiny_assets(chosen, workload=workload).resolve())
    write_run_args(run_dir, recipe, overrides, tiny_dir)
    fixed = [
        f"--config-path={recipe.parent}",
        f"--config-name={recipe.stem}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        *join_cluster_overrides(address, config.ray_kwargs.ray_init.keys()),
    ]
    policy = RestartPolicy(max_restarts)
    attempt_overrides = list(overrides)
    while True:
        prepare_run_dir(run_dir, env, restart=policy.restarts > 0)
        command = [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            *fixed,
            *job_env_overrides(env),
            *cpu_vllm_overrides(config, platform, env),
            *attempt_overrides,
        ]
        attempt, elapsed, log_path = run_verl(
            command, run_dir, checkpoints, env, config, total_steps(recipe, overrides)
        )
        join_metrics(run_dir)  # one metrics.jsonl for the whole run, restarts included
        latch = SignalLatch()  # verl has ended: a Ctrl-C from now on cancels any restart
        latch.install()
        if attempt.user_signal is None and latch.received is not None:
            attempt = dataclasses.replace(attempt, user_signal=latch.received)
        wait_s, why = policy.next_restart(attempt)
        if wait_s is None:
            if policy.restarts and attempt.code != 0:
                logger.error("not restarting after restart %d: %s", policy.restarts, why)
            return finish(run_dir, attempt.code, attempt.user_signal, attempt.last_error, elapsed, log_path, address)
        leftovers = end_run_leftovers(run_dir, address)  # every node's, when the run joined a cluster
        logger.warning(
            "restart %d/%d in %.0f s: verl stopped (exit code %d%s) after %.0f s; resuming from the checkpoint of "
            "step %s%s",
            policy.restarts,
            max_restarts,
            wait_s,
            attempt.code,
            f": {attempt.last_error}" if attempt.last_error else "",
            elapsed,
            attempt.checkpoint if attempt.checkpoint is not None else "none (from the start)",
            f"; killed {leftovers} processes it left behind" if leftovers else "",
        )
        cancelled = latch.wait(wait_s)
        if cancelled is not None:
            logger.error("%s during the wait: not restarting", signal.Signals(cancelled).name)
            return 128 + cancelled
        if RESUME_OVERRIDE not in attempt_overrides:
            attempt_overrides.append(RESUME_OVERRIDE)


def require_shared_checkpoints(max_restarts: int, checkpoints: Path, address: str) -> None:
    """Refuse automatic restarts on a cluster whose nodes do not all see the checkpoint folder
    (cli/shared_folders.py)."""
    from areal_plugins.cli.preflight import RecipeRefusedError
    from areal_plugins.cli.shared_folders import refusal, unshared_nodes

    missing = unshared_nodes(checkpoints, address)
    if missing:
        raise RecipeRefusedError(refusal(max_restarts, checkpoints, missing))
    logger.info("--max-restarts %d: every node of the cluster sees %s", max_restarts, checkpoints)


RUN_ARGS_FILE = "run_args.json"
#: The format of the run's records that a replay compares with: 2 since token digests are of the ids packed as
#: 64-bit integers (2026-12-03); records without it digest the ids as text, which no replay can match.
RECORD_FORMAT = 2


def write_run_args(run_dir: Path, recipe: Path, overrides: list[str], tiny_dir: Path | None) -> None:
    """What ``areal-plugins train`` was given (``run_args.json``): what ``areal-plugins replay`` runs again. Kept
    from the first start: a later start in the same directory resumes the run that step 1 began."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / RUN_ARGS_FILE).exists():
        return
    args = {
        "recipe": str(recipe),
        "overrides": list(overrides),
        "tiny_dir": str(tiny_dir.resolve()) if tiny_dir else None,
        "record_format": RECORD_FORMAT,
    }
    (run_dir / RUN_ARGS_FILE).write_text(json.dumps(args, indent=1) + "\n")


def run_verl(
    command: list[str], run_dir: Path, checkpoints: Path, env: dict[str, str], config: Any, total: str
) -> tuple[Any, float, Path]:
    """One start of verl's ``main_ppo``, followed to its end: ``(Attempt, seconds, train.log)``."""
    from areal_plugins.cli.restarts import Attempt, latest_checkpoint

    (run_dir / "command.txt").write_text(" ".join(command) + "\n")
    stop_request = run_dir / STOP_REQUEST_FILE
    stop_request.unlink(missing_ok=True)  # a request left by an earlier (stopped) run of this directory
    logger.info("run directory %s (full log: train.log, metrics: metrics.jsonl)", run_dir)
    started = time.monotonic()
    with BoundedLog(run_dir / "train.log") as log_file:  # a resumed run continues the log
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=new_group_dying_with_parent,
        )
        stopper = RunStopper(process, stop_request=stop_request if stops_with_a_checkpoint(config) else None)
        stopper.install()
        last_error = follow_output(process, log_file, total, started)
        code = process.wait()
    if log_file.suppressed_total:
        logger.warning(
            "%d repeated log lines were counted, not written (train.log says which)", log_file.suppressed_total
        )
    attempt = Attempt(code, stopper.signal_received, last_error, latest_checkpoint(checkpoints))
    return attempt, time.monotonic() - started, log_file.path


#: The rows of a run's earlier attempts while an automatic restart runs (verl's file logger truncates its file);
#: joined back into ``metrics.jsonl`` when the attempt ends (:func:`join_metrics`).
EARLIER_METRICS = "metrics.earlier.jsonl"


def prepare_run_dir(run_dir: Path, env: dict[str, str], restart: bool = False) -> Path:
    """Make the run folder and point the run's records there through ``env``.

    An automatic restart (``restart``) continues the run's ``metrics.jsonl``: its rows wait in
    :data:`EARLIER_METRICS` while verl writes the new attempt's. A folder found at the start of ``train``
    (resumed by hand, or reused) has its metrics kept aside as ``metrics.before-<time>.jsonl``."""
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    earlier = run_dir / EARLIER_METRICS
    if not restart:
        join_metrics(run_dir)  # a restart interrupted before its join: its rows belong to that run
    if metrics.exists() and restart:
        with earlier.open("ab") as kept_rows:
            kept_rows.write(metrics.read_bytes())
        metrics.unlink()
    elif metrics.exists():
        kept = run_dir / f"metrics.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        metrics.rename(kept)
        logger.info("run directory exists (resuming?): earlier metrics kept as %s", kept.name)
    env["VERL_FILE_LOGGER_PATH"] = str(metrics)
    env["AREAL_RUN_DIR"] = str(run_dir)
    return run_dir


def _step_of(line: bytes) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def join_metrics(run_dir: Path) -> None:
    """Put the earlier attempts' rows (:data:`EARLIER_METRICS`) back before the last attempt's, in one file.

    The last attempt resumed from a checkpoint, so it trains again the steps after it: an earlier row of a step
    the last attempt logged is dropped (the retrained step counts, as ``areal-plugins compare`` reads it)."""
    earlier = run_dir / EARLIER_METRICS
    if not earlier.exists():
        return
    metrics = run_dir / "metrics.jsonl"
    latest = metrics.read_bytes().splitlines(keepends=True) if metrics.exists() else []
    steps = [step for step in map(_step_of, latest) if step is not None]
    first = min(steps) if steps else None
    kept = [
        line
        for line in earlier.read_bytes().splitlines(keepends=True)
        if line.strip() and (first is None or (_step_of(line) or 0) < first)
    ]
    joined = run_dir / "metrics.jsonl.joining"
    joined.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in kept + latest))
    joined.replace(metrics)
    earlier.unlink()


#: How an error raised by this package starts on verl's output (the exception's module path).
OWN_ERROR_PREFIX = "areal_plugins."


def follow_output(process: subprocess.Popen, log_file: BoundedLog, total: str, started: float) -> str | None:
    """Copy verl's output to ``train.log`` and print a line per step and per startup milestone; return the last
    error line seen, ours first when one of ours was raised (the cause shown when verl fails; the traceback stays
    in train.log).

    Ours name the replica, worker, plugin or tensor at fault; errors printed after them are mostly consequences
    (actors dying while Ray tears the job down, in an order that varies from run to run), so the last line alone
    can hide the cause."""
    assert process.stdout is not None
    last_error, last_own_error = None, None
    for line in process.stdout:
        log_file.write(line)
        match = STEP_LINE.search(line)
        error = error_in(line)
        if match:
            for message in format_progress(int(match.group(1)), total, match.group(2)).splitlines():
                logger.info(message)
        elif error:
            last_error = error.group(1)
            if last_error.startswith(OWN_ERROR_PREFIX):
                last_own_error = last_error
        else:
            for needle, message in MILESTONES.items():
                if needle in line:
                    logger.info("%s (%.0f s)", message, time.monotonic() - started)
    if last_own_error is None or last_own_error == last_error:
        return last_error
    # Ours first; the last line too, in case it is a later failure of its own (a CUDA OOM after a recovered error).
    return f"{last_own_error} (the last error printed: {last_error})"


def finish(
    run_dir: Path,
    code: int,
    signal_received: int | None,
    last_error: str | None,
    elapsed: float,
    log: Path,
    cluster: str | None = None,
) -> int:
    """Kill what the run left behind (on every node of the ``cluster`` it joined), say how it ended (and what it
    achieved); return the CLI's exit code."""
    leftovers = end_run_leftovers(run_dir, cluster)  # Ray daemons and engines a killed driver could not stop
    if leftovers:
        logger.warning("killed %d processes the run left behind", leftovers)
    if signal_received is not None:
        name = signal.Signals(signal_received).name
        logger.error("stopped by %s after %.0f s; resume from the last checkpoint with the same command", name, elapsed)
        return 128 + signal_received
    if code != 0:
        cause = f": {last_error}" if last_error else ""
        logger.error("verl stopped (exit code %d) after %.0f s%s (traceback in %s)", code, elapsed, cause, log)
    else:
        logger.info("done in %.0f s", elapsed)
        _report(run_dir)
    return code


def _report(run_dir: Path) -> None:
    """Log what the run achieved and draw its reward curve."""
    from areal_plugins.records.plots import plot_all
    from areal_plugins.records.report import summarize_run

    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        logger.warning("no metrics were written to %s", metrics_path)
        return
    for line in summarize_run(metrics_path):
        logger.info(line)
    for picture in plot_all(run_dir):
        logger.info("picture: %s", picture)
