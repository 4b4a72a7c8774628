"""The fault matrix: kill each kind of process of a real run mid-step and record what the run did.

``python tools/faults.py`` runs every case in both placements (~5 min a case on 2 cores) and writes
``docs/results/faults.json``; ``--cases`` and ``--placements`` pick a part. Each case trains the tiny model
with ``areal-plugins train --max-restarts 2`` (checkpoint every step, ``areal.watchdog_s`` 120 s), waits for
step 2, kills the target and measures: how the run ended (recovered = exit 0 with every step trained, each
prompt group once, checked from ``areal_samples.jsonl``; stopped; or spinning = no new step and no restart for
the watchdog plus a margin, then killed), the restarts it took, the seconds from the kill to the next step
and to the end, the steps trained after the kill, the steps lost (trained but not checkpointed), whether the
log names the dead actor, how much the log grew, and what processes the run left behind. docs/faults.md reads
the table. ``--max-restarts 0`` measures the run without automatic resume.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "faults.json"
RECIPES = {"colocated": "grpo_cpu_async.yaml", "separate": "grpo_cpu_async_separate.yaml"}
WATCHDOG_S = 120
MARGIN_S = 120
STEPS = 6
KILL_AFTER_STEP = 2
GROUPS_PER_STEP = 16  # recipes/_cpu_grpo_tiny.yaml: 16 prompts x 8 answers
LOSS_CALLS_PER_STEP = 2  # 128 samples in micro-batches of 64 (recipes/_cpu_grpo_tiny.yaml)
#: Seconds a restarted attempt may take to reach its first step (a verl start on 2 cores) before "spinning".
RESTART_ALLOWANCE_S = 420
#: The cases the CLI must not restart: the user asked the run to stop.
USER_STOPS = ("ctrl_c", "sigterm")

#: case -> (what is killed, how it is found: a substring of the process's command line, or a signal to the CLI)
CASES = {
    "rollout_server": ("our areal_cpu rollout server (Ray actor)", "ray::CPURolloutServer"),
    "agent_loop_worker": ("verl's agent-loop worker, our subclass (Ray actor)", "ray::EpisodeAgentLoopWorker"),
    "load_balancer": ("verl's request load balancer (Ray actor)", "ray::GlobalRequestLoadBalancer"),
    "reward_loop_worker": ("verl's reward-loop worker (Ray actor)", "ray::RewardLoopWorker"),
    "reward_service_process": ("a worker process of our reward service", "reward-service"),
    "transfer_queue_controller": ("TransferQueue's controller (Ray actor)", "ray::TransferQueueController"),
    "transfer_queue_storage": ("TransferQueue's storage unit (Ray actor)", "ray::SimpleStorageUnit"),
    "trainer_worker": ("verl's trainer worker (Ray actor)", "ray::WorkerDict"),
    "trainer_worker_hangs": ("a trainer worker that hangs once in its loss (example plugin)", "HANG"),
    "task_runner": ("verl's driver actor TaskRunner", "ray::TaskRunner"),
    "ctrl_c": ("Ctrl-C (SIGINT to the CLI's process group)", "SIGINT"),
    "sigterm": ("SIGTERM to the CLI", "SIGTERM"),
}


#: What else counts as naming the dead part (our messages say it in words).
NAMED_AS = {
    "rollout_server": ("CPURolloutServer", "rollout server of areal_cpu"),
    "trainer_worker_hangs": ("trainer has been computing",),
    "reward_service_process": ("reward worker",),
}


@dataclass
class Outcome:
    case: str
    placement: str
    target: str
    killed: int
    outcome: str  # stopped | recovered | spinning | not-reached
    exit_code: int | None
    restarts: int
    seconds_to_next_step: float | None  # from the kill to the first step trained after it
    seconds_to_end: float | None
    steps_before_kill: int
    steps_after_kill: int
    steps_lost: int | None
    groups_check: str  # "each group once" or what the records show wrong
    names_the_actor: bool
    log_growth_bytes: int
    processes_left: int
    last_error: str


def read_steps(run_dir: Path) -> int:
    path = run_dir / "areal_steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def restarts_of(cli_log: Path) -> int:
    """The CLI's restart lines (``restart 1/2 in 10 s: ...``)."""
    text = cli_log.read_text(errors="replace") if cli_log.exists() else ""
    return len(re.findall(r"restart \d+/\d+ in ", text))


def sample_attempts(run_dir: Path) -> dict[int, dict[str, set[str]]]:
    """step -> attempt -> the prompt groups it trained, from ``areal_samples.jsonl`` (in the order written)."""
    path = run_dir / "areal_samples.jsonl"
    by_step: dict[int, dict[str, set[str]]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        sample = json.loads(line)
        by_step.setdefault(sample["step"], {}).setdefault(sample["attempt"], set()).add(sample["group"])
    return by_step


def steps_lost(run_dir: Path, exit_code: int | None) -> int:
    """Steps trained and then trained again after a restart, plus, for a run that did not finish, those trained
    after its last checkpoint."""
    by_step = sample_attempts(run_dir)
    redone = sum(len(attempts) - 1 for attempts in by_step.values())
    unsaved = max(by_step, default=0) - checkpointed(run_dir) if exit_code != 0 else 0
    return redone + max(unsaved, 0)


def groups_check(run_dir: Path, steps: int) -> str:
    """Whether the run trained every step, each prompt group once, read from its samples record: for each step,
    the samples of the last attempt that trained it (a step redone after a restart replaces the lost one)."""
    by_step = sample_attempts(run_dir)
    missing = [step for step in range(1, steps + 1) if step not in by_step]
    if missing:
        return f"steps {missing} not trained"
    trained: list[str] = []
    for step in range(1, steps + 1):
        attempts = by_step[step]
        groups = attempts[list(attempts)[-1]]  # dicts keep the order the record wrote them in
        if len(groups) != GROUPS_PER_STEP:
            return f"step {step} trained {len(groups)} groups, not {GROUPS_PER_STEP}"
        trained.extend(groups)
    twice = len(trained) - len(set(trained))
    return "each group once" if not twice else f"{twice} groups trained twice"


def checkpointed(run_dir: Path) -> int:
    path = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    return int(path.read_text()) if path.exists() else 0


def targets(pattern: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if pattern == "reward-service":  # the reward-loop worker's scorers: children of its fork server
            try:
                parent = process.parent()
                server = " ".join(parent.cmdline()) if parent else ""
                worker = " ".join(parent.parent().cmdline()) if parent and parent.parent() else ""
            except psutil.Error:
                continue
            if "multiprocessing.forkserver" in server and "RewardLoopWorker" in worker:
                found.append(process)
        elif pattern in cmdline:
            found.append(process)
    return found[:1] if pattern in ("ray::WorkerDict", "reward-service") else found


RAY_PREFIX = re.compile(r"^(\x1b\[\d+m)?\(\w+ pid=\d+(, ip=[\d.]+)?\)(\x1b\[0m)? ?")
#: Our stop messages, the most specific first.
STOP_MESSAGES = ("RunActorDiedError:", "RolloutServerDiedError:", "RunStoppedOnRequestError:", "areal watchdog:",
                 "RolloutsFailingError:", "RuntimeError:", "RayTaskError")  # fmt: skip


def stop_lines(log: str) -> list[str]:
    """The last 2,000 lines that report an error, without Ray's ``(Actor pid=...)`` prefix."""
    lines = [RAY_PREFIX.sub("", line).strip() for line in log.splitlines()[-2000:]]
    return [
        line
        for line in lines
        if "Error" in line or "ERROR:" in line or "areal watchdog" in line or line.startswith("class_name:")
    ]


def last_error(log: str) -> str:
    lines = stop_lines(log)
    for message in STOP_MESSAGES:
        for line in reversed(lines):
            if message in line and not line.startswith("[areal-plugins]"):
                return line[:400]
    return ""


def run_case(case: str, placement: str, tiny_dir: Path, max_restarts: int) -> Outcome:
    target, pattern = CASES[case]
    run_dir = Path(tempfile.mkdtemp(prefix=f"fault-{case}-{placement}-"))
    before = set(psutil.pids())
    command = [
        str(ROOT / ".venv" / "bin" / "areal-plugins"), "train", str(ROOT / "recipes" / RECIPES[placement]),
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.val_before_train=false",
        "trainer.test_freq=-1", f"areal.watchdog_s={WATCHDOG_S}", "--run-dir", str(run_dir),
        "--tiny-dir", str(tiny_dir), "--max-restarts", str(max_restarts),
    ]  # fmt: skip
    env = dict(os.environ)
    if pattern == "HANG":  # the example plugin's loss does not return from its 5th call, in step 3, once
        command.insert(3, "areal.micro_batch.max_tokens=null")  # verl's fixed micro-batches: 2 loss calls a step
        plugin = str(ROOT / "tests" / "example_plugin")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (plugin, env.get("PYTHONPATH")) if p)
        env["AREAL_EXAMPLE_OBSERVER_LOSS_HANGS_AFTER"] = str(KILL_AFTER_STEP * LOSS_CALLS_PER_STEP)
        env["AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_ONCE"] = str(run_dir / "hung-once")
    cli_log = run_dir / "cli.log"
    with cli_log.open("w") as out:
        cli = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 600
    while read_steps(run_dir) < KILL_AFTER_STEP and cli.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    steps_before = read_steps(run_dir)
    log_path = run_dir / "train.log"
    log_before = log_path.stat().st_size if log_path.exists() else 0
    killed = 0
    if cli.poll() is None and steps_before >= KILL_AFTER_STEP:
        if pattern == "HANG":
            killed = 1  # the hang starts by itself in the next step
        elif pattern in ("SIGINT", "SIGTERM"):
            os.killpg(cli.pid, getattr(signal, pattern)) if pattern == "SIGINT" else cli.send_signal(signal.SIGTERM)
            killed = 1
        else:
            for process in targets(pattern):
                try:
                    process.send_signal(signal.SIGKILL)
                    killed += 1
                except psutil.Error:
                    pass
    kill_time = time.monotonic()
    outcome = "not-reached" if not killed else None
    # Progress is a new step or a restart; a run with neither for the watchdog, a margin and a verl start spins.
    progress, last_progress, next_step_s = (steps_before, 0), kill_time, None
    while cli.poll() is None:
        now = (read_steps(run_dir), restarts_of(cli_log))
        if now != progress:
            progress, last_progress = now, time.monotonic()
            if next_step_s is None and now[0] > steps_before:
                next_step_s = last_progress - kill_time
        elif time.monotonic() - last_progress > WATCHDOG_S + MARGIN_S + RESTART_ALLOWANCE_S:
            outcome = "spinning"
            os.killpg(cli.pid, signal.SIGKILL)
            break
        time.sleep(0.5)
    code = cli.wait() if outcome != "spinning" else None
    if next_step_s is None and read_steps(run_dir) > steps_before:
        next_step_s = time.monotonic() - kill_time
    seconds = time.monotonic() - kill_time if killed else None
    time.sleep(3)
    left = 0
    for pid in set(psutil.pids()) - before:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(process.environ().values()):
                left += 1
                process.kill()
        except psutil.Error:
            continue
    steps_after = read_steps(run_dir) - steps_before
    checked = groups_check(run_dir, STEPS)
    if outcome is None:
        outcome = "recovered" if code == 0 and checked == "each group once" else "stopped"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    names_for_it = NAMED_AS.get(case, (pattern.removeprefix("ray::"),))
    names = any(name in line for line in stop_lines(log) for name in names_for_it) or (
        case in USER_STOPS and code is not None and code > 128
    )
    return Outcome(
        case=case, placement=placement, target=target, killed=killed, outcome=outcome, exit_code=code,
        restarts=restarts_of(cli_log),
        seconds_to_next_step=round(next_step_s, 1) if next_step_s is not None and killed else None,
        seconds_to_end=round(seconds, 1) if seconds is not None else None, steps_before_kill=steps_before,
        steps_after_kill=steps_after, steps_lost=steps_lost(run_dir, code) if killed else None,
        groups_check=checked, names_the_actor=bool(names),
        log_growth_bytes=(log_path.stat().st_size if log_path.exists() else 0) - log_before,
        processes_left=left, last_error=last_error(log),
    )  # fmt: skip


def markdown_table(result: dict) -> str:
    """The table of docs/results/faults.md: one row per case, a column per placement."""
    by_case: dict[str, dict[str, dict]] = {}
    for row in result["cases"]:
        by_case.setdefault(row["case"], {})[row["placement"]] = row
    placements = [p for p in RECIPES if any(p in cells for cells in by_case.values())]
    lines = [
        "| killed | " + " | ".join(placements) + " |",
        "|---|" + "---|" * len(placements),
    ]
    for case in CASES:
        if case not in by_case:
            continue
        cells = []
        for placement in placements:
            row = by_case[case].get(placement)
            if row is None:
                cells.append("not run")
                continue
            restarts = row.get("restarts", 0)
            how = f"after {restarts} restart{'s' if restarts != 1 else ''}" if restarts else "without a restart"
            if "restarts" not in row:  # measured before the matrix ran with automatic resume (8 steps, no restarts)
                named = "named" if row["names_the_actor"] else "not named"
                head = (
                    f"**{row['outcome']}** (earlier run: 8 steps, no `--max-restarts`) "
                    + (f"{row['seconds_to_end']} s after the kill" if row["outcome"] == "recovered"
                       else f"in {row['seconds_to_end']} s, exit {row['exit_code']}, {named}")
                )  # fmt: skip
            elif row["outcome"] == "recovered":
                head = (
                    f"**recovered** {how}: next step {row.get('seconds_to_next_step')} s after the kill, all "
                    f"{STEPS} steps {row['seconds_to_end']} s after it, {row.get('groups_check')}"
                )
            else:
                named = "named" if row["names_the_actor"] else "not named"
                head = f"**{row['outcome']}** {how} in {row['seconds_to_end']} s, exit {row['exit_code']}, {named}"
            cells.append(
                f"{head}; steps lost {row['steps_lost']}, log +{row['log_growth_bytes'] // 1000} kB, "
                f"{row['processes_left']} processes left"
            )
        lines.append(f"| {CASES[case][0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--placements", default="colocated,separate")
    parser.add_argument("--tiny-dir", type=Path, default=ROOT / ".areal" / "tiny")
    parser.add_argument("--max-restarts", type=int, default=2, help="the CLI's automatic resumes (0: none)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="print docs/results/faults.md's table from --out")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(args.out.read_text())))
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    previous = json.loads(args.out.read_text())["cases"] if args.out.exists() else []
    results = {(r["case"], r["placement"]): r for r in previous}
    for placement in args.placements.split(","):
        for case in cases:
            print(f"{case} ({placement}) ...", flush=True)
            outcome = run_case(case, placement, args.tiny_dir, args.max_restarts)
            print(
                f"  {outcome.outcome} in {outcome.seconds_to_end} s after {outcome.restarts} restarts, "
                f"exit {outcome.exit_code}, {outcome.groups_check}, "
                f"names it: {outcome.names_the_actor}, log +{outcome.log_growth_bytes} B, "
                f"left {outcome.processes_left}: "
                f"{outcome.last_error[:160]}",
                flush=True,
            )
            results[(case, placement)] = asdict(outcome)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps(
                    {
                        "machine": f"{os.cpu_count()} CPUs, no GPU",
                        "watchdog_s": WATCHDOG_S,
                        "steps": STEPS,
                        "max_restarts": args.max_restarts,
                        "cases": sorted(results.values(), key=lambda r: (r["placement"], list(CASES).index(r["case"]))),
                    },
                    indent=2,
                )
                + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
