"""Benchmark: vLLM-CPU generation throughput under periodic weight updates, interruptible vs waiting.

A real vLLM server (``areal_vllm``'s :class:`VLLMRolloutServer`) is kept loaded with ``--slots``
requests of long-tailed length; every ``--update-every`` seconds new weights are loaded:

- ``interrupt``: abort in-flight requests (they return their partial output), load, resume; each cut
  request continues as prompt + partial output with its remaining budget (AReaL);
- ``wait``: stop submitting, wait until in-flight requests finish, load, resume (the longest request
  holds every slot idle).

Reported: generated tokens per second over ``--duration`` seconds, median and range over repeats (the
paper saw +12% to +17% for interruption on GPUs).

Run: ``.venv/bin/python tools/bench_vllm_interrupt.py --repeats 3 --out runs/bench_vllm_interrupt.json`` (~6 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from areal_plugins.rollout.vllm.server import VLLMRolloutServer

PARAMS = {"temperature": 1.0, "logprobs": True}


def random_model(tiny_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from areal_plugins.tiny.model import TinyModelSpec, random_qwen2

    out = Path(tempfile.mkdtemp(prefix="bench_vllm_model_"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_dir / "model" / name, out / name)
    model = random_qwen2(TinyModelSpec(seed=3), vocab_size=16448)
    model.save_pretrained(out, safe_serialization=True)
    return out, model.state_dict()


async def trial(server: VLLMRolloutServer, interrupt: bool, args: argparse.Namespace, seed: int, weights) -> float:
    rng = random.Random(seed)
    generated = 0
    stop_at = time.monotonic() + args.duration
    submitting = asyncio.Event()
    submitting.set()

    async def worker(slot: int) -> None:
        nonlocal generated
        while time.monotonic() < stop_at:
            await submitting.wait()
            budget = max(1, min(args.max_len, int(rng.lognormvariate(0, 1.0) * args.median)))
            prompt = [1 + (slot * 31 + j * 7 + seed) % 900 for j in range(16)]
            tokens: list[int] = []
            while len(tokens) < budget and time.monotonic() < stop_at:
                out = await server.generate(prompt + tokens, {**PARAMS, "max_tokens": budget - len(tokens)}, "b")
                tokens += out.token_ids
                generated += len(out.token_ids)
                if out.stop_reason != "aborted":
                    break
                await submitting.wait()  # the update is under way: continue after it

    async def updater() -> None:
        version = server.version
        while time.monotonic() + args.update_every < stop_at:
            await asyncio.sleep(args.update_every)
            version += 1
            submitting.clear()
            if interrupt:
                await server.abort_all_requests()
            else:
                await server.wait_for_requests_to_drain()
                await server.abort_all_requests()  # nothing left in flight: only closes the gate
            await server.update_weights(weights, version)
            await server.resume_generation()
            submitting.set()

    started = time.monotonic()
    await asyncio.gather(updater(), *(worker(slot) for slot in range(args.slots)))
    return generated / (time.monotonic() - started)


async def run(args: argparse.Namespace) -> dict:
    model_dir, weights = random_model(Path(args.tiny_dir))
    server = VLLMRolloutServer(
        str(model_dir),
        response_length=args.max_len,
        max_model_len=args.max_len + 32,
        max_batch_size=args.slots,
        num_threads=2,
        seed=0,
        log_dir=str(Path(args.out).parent),
    )
    rows: dict[str, list[float]] = {"interrupt": [], "wait": []}
    try:
        await trial(server, True, argparse.Namespace(**{**vars(args), "duration": 10.0}), 99, weights)  # warm-up
        for repeat in range(args.repeats):
            order = ["interrupt", "wait"] if repeat % 2 == 0 else ["wait", "interrupt"]
            for mode in order:
                rate = await trial(server, mode == "interrupt", args, repeat, weights)
                rows[mode].append(rate)
                print(f"repeat {repeat + 1}/{args.repeats} {mode:>9}: {rate:.0f} tokens/s", flush=True)
    finally:
        await server.shutdown()
    summary = {
        m: {"tokens_per_s_median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
        for m, v in rows.items()
    }
    gain = summary["interrupt"]["tokens_per_s_median"] / summary["wait"]["tokens_per_s_median"] - 1
    return {
        "machine": f"{platform.machine()}, vllm-cpu 0.32 server, 2 threads",
        "settings": vars(args),
        "modes": summary,
        "interrupt_gain": gain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=16, help="requests kept in flight")
    parser.add_argument("--median", type=int, default=48, help="median response length")
    parser.add_argument("--max-len", type=int, default=256, help="longest response")
    parser.add_argument("--update-every", type=float, default=3.0, help="seconds between weight updates")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny-dir", default=".areal/tiny")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_vllm_interrupt.json"))
    args = parser.parse_args()
    report = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    for mode, row in report["modes"].items():
        print(f"{mode:>9}: {row['tokens_per_s_median']:.0f} tokens/s ({row['min']:.0f}-{row['max']:.0f})")
    print(f"interruption: {100 * report['interrupt_gain']:+.1f}% tokens/s; wrote {args.out}")


if __name__ == "__main__":
    main()
