"""Benchmark: one weight update of a 1.5B-shaped model through the transports verl's vllm rollout uses.

Random weights in the shapes of Qwen2.5-1.5B (no training, no engine), moved the way ``areal_async`` moves them:

- ``colocated``: verl's bucketed transport (``BucketedWeightSender`` -> ``BucketedWeightReceiver``; shared memory
  here, CUDA IPC on a GPU) from the trainer process to an engine process, with our per-tensor checksums on both
  sides (rollout/verl_vllm/), loaded bucket by bucket into the engine's preallocated weights (the GPU path) or
  gathered and loaded once (the CPU build's path);
- ``separate``: our ``areal_gloo`` broadcast (checksummed per tensor) from the trainer to the rollout pool's
  checkpoint-engine worker, which then hands the weights on through the colocated leg above (same node).

Per update it measures wall seconds, seconds inside the checksums, bytes through each copy (counted where the
bench hands tensors to verl's or our code), the engine process's peak memory above its loaded weights (how many
model copies it holds at once), and bytes written to disk by both processes (``/proc`` I/O counters).

Run: ``.venv/bin/python tools/bench_weight_transfer.py --repeats 3 --out docs/results/weight_transfer.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import socket
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import torch

# verl's vllm package checks the vllm distribution on import; on CPU our patch answers for vLLM's CPU build.
os.environ.setdefault("VERL_PLATFORM", "cpu")
import areal_plugins.verl_plugin  # noqa: F401  (applies the CPU-only patches, as in every verl process)

GIB = 2**30
#: Qwen2.5-1.5B: hidden 1536, 28 layers, 12 query and 2 key/value heads of 128, MLP 8960, vocabulary 151936, tied
#: embeddings (the trainer sends ``lm_head.weight`` too, as verl does for a tied model).
SHAPE = {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "head_dim": 128, "mlp": 8960, "vocab": 151936}


def qwen2_shapes(shape: dict[str, int] = SHAPE) -> list[tuple[str, tuple[int, ...]]]:
    h, kv = shape["hidden"], shape["kv_heads"] * shape["head_dim"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape["vocab"], h))]
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (shape["mlp"], h)),
            (p + "mlp.up_proj.weight", (shape["mlp"], h)),
            (p + "mlp.down_proj.weight", (h, shape["mlp"])),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (shape["vocab"], h))]
    return out


def random_weights(dtype: torch.dtype, seed: int, shape: dict[str, int]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.empty(size, dtype=dtype).normal_(generator=generator) for name, size in qwen2_shapes(shape)}


def disk_writes() -> int:
    return psutil.Process().io_counters().write_bytes


def receive_update(handle: str, mode: str, engine: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One update on the engine's side: verl's receiver, our checksum per tensor, the load."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    from areal_plugins.weight_sync.checksums import tensor_checksum

    process = psutil.Process()
    base_rss = process.memory_info().rss
    stats: dict[str, Any] = {"checksum_s": 0.0, "load_s": 0.0, "bytes_received": 0, "bytes_cloned": 0}
    stats.update(bytes_loaded=0, peak=0)
    gathered: list[tuple[str, torch.Tensor]] = []
    writes = disk_writes()

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        started = time.perf_counter()
        for name, tensor in weights:
            engine[name].copy_(tensor)
            stats["bytes_loaded"] += tensor.nbytes
        stats["load_s"] += time.perf_counter() - started

    def on_bucket(bucket: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        if mode == "cpu_build":  # the receiver reuses its buffer: copy out (rollout/verl_vllm/worker_extension.py)
            bucket = [(name, tensor.clone()) for name, tensor in bucket]
            stats["bytes_cloned"] += sum(t.nbytes for _, t in bucket)
        started = time.perf_counter()
        for _name, tensor in bucket:
            tensor_checksum(tensor)
            stats["bytes_received"] += tensor.nbytes
        stats["checksum_s"] += time.perf_counter() - started
        if mode == "cpu_build":
            gathered.extend(bucket)
        else:
            load(bucket)
        stats["peak"] = max(stats["peak"], process.memory_info().rss - base_rss)

    started = time.perf_counter()
    BucketedWeightReceiver(zmq_handle=handle, device=torch.device("cpu"), use_shm=True).receive_weights(on_bucket)
    if gathered:
        load(gathered)
        gathered.clear()
    stats["receive_and_load_s"] = time.perf_counter() - started
    stats["peak_rss_above_weights_gib"] = stats.pop("peak") / GIB
    stats["disk_bytes_written"] = disk_writes() - writes
    return stats


def engine_process(handle: str, mode: str, dtype: torch.dtype, shape: dict[str, int], ready, results) -> None:
    """The engine's side: its weights preallocated, then one update received per message on ``ready``."""
    torch.set_num_threads(1)
    engine = {name: torch.zeros(size, dtype=dtype) for name, size in qwen2_shapes(shape)}
    while ready.get() == "update":
        results.put(receive_update(handle, mode, engine))


def colocated_update(weights: dict[str, torch.Tensor], handle: str, bucket_mb: int) -> dict[str, Any]:
    """The trainer's side of one update: checksum each tensor as it leaves (our adapter), then verl's sender."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    from areal_plugins.weight_sync.checksums import tensor_checksum

    stats = {"sender_checksum_s": 0.0, "bytes_into_buckets": 0}

    def checksummed():
        for name, tensor in weights.items():
            started = time.perf_counter()
            tensor_checksum(tensor)
            stats["sender_checksum_s"] += time.perf_counter() - started
            stats["bytes_into_buckets"] += tensor.nbytes
            yield name, tensor

    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=True)
    asyncio.run(sender.async_send_weights(checksummed()))
    return stats


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gloo_receiver(port: int, bucket_bytes: int, dtype: torch.dtype, ready, results) -> None:
    """The rollout pool's checkpoint-engine worker: receives the broadcast (checksummed per tensor)."""
    from areal_plugins.weight_sync.gloo import _make_engine_class

    torch.set_num_threads(1)
    engine = _make_engine_class()(bucket_size=bucket_bytes)
    engine.init_process_group(rank=1, world_size=2, master={"host": "127.0.0.1", "port": port})
    process = psutil.Process()
    while ready.get() == "update":
        base_rss, peak, received = process.memory_info().rss, 0, 0
        writes = disk_writes()
        started = time.perf_counter()
        for _name, tensor in engine.receive_weights():
            received += tensor.nbytes
            peak = max(peak, process.memory_info().rss - base_rss)
            del tensor  # handed on to the colocated leg at once (measured separately)
        results.put(
            {
                "receive_s": time.perf_counter() - started,
                "bytes_received": received,
                "peak_rss_gib": peak / GIB,
                "disk_bytes_written": disk_writes() - writes,
            }
        )
    engine.finalize()


def timed_updates(ready, results, repeats: int, label: str, seconds_key: str, send) -> list[dict[str, Any]]:
    """``repeats`` updates: tell the receiving process to expect one, ``send(repeat)`` (the trainer's side, returning
    its own figures), then one row of the wall time, both sides' figures and the trainer's disk writes."""
    rows = []
    for repeat in range(repeats):
        ready.put("update")
        writes = disk_writes()
        started = time.perf_counter()
        sender = send(repeat)
        receiver = results.get(timeout=1800)
        seconds = time.perf_counter() - started
        rows.append(
            {
                "repeat": repeat,
                seconds_key: seconds,
                **sender,
                **receiver,
                "trainer_disk_bytes_written": disk_writes() - writes,
            }
        )
        print(f"  {label} #{repeat}: {seconds:.1f} s", flush=True)
    return rows


def measure_colocated(weights, dtype, shape, bucket_mb: int, mode: str, repeats: int) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    ready, results = context.Queue(), context.Queue()
    handle = f"ipc:///tmp/areal-bench-{uuid.uuid4().hex[:8]}.sock"
    engine = context.Process(target=engine_process, args=(handle, mode, dtype, shape, ready, results))
    engine.start()
    try:
        label = f"colocated/{mode}"
        return timed_updates(
            ready, results, repeats, label, "update_s", lambda _: colocated_update(weights, handle, bucket_mb)
        )
    finally:
        ready.put("stop")
        engine.join(timeout=120)


def measure_gloo(weights, dtype, bucket_mb: int, repeats: int) -> list[dict[str, Any]]:
    from areal_plugins.weight_sync.gloo import _make_engine_class

    context = multiprocessing.get_context("spawn")
    ready, results = context.Queue(), context.Queue()
    port, bucket_bytes = free_port(), bucket_mb << 20
    receiver = context.Process(target=gloo_receiver, args=(port, bucket_bytes, dtype, ready, results))
    receiver.start()
    engine = _make_engine_class()(bucket_size=bucket_bytes, is_master=True)
    engine.init_process_group(rank=0, world_size=2, master={"host": "127.0.0.1", "port": port})
    try:

        def broadcast(repeat: int) -> dict[str, Any]:
            asyncio.run(engine.send_weights(iter(weights.items()), global_steps=repeat))
            return {}

        return timed_updates(ready, results, repeats, "separate/broadcast", "broadcast_s", broadcast)
    finally:
        ready.put("stop")
        receiver.join(timeout=120)
        engine.finalize()


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if key != "repeat":
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bucket-mb", type=int, default=512, help="verl's update_weights_bucket_megabytes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/weight_transfer.json"))
    parser.add_argument("--layers", type=int, default=SHAPE["layers"], help="fewer for a quick check of the tool")
    parser.add_argument("--vocab", type=int, default=SHAPE["vocab"], help="smaller for a quick check of the tool")
    args = parser.parse_args()
    shape = {**SHAPE, "layers": args.layers, "vocab": args.vocab}
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    print(f"building random {args.dtype} weights of a Qwen2 of shape {shape} ...", flush=True)
    weights = random_weights(dtype, seed=0, shape=shape)
    model_bytes = sum(t.nbytes for t in weights.values())
    print(
        f"  {sum(t.numel() for t in weights.values()) / 1e9:.2f}B parameters, {model_bytes / GIB:.2f} GiB", flush=True
    )
    results = {
        "command": "tools/bench_weight_transfer.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": {
            "shape": shape,
            "dtype": args.dtype,
            "parameters": sum(t.numel() for t in weights.values()),
            "bytes": model_bytes,
            "tensors": len(weights),
        },
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
    }
    for mode in ("gpu_path", "cpu_build"):
        rows = measure_colocated(weights, dtype, shape, args.bucket_mb, mode, args.repeats)
        results[f"colocated_{mode}"] = {"rows": rows, "summary": summary(rows)}
    rows = measure_gloo(weights, dtype, args.bucket_mb, args.repeats)
    results["separate_broadcast"] = {"rows": rows, "summary": summary(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
