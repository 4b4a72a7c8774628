"""What a run's schedule record costs on disk, per 1,000 trained trajectories.

Reads ``areal_samples.jsonl`` and ``areal_submissions.jsonl`` of each run directory given and prints, per 1,000
trajectories: the whole of ``areal_samples.jsonl``; the part of it that is the schedule (``chunks`` and the two
token digests, serialized alone); and ``areal_submissions.jsonl``. docs/reference/run_records.md quotes it.

Run: ``.venv/bin/python tools/record_size.py RUN_DIR [RUN_DIR ...]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SCHEDULE_FIELDS = ("chunks", "prompt_digest", "response_digest")


def record_size(run_dir: Path) -> dict[str, float]:
    samples_path = run_dir / "areal_samples.jsonl"
    lines = [line for line in samples_path.read_text().splitlines() if line]
    if not lines:
        raise SystemExit(f"{samples_path} holds no trained trajectory")
    samples = [json.loads(line) for line in lines]
    missing = [name for name in SCHEDULE_FIELDS if name not in samples[0]]
    if missing:
        raise SystemExit(f"{samples_path} has no {missing}: the run predates the schedule record")
    schedule = sum(len(json.dumps({name: s[name] for name in SCHEDULE_FIELDS})) + 1 for s in samples)
    submissions = run_dir / "areal_submissions.jsonl"
    per_1k = 1000 / len(samples)
    return {
        "trajectories": len(samples),
        "requests_per_trajectory": sum(len(s["chunks"]) for s in samples) / len(samples),
        "samples_kb_per_1k": samples_path.stat().st_size * per_1k / 1024,
        "schedule_kb_per_1k": schedule * per_1k / 1024,
        "submissions_kb_per_1k": (submissions.stat().st_size if submissions.exists() else 0) * per_1k / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    columns = ("run", "trajectories", "requests per trajectory", "areal_samples.jsonl", "of it, the schedule")
    print("| " + " | ".join([*columns, "areal_submissions.jsonl"]) + " |")
    print("|---|---|---|---|---|---|")
    for run_dir in args.run_dirs:
        size = record_size(run_dir)
        print(
            f"| `{run_dir.name}` | {size['trajectories']} | {size['requests_per_trajectory']:.2f} | "
            f"{size['samples_kb_per_1k']:.0f} KiB per 1k | {size['schedule_kb_per_1k']:.0f} KiB per 1k | "
            f"{size['submissions_kb_per_1k']:.0f} KiB per 1k |"
        )


if __name__ == "__main__":
    main()
