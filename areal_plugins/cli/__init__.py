"""``areal-plugins``: the command line. It parses and dispatches; each command lives where its job is.

``train`` (:mod:`areal_plugins.cli.launch`) runs verl's own ``main_ppo`` on a recipe in a child process,
with the environment the machine needs, writes everything to a run directory and prints one progress
line per step; ``check`` runs every startup check and fits the recipe to a declared cluster
(:mod:`areal_plugins.planning.cluster_fit`); ``build-tiny`` builds the tiny CPU assets; ``plot`` draws a run
directory's pictures; ``plan`` recommends η and the GPU split for a GPU cluster. The benchmarks are scripts of a
source checkout (``python tools/bench.py``), not commands: a wheel does not ship ``tools/``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from areal_plugins.cli.cluster_env import has_accelerator
from areal_plugins.cli.launch import DEFAULT_TINY_DIR, REFUSED_EXIT_CODE, checked_recipe, ensure_tiny_assets, train

logger = logging.getLogger("areal_plugins.cli")


def check(recipe: Path, overrides: list[str], cluster_args: argparse.Namespace) -> int:
    """``areal-plugins check``: every startup check and the fit on a declared cluster; nothing starts."""
    from areal_plugins.cli.preflight import RecipeRefusedError, check_model_config
    from areal_plugins.planning.cluster_fit import Cluster, fit_cluster, missing_here

    try:
        config, _ = checked_recipe(recipe.resolve(), overrides, None, has_accelerator())
        check_model_config(config, cluster_args.model_config)
        cluster = Cluster(cluster_args.nodes, cluster_args.gpus_per_node, cluster_args.gpu_memory_gib)
        where = fit_cluster(config, cluster, cluster_args.model_config)
    except RecipeRefusedError as refusal:
        logger.error("refused: %s", refusal)
        return REFUSED_EXIT_CODE
    logger.info(
        "ok: %s passes verl's and areal_plugins' checks and fits %d node(s) x %d GPU(s)",
        recipe.name,
        cluster.nodes,
        cluster.gpus_per_node,
    )
    for line in where:  # fit_cluster's "warning: ..." lines pass and say what to change
        if line.startswith("warning: "):
            logger.warning("%s", line)
        else:
            logger.info("  %s", line)
    for line in limit_lines(config, cluster_args.nodes, cluster_args.cpus_per_node):
        logger.info("  %s", line)
    missing = missing_here(config)
    if missing:
        logger.warning(
            "not installed on this machine (needed where the run runs): %s; install the gpu extra "
            "(pip install -e '.[gpu]' in a clone; docs/guides/gpus.md)",
            ", ".join(missing),
        )
    warn_about_cluster_access(overrides)
    return 0


def limit_lines(config: Any, nodes: int, cpus_per_node: int | None) -> list[str]:
    """``check``'s list of the run's limits, each with its value for the recipe and its source (driver/limits.py:
    the list the run logs at startup), and the reward's scoring processes on ``nodes`` x ``cpus_per_node``."""
    from areal_plugins.driver.limits import format_limits, run_limits, scorer_line

    lines = ["the run's limits (value for this recipe, and where it comes from):"]
    lines += [f"  {line}" for line in format_limits(run_limits(config))]
    return [*lines, scorer_line(config, nodes if cpus_per_node is not None else None, cpus_per_node)]


def warn_about_cluster_access(overrides: list[str]) -> None:
    """``check``'s look at the cluster the run is told to join: a warning when it is reached without a token (anyone
    who reaches its GCS can run code on every node), or when it asks for one and this shell sets none."""
    import os

    from areal_plugins.cli.cluster_env import accepts_without_token, auth_warning, declared_cluster_address

    address = declared_cluster_address(dict(os.environ), overrides)
    if address is None:
        return
    warning = auth_warning(address, accepts_without_token(address), dict(os.environ))
    if warning:
        logger.warning("%s", warning)


def add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    from areal_plugins.planning.plan import PAPER_FIT

    plan.add_argument(
        "--recipe",
        type=Path,
        help="a recipe (ours, or verl's ppo_trainer.yaml) whose data.train_batch_size, rollout.n, "
        "data.max_response_length, data.max_prompt_length and model.path the plan takes where an option does not set "
        "them; overrides follow the options, as for check",
    )
    plan.add_argument("overrides", nargs="*", help="Hydra overrides of --recipe, as for check")
    plan.add_argument(
        "--model",
        default=None,
        help="a hub model of areal_plugins' table (areal_plugins/planning/model_shapes.yaml, e.g. Qwen/Qwen2.5-7B), "
        "1.5b, 7b, 14b, 32b (R1-Distill-Qwen, the paper's), or a config.json or the folder holding one "
        "(default: --recipe's actor_rollout_ref.model.path, else 1.5b)",
    )
    plan.add_argument(
        "--model-config", type=Path, help="the model's config.json (or its folder), for a model the table lacks"
    )
    plan.add_argument("--gpu", default="h100", help="h100, h800, h200 or a100")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--batch", type=int, default=None, help="prompts per step (data.train_batch_size; default 512)")
    plan.add_argument("--group", type=int, default=None, help="responses per prompt (rollout.n; default 16)")
    plan.add_argument(
        "--response-mean",
        type=float,
        default=None,
        help="mean response length, tokens, at most --max-response (default: the paper's lengths, mean 2,117 with "
        "0.5%% past 27,648, cut at --max-response; the plan says which)",
    )
    plan.add_argument(
        "--max-response",
        type=int,
        default=None,
        help="response length cap, tokens (the recipe's data.max_response_length; default 27,648, the paper's)",
    )
    plan.add_argument(
        "--truncated-fraction", type=float, default=0.005, help="share of responses that would run past the cap"
    )
    plan.add_argument("--lengths-file", type=Path, help="a sample of your response lengths, one per line")
    plan.add_argument(
        "--prompt-len", type=int, default=None, help="mean prompt, tokens (default 200, at most data.max_prompt_length)"
    )
    plan.add_argument("--decode-efficiency", type=float, default=PAPER_FIT.decode_bandwidth,
                      help="share of HBM bandwidth reached reading weights (default 1.0)")  # fmt: skip
    plan.add_argument("--compute-efficiency", type=float, default=PAPER_FIT.compute,
                      help="achieved share of BF16 FLOPs while training (default: fitted to the paper)")  # fmt: skip
    plan.add_argument("--split", type=int, help="GPUs that generate (default: the best of a search)")
    plan.add_argument("--eta", type=int, help="areal.max_staleness to plan for (default: chosen, see above)")
    plan.add_argument("--baseline", default="verl", choices=("verl", "areal-sync"),
                      help="the synchronous system the speedup is against: verl's colocated trainer, or the "
                      "paper's synchronous AReaL (half generate, half train), as in its Table 1")  # fmt: skip


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
        choices=("addition", "longtail", "calculator", "paced", "moe", "vision"),
        help="longtail: answers after a long-tailed run of thinking tokens (the benchmark's workload; use another "
        "--out, e.g. .areal/tiny_longtail); calculator: two-digit sums through a calculator tool, multi-turn "
        "(e.g. .areal/tiny_calculator); paced: an untrained ~20k-weight model for the paced-engine bench; moe: the "
        "addition task on a Qwen2-MoE (4 experts, 2 per token; e.g. .areal/tiny_moe); vision: the squares in a "
        "picture plus a number, on a tiny Qwen2-VL (e.g. .areal/tiny_vision)",
    )
    run = commands.add_parser("train", help="train with a recipe through verl's main_ppo")
    run.add_argument("recipe", type=Path)
    run.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.total_training_steps=10")
    run.add_argument("--run-dir", type=Path, default=None)
    run.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="after a failure (not Ctrl-C), resume from the last checkpoint up to this many times, with a doubling "
        "back-off; the same error twice with no new checkpoint stops for good (default: areal.max_restarts, else 0)",
    )
    run.add_argument(
        "--tiny-dir",
        type=Path,
        default=None,
        help="where the recipe's tiny model and data are (built there if missing); default .areal/tiny, "
        ".areal/tiny_calculator for the calculator recipe",
    )
    plot = commands.add_parser("plot", help="draw reward, staleness and timeline pictures of a run directory")
    plot.add_argument("run_dir", type=Path)
    compare = commands.add_parser(
        "compare", help="where two runs first differ: trained trajectories (tokens, requests, rewards), then losses"
    )
    compare.add_argument("first_run", type=Path)
    compare.add_argument("second_run", type=Path)
    compare.add_argument(
        "--rtol", type=float, default=0.0, help="relative tolerance for floats (rewards, losses); default exact"
    )
    replay = commands.add_parser(
        "replay",
        help="run a recorded async run again by its record (bit for bit on areal_cpu) and say where it differs",
    )
    replay.add_argument("run_dir", type=Path, help="the recorded run's directory (made by areal-plugins train)")
    replay.add_argument(
        "overrides", nargs="*", help="Hydra overrides to change a setting, e.g. actor_rollout_ref.actor.optim.lr=2e-5"
    )
    replay.add_argument("--until", type=int, default=None, help="last step to replay (default: every recorded step)")
    replay.add_argument(
        "--from-checkpoint",
        type=int,
        default=None,
        metavar="STEP",
        help="start from the recorded run's checkpoint of STEP and replay the steps after it (colocated runs)",
    )
    replay.add_argument("--out", type=Path, default=None, help="the replay's run directory (default: RUN_DIR-replay)")
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
    preflight.add_argument(
        "--cpus-per-node",
        type=int,
        default=None,
        help="CPUs of each node, for the reward's scoring processes (areal.reward.num_workers: null); "
        "without it they are sized at startup from Ray's nodes",
    )
    preflight.add_argument(
        "--model-config",
        type=Path,
        help="the model's config.json (or its folder) when actor_rollout_ref.model.path is a hub id that "
        "areal_plugins' table (areal_plugins/planning/model_shapes.yaml) lacks",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s areal-plugins: %(message)s", datefmt="%H:%M:%S")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("train", "check", "replay", "plan"):  # overrides after the options: argparse leaves them over
        late = [arg for arg in rest if "=" in arg and not arg.startswith("-")]
        args.overrides += late
        rest = [arg for arg in rest if arg not in late]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "plan":
        from areal_plugins.cli.preflight import plan_options
        from areal_plugins.planning.plan import run_plan

        plan_options(args)
        return run_plan(args)
    if args.command == "plot":
        from areal_plugins.records.plots import plot_all

        if not args.run_dir.is_dir():
            raise SystemExit(f"{args.run_dir} is not a directory; pass a run directory made by areal-plugins train")
        written = plot_all(args.run_dir)
        if not written:
            raise SystemExit(f"{args.run_dir} holds no metrics.jsonl or areal_*.jsonl to draw")
        for path in written:
            logger.info("wrote %s", path)
        return 0
    if args.command == "compare":
        from areal_plugins.records.compare import compare_runs

        try:
            result = compare_runs(args.first_run, args.second_run, args.rtol)
        except (OSError, ValueError, KeyError) as error:  # exit status 2: neither "match" (0) nor "differ" (1)
            print(f"areal-plugins compare: cannot compare: {error}", file=sys.stderr)
            return 2
        if result.divergence is not None:
            print(f"the runs differ at {result.divergence} (after {result.steps} matching steps)")
            return 1
        print(f"the runs match over {result.steps} steps and {result.trajectories} trained trajectories")
        return 0
    if args.command == "check":
        return check(args.recipe, args.overrides, args)
    if args.command == "replay":
        from areal_plugins.cli.replay import replay

        return replay(args.run_dir, args.out, args.until, args.overrides, args.from_checkpoint)
    if args.command == "build-tiny":
        ensure_tiny_assets(args.out, force=args.force, workload=args.workload)
        logger.info("tiny model and data in %s", args.out)
        return 0
    if args.max_restarts is not None and args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    return train(args.recipe, args.overrides, args.run_dir, args.tiny_dir, args.max_restarts)
