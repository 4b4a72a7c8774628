"""``areal-plugins``: build the tiny CPU assets and launch verl with a recipe.

``areal-plugins train RECIPE [KEY=VALUE ...]`` runs verl's own ``main_ppo`` on the recipe in a
child process, with the environment a CPU machine needs, writes everything to a run directory and
prints one progress line per training step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from areal_plugins.run.bounded_log import BoundedLog
from areal_plugins.run.control import (
    STOP_REQUEST_FILE,
    RunStopper,
    kill_run_leftovers,
    new_group_dying_with_parent,
)

logger = logging.getLogger("areal_plugins.cli")

DEFAULT_TINY_DIR = Path(".areal/tiny")
#: Environment variable a recipe reads its tiny assets from -> (workload built there, default directory).
#: None: whatever workload is built there (addition if none).
TINY_ASSET_VARIABLES: dict[str, tuple[str | None, Path]] = {
    "AREAL_TINY_DIR": (None, DEFAULT_TINY_DIR),
    "AREAL_TINY_CALCULATOR_DIR": ("calculator", Path(".areal/tiny_calculator")),
}
STEP_LINE = re.compile(r"step:(\d+) - (.*)")
#: The last line of a Python traceback (``module.SomeError: message``), behind Ray's ``(Actor pid=1)`` prefix.
ERROR_LINE = re.compile(r"^(?:\(.*?\)\s*)?((?:[\w.]+\.)?\w+(?:Error|Exception|Exit|Interrupt)\b:?.*)$")
#: Exit code of a run refused at startup (argparse's for bad usage).
REFUSED_EXIT_CODE = 2
#: verl's own milestones worth a progress line while the (slow, ~1.5 min) startup runs.
MILESTONES = {
    "actor and ref model engine initialized": "trainer workers ready",
    "checkpoint engine manager initialized": "rollout servers ready",
    "all initialize finished": "verl initialised; training",
    "validation metrics": "validation done",
}
PROGRESS_KEYS = (
    ("critic/score/mean", "reward"),
    ("actor/pg_loss", "pg_loss"),
    ("response_length/mean", "resp_len"),
    ("timing_s/gen", "gen_s"),
    ("timing_s/update_actor", "train_s"),
    ("timing_s/step", "step_s"),
)


#: Ray's GCS keeps an event record (~3.6 KB measured) for each of the last N tasks, N = 100,000 by default
#: (~360 MB). A run makes ~250 actor calls per step, so the GCS grew ~300 MB/h for hours in our soak; 10,000
#: keeps the recent tasks for the dashboard and caps the GCS's share at ~40 MB. A value already set wins.
RAY_ENV_DEFAULTS = {"RAY_task_events_max_num_task_in_gcs": "10000"}


#: What processes of the run read from their environment. They travel in the Ray job's ``runtime_env``, so
#: workers on every node of an existing cluster see them, not only processes started from this shell.
JOB_ENV_VARS = (
    "AREAL_RUN_DIR",
    "AREAL_TINY_DIR",
    "AREAL_DATA_DIR",  # the GPU recipes' data folder, resolved in verl's TaskRunner actor (on any node)
    "VERL_PLATFORM",
    "VERL_FILE_LOGGER_PATH",
    "AREAL_VLLM_PYTHON",
)
#: ``ray.init`` refuses these when it joins a running cluster: they size a cluster Ray would start.
LOCAL_CLUSTER_SIZES = ("num_cpus", "num_gpus", "object_store_memory")


def job_env_overrides(env: dict[str, str]) -> list[str]:
    """Hydra overrides that put ``JOB_ENV_VARS`` into the job's runtime environment (verl merges it)."""
    overrides = []
    for name in JOB_ENV_VARS:
        value = env.get(name)
        if value:
            if "'" in value:
                raise SystemExit(f"{name}={value!r}: a quote in this path cannot be passed to the Ray job; rename it")
            overrides.append(f"++ray_kwargs.ray_init.runtime_env.env_vars.{name}='{value}'")
    return overrides


def cluster_address(env: dict[str, str], overrides: list[str]) -> str | None:
    """The running Ray cluster this run joins (``ray_kwargs.ray_init.address`` or ``RAY_ADDRESS``), if any."""
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key == "ray_kwargs.ray_init.address" and value not in ("", "null", "None", "local"):
            return value
    address = env.get("RAY_ADDRESS", "").strip()
    if address:
        return address if address != "local" else None
    return running_local_cluster()


def running_local_cluster() -> str | None:
    """The cluster ``ray start`` left running on this machine, which ``ray.init()`` joins unasked."""
    from ray._private import services, utils

    address = utils.read_ray_address()
    return address if address and services.find_gcs_addresses() else None


def join_cluster_overrides(address: str | None, ray_init_keys: Iterable[str] = LOCAL_CLUSTER_SIZES) -> list[str]:
    """Joining ``address``: the recipe's local-cluster sizes are dropped (ray.init would refuse them).

    Only the sizes the composed ``ray_kwargs.ray_init`` has: verl's own node has none of them, so nulling one the
    recipe did not add would be refused by Hydra as an unknown key.
    """
    present = [key for key in LOCAL_CLUSTER_SIZES if key in set(ray_init_keys)]
    if address is None or not present:
        return []
    logger.info(
        "joining the Ray cluster at %s: the recipe's ray_kwargs.ray_init.{%s} size a cluster Ray would start "
        "and are dropped; the cluster's own resources apply",
        address,
        ",".join(present),
    )
    return [f"ray_kwargs.ray_init.{key}=null" for key in present]


def with_ray_defaults(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus our Ray defaults where it does not set them (they reach the Ray head verl starts)."""
    return {**RAY_ENV_DEFAULTS, **env}


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


def has_accelerator() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def ensure_tiny_assets(tiny_dir: Path, force: bool = False, workload: str | None = None) -> Path:
    """Build the tiny model and data of ``workload`` under ``tiny_dir`` unless already there.

    ``workload=None`` (training): whatever is built there, else the addition workload.
    """
    from areal_plugins.tiny.model import WORKLOADS, build_tiny_model
    from areal_plugins.tiny.task import write_dataset

    stamp = tiny_dir / "BUILT.json"
    if stamp.exists() and not force:
        built = json.loads(stamp.read_text()).get("workload", "addition")
        if workload is not None and built != workload:
            raise SystemExit(f"{tiny_dir} holds the {built!r} workload, not {workload!r}: pass another directory")
        return tiny_dir
    start = time.monotonic()
    workload = workload or "addition"
    spec = WORKLOADS[workload]
    logger.info("building the tiny model and data (%s) in %s (1-3 min on 2 cores)", workload, tiny_dir)
    metrics = build_tiny_model(tiny_dir / "model", spec)
    if spec.task == "calculator":
        from areal_plugins.tiny.calculator import write_calculator_dataset

        write_calculator_dataset(tiny_dir / "data", train_size=4096, test_size=256, seed=spec.seed)
    else:
        write_dataset(tiny_dir / "data", train_size=4096, test_size=256, seed=spec.seed)
    record = {"workload": workload, "spec": spec.__dict__, **metrics, "seconds": time.monotonic() - start}
    stamp.write_text(json.dumps(record, indent=2))
    return tiny_dir


def _parse_metrics(fields: str) -> dict[str, float]:
    """Parse verl's console line ``k1:v1 - k2:np.float64(v2) - ...`` into floats."""
    values: dict[str, float] = {}
    for item in fields.split(" - "):
        key, _, raw = item.partition(":")
        raw = re.sub(r"^np\.\w+\((.*)\)$", r"\1", raw.strip())
        try:
            values[key.strip()] = float(raw)
        except ValueError:
            continue
    return values


def _format_progress(step: int, total: str, fields: str) -> str:
    values = _parse_metrics(fields)
    parts = []
    if any(key in values for key, _ in PROGRESS_KEYS):
        parts.append(
            f"step {step}/{total}  "
            + "  ".join(f"{label}={values[key]:.3g}" for key, label in PROGRESS_KEYS if key in values)
        )
    validation = {k.split("/", 1)[1]: v for k, v in values.items() if k.startswith("val-core/")}
    if validation:
        shown = "  ".join(f"{k}={v:.3g}" for k, v in validation.items())
        parts.append(f"validation after step {step}: {shown}")
    return "\n".join(parts)


def _recipe_files(recipe: Path) -> list[Path]:
    """The recipe and the shared files of its directory that its defaults list includes."""
    import yaml

    files = [recipe]
    for entry in (yaml.safe_load(recipe.read_text()) or {}).get("defaults", []):
        shared = recipe.parent / f"{entry}.yaml" if isinstance(entry, str) else None
        if shared is not None and shared.exists():
            files.append(shared)
    return files


def _recipe_value(recipe: Path, overrides: list[str], section: str, key: str) -> str | None:
    """``section.key`` from the overrides, else from the recipe's files (the recipe before its shared files)."""
    import yaml

    for override in overrides:
        if override.lstrip("+").startswith(f"{section}.{key}="):
            return override.split("=", 1)[1]
    for path in _recipe_files(recipe):
        value = ((yaml.safe_load(path.read_text()) or {}).get(section) or {}).get(key)
        if value is not None:
            return str(value)
    return None


def _total_steps(recipe: Path, overrides: list[str]) -> str:
    """``trainer.total_training_steps`` from the overrides, else from the recipe's files."""
    return _recipe_value(recipe, overrides, "trainer", "total_training_steps") or "?"


def checked_recipe(
    recipe: Path, overrides: list[str], tiny_dir: Path | None, local_accelerator: bool
) -> tuple[Any, dict[str, tuple]]:
    """The recipe composed and through every startup check, and the tiny assets it reads (variable -> (workload,
    folder); not built here). Raises ``RecipeRefusedError``."""
    from areal_plugins.run.preflight import check_recipe

    recipe_text = "".join(path.read_text() for path in _recipe_files(recipe)) if recipe.is_file() else ""
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
        return check_recipe(recipe, overrides), tiny_assets


def check(recipe: Path, overrides: list[str], cluster_args: argparse.Namespace) -> int:
    """``areal-plugins check``: every startup check and the fit on a declared cluster; nothing starts."""
    from areal_plugins.run.cluster_fit import Cluster, fit_cluster, missing_here
    from areal_plugins.run.preflight import RecipeRefusedError

    try:
        config, _ = checked_recipe(recipe.resolve(), overrides, None, has_accelerator())
        cluster = Cluster(cluster_args.nodes, cluster_args.gpus_per_node, cluster_args.gpu_memory_gib)
        where = fit_cluster(config, cluster)
    except RecipeRefusedError as refusal:
        logger.error("refused: %s", refusal)
        return REFUSED_EXIT_CODE
    logger.info(
        "ok: %s passes verl's and areal_plugins' checks and fits %d node(s) x %d GPU(s)",
        recipe.name,
        cluster.nodes,
        cluster.gpus_per_node,
    )
    for line in where:
        logger.info("  %s", line)
    missing = missing_here(config)
    if missing:
        logger.warning(
            "not installed on this machine (needed where the run runs): %s; install the gpu extra "
            "(pip install -e '.[gpu]' in a clone; docs/guides/gpus.md)",
            ", ".join(missing),
        )
    return 0


def stops_with_a_checkpoint(config: Any) -> bool:
    """Whether Ctrl-C asks the trainer to checkpoint and stop between two steps: only the areal_async trainer
    reads that request, and only a recipe that checkpoints has something to save. Others get SIGTERM at once
    (verl's own trainers, ``areal.mode: sync``; a plain verl recipe has no ``areal`` node)."""
    from omegaconf import OmegaConf

    async_trainer = bool(OmegaConf.select(config, "areal.enable", default=False)) and (
        OmegaConf.select(config, "areal.mode", default="async") == "async"
    )
    return async_trainer and float(OmegaConf.select(config, "trainer.save_freq", default=-1) or -1) > 0


def train(recipe: Path, overrides: list[str], run_dir: Path | None, tiny_dir: Path | None) -> int:
    """Run verl's ``main_ppo`` on ``recipe``; return its exit code."""
    from areal_plugins.run.preflight import RecipeRefusedError, run_platform

    recipe = recipe.resolve()
    env = with_ray_defaults(dict(os.environ))
    try:  # before anything is built or started: a bad recipe costs seconds, and says what to change
        local_accelerator = has_accelerator()
        config, tiny_assets = checked_recipe(recipe, overrides, tiny_dir, local_accelerator)
        address = cluster_address(env, overrides)
        platform = run_platform(str(config.trainer.device), local_accelerator, address, env.get("VERL_PLATFORM"))
    except RecipeRefusedError as refusal:
        logger.error("refused: %s", refusal)
        return REFUSED_EXIT_CODE
    if platform is not None and "VERL_PLATFORM" not in env:
        env["VERL_PLATFORM"] = platform
        logger.info("trainer.device=%s: verl runs on the CPU platform in every process (VERL_PLATFORM=cpu)", platform)
    for variable, (workload, chosen) in tiny_assets.items():
        env[variable] = str(ensure_tiny_assets(chosen, workload=workload).resolve())
    run_dir = (run_dir or Path("runs") / f"{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():  # verl's file logger truncates: keep the earlier run's metrics beside it
        kept = run_dir / f"metrics.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        metrics.rename(kept)
        logger.info("run directory exists (resuming?): earlier metrics kept as %s", kept.name)
    env["VERL_FILE_LOGGER_PATH"] = str(metrics)
    env["AREAL_RUN_DIR"] = str(run_dir)
    command = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={recipe.parent}",
        f"--config-name={recipe.stem}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        *join_cluster_overrides(address, config.ray_kwargs.ray_init.keys()),
        *job_env_overrides(env),
        *overrides,
    ]
    (run_dir / "command.txt").write_text(" ".join(command) + "\n")
    stop_request = run_dir / STOP_REQUEST_FILE
    stop_request.unlink(missing_ok=True)  # a request left by an earlier (stopped) run of this directory
    saves_checkpoints = stops_with_a_checkpoint(config)
    total = _total_steps(recipe, overrides)
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
        stopper = RunStopper(process, stop_request=stop_request if saves_checkpoints else None)
        stopper.install()
        assert process.stdout is not None
        last_error = None  # the cause shown when verl fails; the traceback stays in train.log
        for line in process.stdout:
            log_file.write(line)
            match = STEP_LINE.search(line)
            error = ERROR_LINE.match(line.strip())
            if match:
                for message in _format_progress(int(match.group(1)), total, match.group(2)).splitlines():
                    logger.info(message)
            elif error:
                last_error = error.group(1)
            else:
                for needle, message in MILESTONES.items():
                    if needle in line:
                        logger.info("%s (%.0f s)", message, time.monotonic() - started)
        code = process.wait()
    if log_file.suppressed_total:
        logger.warning(
            "%d repeated log lines were counted, not written (train.log says which)", log_file.suppressed_total
        )
    elapsed = time.monotonic() - started
    leftovers = kill_run_leftovers(run_dir)  # Ray daemons and engines a killed driver could not stop
    if leftovers:
        logger.warning("killed %d processes the run left behind", leftovers)
    if stopper.signal_received is not None:
        name = signal.Signals(stopper.signal_received).name
        logger.error("stopped by %s after %.0f s; resume from the last checkpoint with the same command", name, elapsed)
        return 128 + stopper.signal_received
    if code != 0:
        cause = f": {last_error}" if last_error else ""
        logger.error(
            "verl stopped (exit code %d) after %.0f s%s (traceback in %s)", code, elapsed, cause, log_file.path
        )
    else:
        logger.info("done in %.0f s", elapsed)
        _report(run_dir)
    return code


def _report(run_dir: Path) -> None:
    """Log what the run achieved and draw its reward curve."""
    from areal_plugins.run.plots import plot_all
    from areal_plugins.run.report import summarize_run

    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        logger.warning("no metrics were written to %s", metrics_path)
        return
    for line in summarize_run(metrics_path):
        logger.info(line)
    for picture in plot_all(run_dir):
        logger.info("picture: %s", picture)


def _run_tool(name: str, argv: list[str]) -> int:
    """Run a script of the repository's ``tools/`` (benchmarks live there, not in the package)."""
    import runpy

    path = Path(__file__).resolve().parents[1] / "tools" / name
    if not path.exists():
        raise SystemExit(f"{path} not found: `areal-plugins {name[:-3]}` needs a source checkout (pip install -e .)")
    sys.argv = [str(path), *argv]
    namespace = runpy.run_path(str(path))
    return int(namespace["main"](argv) or 0)


def add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    from areal_plugins.planning.plan import PAPER_FIT

    plan.add_argument("--model", default="1.5b", help="1.5b, 7b, 14b or 32b (R1-Distill-Qwen shapes)")
    plan.add_argument("--gpu", default="h100", help="h100, h800, h200 or a100")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--batch", type=int, default=512, help="prompts per step (data.train_batch_size)")
    plan.add_argument("--group", type=int, default=16, help="responses per prompt (rollout.n)")
    plan.add_argument("--response-mean", type=float, default=2117.0, help="mean response length, tokens")
    plan.add_argument("--max-response", type=int, default=27648, help="response length cap, tokens")
    plan.add_argument(
        "--truncated-fraction", type=float, default=0.005, help="share of responses that would run past the cap"
    )
    plan.add_argument("--lengths-file", type=Path, help="a sample of your response lengths, one per line")
    plan.add_argument("--prompt-len", type=int, default=200)
    plan.add_argument("--decode-efficiency", type=float, default=PAPER_FIT.decode_bandwidth,
                      help="achieved share of HBM bandwidth while decoding (default: fitted to the paper)")  # fmt: skip
    plan.add_argument("--compute-efficiency", type=float, default=PAPER_FIT.compute,
                      help="achieved share of BF16 FLOPs while training (default: fitted to the paper)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line (docs/reference/cli.md is generated from it)."""
    parser = argparse.ArgumentParser(prog="areal-plugins", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-tiny", help="build the tiny Qwen2 model and the addition data")
    build.add_argument("--out", type=Path, default=DEFAULT_TINY_DIR)
    build.add_argument("--force", action="store_true", help="rebuild even if already built")
    build.add_argument(
        "--workload",
        default="addition",
        choices=("addition", "longtail", "calculator"),
        help="longtail: answers after a long-tailed run of thinking tokens (the benchmark's workload; use another "
        "--out, e.g. .areal/tiny_longtail); calculator: two-digit sums through a calculator tool, multi-turn "
        "(e.g. .areal/tiny_calculator)",
    )
    run = commands.add_parser("train", help="train with a recipe through verl's main_ppo")
    run.add_argument("recipe", type=Path)
    run.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.total_training_steps=10")
    run.add_argument("--run-dir", type=Path, default=None)
    run.add_argument(
        "--tiny-dir",
        type=Path,
        default=None,
        help="where the recipe's tiny model and data are (built there if missing); default .areal/tiny, "
        ".areal/tiny_calculator for the calculator recipe",
    )
    plot = commands.add_parser("plot", help="draw reward, staleness and timeline pictures of a run directory")
    plot.add_argument("run_dir", type=Path)
    commands.add_parser("bench", help="async vs sync benchmark (tools/bench.py; --help there)", add_help=False)
    add_plan_arguments(
        commands.add_parser("plan", help="recommend η, the GPU split and the recipe keys for a GPU cluster")
    )
    preflight = commands.add_parser(
        "check", help="check a recipe against a declared GPU cluster, on any machine: nothing starts"
    )
    preflight.add_argument("recipe", type=Path)
    preflight.add_argument("overrides", nargs="*", help="Hydra overrides, as for train")
    preflight.add_argument("--nodes", type=int, required=True, help="nodes in the cluster")
    preflight.add_argument("--gpus-per-node", type=int, required=True)
    preflight.add_argument(
        "--gpu-memory-gib", type=float, default=79.6, help="memory of one GPU, GiB (H100 80 GB: 79.6)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s areal-plugins: %(message)s", datefmt="%H:%M:%S")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _run_tool("bench.py", rest)
    if args.command in ("train", "check"):  # overrides after the options: argparse leaves them over
        late = [arg for arg in rest if "=" in arg and not arg.startswith("-")]
        args.overrides += late
        rest = [arg for arg in rest if arg not in late]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "plan":
        from areal_plugins.planning.plan import run_plan

        return run_plan(args)
    if args.command == "plot":
        from areal_plugins.run.plots import plot_all

        if not args.run_dir.is_dir():
            raise SystemExit(f"{args.run_dir} is not a directory; pass a run directory made by areal-plugins train")
        written = plot_all(args.run_dir)
        if not written:
            raise SystemExit(f"{args.run_dir} holds no metrics.jsonl or areal_*.jsonl to draw")
        for path in written:
            logger.info("wrote %s", path)
        return 0
    if args.command == "check":
        return check(args.recipe, args.overrides, args)
    if args.command == "build-tiny":
        ensure_tiny_assets(args.out, force=args.force, workload=args.workload)
        logger.info("tiny model and data in %s", args.out)
        return 0
    return train(args.recipe, args.overrides, args.run_dir, args.tiny_dir)


if __name__ == "__main__":
    sys.exit(main())
