"""Resuming with the requests in flight kept: peak memory and time, before and after the kept outputs were read per
worker (issue 47, item 4; docs/results/resume_partials.md).

It writes a synthetic checkpoint through the real writer (``write_partials``): ``--requests`` answers in flight of
``--tokens`` tokens each (random token ids, full-precision log-probs, versions and chunks as the client keeps them),
spread over ``--workers`` agent-loop workers' files. Then, each in a process of its own whose resident memory is
sampled with psutil every 10 ms (its peak is reported; not the kernel's ``ru_maxrss``, which a child starts with the
parent's at the fork):

- ``before``: what the ``ResumedPartials`` actor did at startup (as at 2746ace): every worker's file read whole and
  parsed into one dict, then each answer taken from it once;
- ``after``: what one agent-loop worker does now (``KeptOutputs``): every index it sees read, then the answers it
  continues read one line each and turned into the client's ``PartialOutput`` (``take_resumed``), its share of them
  (1 / ``--workers``, what verl's chunking sends it), and, as a worst case, all of them (one worker);
- ``snapshot-before`` / ``snapshot-after``: a checkpoint's copy of one worker's answers in flight (half finished,
  kept as packed arrays, half still generating, as lists): as at 2746ace (one synchronous copy converting every
  array to a list) against now (``snapshot_in_flight``: block copies, the event loop free between batches); the
  number is the longest time the worker's event loop did not run.

Runs are interleaved within each repeat; the table gives the median and the spread (min-max) over repeats.

    .venv/bin/python tools/bench_resume_partials.py --requests 41000 --tokens 2048 --repeats 3 \\
        --out docs/results/resume_partials.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Seconds between two samples of a measured process's resident memory.
SAMPLE_S = 0.01
#: Token ids are drawn below this (Qwen2.5's vocabulary: 151,646 entries).
VOCAB = 151_646


# ---------------------------------------------------------------------------------------------- the checkpoint


def synthetic_answer(rng: Any, uid: str, session: int, tokens: int, finished: bool) -> dict[str, Any]:
    """One kept answer as the client's snapshot has it: tokens in two requests (one interruption), version 3 then 4."""
    from areal_plugins.core.trajectory_rows import token_digest

    cut = tokens // 2
    return {
        "uid": uid,
        "session": session,
        "prompt_digest": token_digest([session, 7, 11]),
        "tokens": rng.integers(0, VOCAB, tokens).tolist(),
        "log_probs": (-rng.exponential(1.0, tokens)).tolist(),
        "versions": [3] * cut + [4] * (tokens - cut),
        "chunks": [[0, 3, 12345], [cut, 4, 67890]],
        "interrupts": 1,
        "stop_reason": "stop" if finished else None,
    }


def write_checkpoint(folder: Path, requests: int, tokens: int, workers: int, seed: int = 0) -> dict[str, Any]:
    """The synthetic checkpoint, through the run's own writer: one file (and index) per worker."""
    import numpy as np

    from areal_plugins.agent_loop.partial_outputs import write_partials

    rng = np.random.default_rng(seed)
    started = time.monotonic()
    counts = {"requests": 0, "tokens": 0}
    for worker in range(workers):
        mine = range(worker, requests, workers)
        partials = [synthetic_answer(rng, f"uid-{i // 16:06d}", i % 16, tokens, i % 2 == 0) for i in mine]
        written = write_partials(str(folder), worker, partials)
        counts = {key: counts[key] + written[key] for key in counts}
        del partials
    size = sum(path.stat().st_size for path in (folder / "areal_partials").iterdir())
    return counts | {"bytes": size, "write_s": time.monotonic() - started}


# ---------------------------------------------------------------------------------------------- what is measured


def before_resume(folder: str) -> dict[str, Any]:
    """The actor's startup as at 2746ace (``ResumedPartials.__init__``), then every answer taken from it once."""
    from areal_plugins.agent_loop.partial_outputs import read_partials

    started, cpu = time.monotonic(), time.process_time()
    partials = read_partials(folder) or []
    kept = {(p["uid"], int(p["session"])): p for p in partials}
    saved = {"requests": len(partials), "tokens": sum(len(p["tokens"]) for p in partials)}
    del partials
    loaded, loaded_cpu = time.monotonic(), time.process_time()
    taken = 0
    for key in list(kept):
        taken += len(kept.pop(key)["tokens"])
    return {"load_s": loaded - started, "load_cpu_s": loaded_cpu - cpu, "take_s": time.monotonic() - loaded,
            "take_cpu_s": time.process_time() - loaded_cpu, "taken_tokens": taken, "saved": saved}  # fmt: skip


def after_resume(folder: str, share: int, workers: int) -> dict[str, Any]:
    """One worker now: its view of the indexes, then the answers it continues (every ``workers``-th, or all with
    ``share`` 0) read one line each, made the client's ``PartialOutput`` and dropped."""
    from areal_plugins.agent_loop import partial_outputs
    from areal_plugins.agent_loop.partial_outputs import KeptOutputs, take_resumed

    started, cpu = time.monotonic(), time.process_time()
    kept = KeptOutputs(folder)
    partial_outputs._KEPT["kept"] = kept
    loaded, loaded_cpu = time.monotonic(), time.process_time()
    keys = sorted(kept.entries)
    mine = keys if share == 0 else keys[share - 1 :: workers]
    digests = {key: kept.entries[key][3] for key in mine}

    async def take_all() -> int:
        taken = 0
        for uid, session in mine:
            # take_resumed digests the prompt ids; the synthetic prompt is the one the digest was made of
            found = await take_resumed(uid, session, [session, 7, 11])
            assert found is not None and digests[(uid, session)]
            taken += len(found.tokens)
        return taken

    taken = asyncio.run(take_all())
    return {"index_s": loaded - started, "index_cpu_s": loaded_cpu - cpu, "take_s": time.monotonic() - loaded,
            "take_cpu_s": time.process_time() - loaded_cpu, "taken_tokens": taken, "answers": len(mine),
            "indexed": len(keys)}  # fmt: skip


def in_flight(answers: int, tokens: int, seed: int = 1) -> None:
    """One worker's :data:`IN_FLIGHT`: half its answers finished (packed arrays, ``compact``), half generating."""
    import numpy as np

    from areal_plugins.agent_loop.partial_outputs import IN_FLIGHT, PartialOutput, compact

    rng = np.random.default_rng(seed)
    IN_FLIGHT.clear()
    for i in range(answers):
        raw = synthetic_answer(rng, f"uid-{i // 16:06d}", i % 16, tokens, i % 2 == 0)
        partial = PartialOutput(raw["prompt_digest"], raw["tokens"], raw["log_probs"], raw["versions"], raw["chunks"])
        partial.interrupts, partial.stop_reason = 1, raw["stop_reason"]
        if partial.stop_reason is not None:
            compact(partial)
        IN_FLIGHT.setdefault(raw["uid"], {})[raw["session"]] = partial


def snapshot_before() -> list[dict[str, Any]]:
    """``snapshot_in_flight`` as at 2746ace: one synchronous copy, every number a list element."""
    from areal_plugins.agent_loop.partial_outputs import IN_FLIGHT

    return [
        {
            "uid": uid,
            "session": session,
            "prompt_digest": partial.prompt_digest,
            "tokens": list(partial.tokens),
            "log_probs": list(partial.log_probs),
            "versions": list(partial.versions),
            "chunks": [list(chunk) for chunk in partial.chunks],
            "interrupts": partial.interrupts,
            "stop_reason": partial.stop_reason,
        }
        for uid, answers in IN_FLIGHT.items()
        for session, partial in answers.items()
        if partial.tokens or partial.stop_reason is not None
    ]


def measure_snapshot(which: str, answers: int, tokens: int) -> dict[str, Any]:
    """The longest time the event loop did not run while a checkpoint copied ``answers`` answers."""
    from areal_plugins.agent_loop.partial_outputs import snapshot_in_flight

    in_flight(answers, tokens)

    async def go() -> dict[str, Any]:
        gaps: list[float] = []  # wall time between two turns of the loop
        cpu_gaps: list[float] = []  # this process's CPU time between them: what the copy itself took, however busy
        done = asyncio.Event()

        async def ticker() -> None:
            last, last_cpu = time.perf_counter(), time.process_time()
            while not done.is_set():
                await asyncio.sleep(0)
                now, now_cpu = time.perf_counter(), time.process_time()
                gaps.append(now - last)
                cpu_gaps.append(now_cpu - last_cpu)
                last, last_cpu = now, now_cpu

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        started = time.perf_counter()
        if which == "before":
            copies = snapshot_before()
        else:
            copies = await snapshot_in_flight()
        took = time.perf_counter() - started
        done.set()
        await tick
        return {"snapshot_s": took, "longest_loop_stall_s": max(gaps), "longest_loop_stall_cpu_s": max(cpu_gaps),
                "answers": len(copies)}  # fmt: skip

    return asyncio.run(go())


def child(args: argparse.Namespace) -> None:
    """One measured run, in this process; its numbers as one JSON line on stdout."""
    if args.child == "before":
        result = before_resume(args.folder)
    elif args.child == "after":
        result = after_resume(args.folder, share=1, workers=args.workers)
    elif args.child == "after-all":
        result = after_resume(args.folder, share=0, workers=args.workers)
    else:
        result = measure_snapshot(args.child.removeprefix("snapshot-"), args.requests // args.workers, args.tokens)
    print(json.dumps(result), flush=True)


def measured(kind: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Run ``kind`` in a child process and sample its resident memory with psutil until it ends."""
    import psutil

    command = [sys.executable, __file__, "--child", kind, "--folder", str(folder), "--requests", str(args.requests),
               "--tokens", str(args.tokens), "--workers", str(args.workers)]  # fmt: skip
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
    watched = psutil.Process(process.pid)
    peak = [0]

    def sample() -> None:
        while process.poll() is None:
            try:
                peak[0] = max(peak[0], watched.memory_info().rss)
            except psutil.NoSuchProcess:
                return
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"{kind} failed (exit code {process.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    return result | {"peak_rss_mib": peak[0] / 2**20, "wall_s": time.monotonic() - started}


def summary(runs: list[dict[str, Any]], key: str) -> str:
    values = [run[key] for run in runs]
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=41_000)
    parser.add_argument("--tokens", type=int, default=2_048)
    parser.add_argument("--workers", type=int, default=8, help="agent-loop workers (verl's agent.num_workers)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="before,after,after-all,snapshot-before,snapshot-after")
    parser.add_argument(
        "--folder", type=Path, help="the checkpoint folder, kept and reused if it has one (default: temporary)"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    import shutil

    import psutil

    folder = args.folder or Path(tempfile.mkdtemp(prefix="areal-resume-bench-"))
    try:
        if (folder / "areal_partials").is_dir():  # --folder of an earlier run: its checkpoint is reused
            from areal_plugins.agent_loop.partial_outputs import KeptOutputs

            files = KeptOutputs(folder).files.values()
            checkpoint = {key: sum(f[key] for f in files) for key in ("requests", "tokens")}
            checkpoint["bytes"] = sum(path.stat().st_size for path in (folder / "areal_partials").iterdir())
        else:
            checkpoint = write_checkpoint(folder, args.requests, args.tokens, args.workers)
        print(f"checkpoint: {checkpoint}", flush=True)
        kinds = args.kinds.split(",")
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        for repeat in range(args.repeats):
            for kind in kinds:  # interleaved within each repeat
                runs[kind].append(measured(kind, args, folder))
                print(f"repeat {repeat + 1} {kind}: {json.dumps(runs[kind][-1])}", flush=True)
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    for kind, results in runs.items():
        keys = [key for key in results[0] if isinstance(results[0][key], float)]
        print(f"{kind:16s} " + "  ".join(f"{key} {summary(results, key)}" for key in keys))
    if args.out:
        machine = {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                   "python": platform.python_version(), "platform": platform.platform(),
                   "load_average_at_end": os.getloadavg()}  # fmt: skip
        settings = {key: getattr(args, key) for key in ("requests", "tokens", "workers", "repeats")}
        when = time.strftime("%Y-%m-%d %H:%M")
        result = {"settings": settings, "checkpoint": checkpoint, "machine": machine, "when": when, "runs": runs}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
