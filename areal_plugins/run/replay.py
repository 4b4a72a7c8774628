"""``areal-plugins replay RUN_DIR``: run a recorded asynchronous run again by its record, and say where it differs.

Runs ``areal-plugins train`` with the recorded run's recipe and overrides (``run_args.json``) plus
``areal.replay.run_dir`` (the trainer then follows the record: trainers/replay_driver.py), into a run directory of
its own. The trainer stops at the first difference and writes it to ``areal_replay.jsonl``; after a replay that
ran to its end, the two runs' records are compared once more, whole (run/compare.py). docs/replay.md.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from areal_plugins.run.compare import compare_runs, read_samples
from areal_plugins.run.launch import RUN_ARGS_FILE, train
from areal_plugins.run.records import read_jsonl

logger = logging.getLogger(__name__)

MATCHED, DIVERGED = 0, 1


def replay(run_dir: Path, out: Path | None, until: int | None, overrides: list[str]) -> int:
    """Replay ``run_dir`` into ``out`` up to step ``until`` (default: every recorded step) with ``overrides`` added
    (a changed setting); 0 when the replay matched the record, 1 when it left it, else verl's exit code."""
    run_dir = run_dir.resolve()
    args_path = run_dir / RUN_ARGS_FILE
    if not args_path.is_file():
        raise SystemExit(f"{args_path} is missing: replay needs a run directory written by areal-plugins train")
    recorded = json.loads(args_path.read_text())
    steps = len(read_samples(run_dir / "areal_samples.jsonl"))
    until = steps if until is None else until
    if not 1 <= until <= steps:
        raise SystemExit(f"--until {until}: the record holds steps 1-{steps}")
    out = (out or run_dir.parent / f"{run_dir.name}-replay").resolve()
    if (out / "areal_samples.jsonl").exists():
        raise SystemExit(f"{out} already holds a run: pass another --out")
    tiny_dir = Path(recorded["tiny_dir"]) if recorded.get("tiny_dir") else None
    started = time.monotonic()
    code = train(
        Path(recorded["recipe"]),
        [
            *recorded["overrides"],
            f"areal.replay.run_dir={run_dir}",
            f"trainer.total_training_steps={until}",
            "trainer.resume_mode=disable",
            *overrides,
        ],
        out,
        tiny_dir,
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
