"""Benchmark: training throughput of four micro-batching strategies on long-tailed lengths.

What verl's FSDP engine does per micro-batch on this machine (``use_remove_padding=False``, the
CPU path) is pad it to its own longest sequence and run forward + backward; this times exactly that
on the tiny Qwen2 model, for the partitions each strategy produces of the same batches:

- ``fixed``: verl without ``use_dynamic_bsz``: consecutive chunks of ``micro_batch_size_per_gpu``;
- ``verl_dynamic``: verl's ``use_dynamic_bsz`` partitioner (``rearrange_micro_batches``) at the budget;
- ``ffd``: ours, ``areal.micro_batch.max_tokens`` (the paper's Algorithm 1) at the same budget, as run
  where the engine removes padding;
- ``padded_runs``: ours where verl pads (this path): runs of like length, the budget counted padded.

The fixed micro-batch size gives the same number of micro-batches verl's dynamic mode starts from
(``ceil(tokens / budget)``), so memory per micro-batch is comparable. Reported: effective tokens/s
(median and range over repeats), micro-batch counts and padding overhead (padded / real tokens).
With padding-free (varlen) attention on GPU the cost follows real tokens, not padded ones; this box
cannot time that path, so the padding ratio is the only figure here that speaks to it.

Run: ``.venv/bin/python tools/bench_microbatch.py --repeats 5 --out runs/bench_microbatch.json  (~5 min on 2 cores)``
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from areal_plugins.core.microbatch import ffd_allocate, padded_allocate
from areal_plugins.tiny.model import TinyModelSpec, random_qwen2


def long_tailed_lengths(count: int, rng: random.Random, median: int, cap: int) -> list[int]:
    """Prompt + response lengths: lognormal (σ = 1) around ``median``, cut at ``cap``."""
    return [max(8, min(cap, int(rng.lognormvariate(0, 1.0) * median))) for _ in range(count)]


def partition(strategy: str, lengths: list[int], budget: int) -> list[list[int]]:
    count = math.ceil(sum(lengths) / budget)
    if strategy == "fixed":
        size = math.ceil(len(lengths) / count)
        return [list(range(start, min(start + size, len(lengths)))) for start in range(0, len(lengths), size)]
    if strategy == "ffd":
        return ffd_allocate(lengths, budget)
    if strategy == "padded_runs":
        return padded_allocate(lengths, budget)
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    batch = TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, batch_size=[len(lengths)])
    return rearrange_micro_batches(batch, max_token_len=budget)[1]


def train_step(model, optimizer, lengths: list[int], groups: list[list[int]], rng: torch.Generator) -> None:
    """Forward + backward of every micro-batch padded to its longest sequence, then one optimizer step."""
    optimizer.zero_grad()
    total = sum(lengths)
    for group in groups:
        width = max(lengths[i] for i in group)
        ids = torch.randint(1, 16000, (len(group), width), generator=rng)
        mask = torch.tensor([[1] * lengths[i] + [0] * (width - lengths[i]) for i in group])
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / total  # the global token mean, as verl's engine weights it
        loss.backward()
    optimizer.step()


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    model = random_qwen2(TinyModelSpec(seed=0), vocab_size=16448)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    strategies = ("fixed", "verl_dynamic", "ffd", "padded_runs")
    results: dict[str, dict] = {s: {"tokens_per_s": [], "micro_batches": [], "padding_ratio": []} for s in strategies}
    for repeat in range(args.repeats):
        rng = random.Random(repeat)
        batches = [long_tailed_lengths(args.batch, rng, args.median, args.max_len) for _ in range(args.batches)]
        order = list(strategies)
        rng.shuffle(order)  # no strategy always runs first (warm caches, thermal drift)
        for strategy in order:
            groups_per_batch = [partition(strategy, lengths, args.budget) for lengths in batches]
            generator = torch.Generator().manual_seed(repeat)
            started = time.perf_counter()
            for lengths, groups in zip(batches, groups_per_batch, strict=True):
                train_step(model, optimizer, lengths, groups, generator)
            elapsed = time.perf_counter() - started
            real = sum(sum(lengths) for lengths in batches)
            padded = sum(
                len(g) * max(lengths[i] for i in g)
                for lengths, groups in zip(batches, groups_per_batch, strict=True)
                for g in groups
            )
            row = results[strategy]
            row["tokens_per_s"].append(real / elapsed)
            row["micro_batches"].append(statistics.mean(len(g) for g in groups_per_batch))
            row["padding_ratio"].append(padded / real)
            print(
                f"repeat {repeat + 1}/{args.repeats} {strategy:>12}: {real / elapsed:8.0f} tok/s, "
                f"{row['micro_batches'][-1]:.1f} micro-batches, padding x{padded / real:.2f}",
                flush=True,
            )
    summary = {
        strategy: {
            "tokens_per_s_median": statistics.median(row["tokens_per_s"]),
            "tokens_per_s_min": min(row["tokens_per_s"]),
            "tokens_per_s_max": max(row["tokens_per_s"]),
            "micro_batches_mean": statistics.mean(row["micro_batches"]),
            "padding_ratio_median": statistics.median(row["padding_ratio"]),
            "runs": row,
        }
        for strategy, row in results.items()
    }
    base = summary["verl_dynamic"]["tokens_per_s_median"]
    for row in summary.values():
        row["vs_verl_dynamic"] = row["tokens_per_s_median"] / base
    return {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "settings": vars(args),
        "strategies": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences per training batch")
    parser.add_argument("--batches", type=int, default=1, help="training batches per timed run")
    parser.add_argument("--median", type=int, default=96, help="median sequence length")
    parser.add_argument("--max-len", type=int, default=1024, help="longest sequence")
    parser.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch (dynamic and ffd)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_microbatch.json"))
    args = parser.parse_args()
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    for name, row in report["strategies"].items():
        print(
            f"{name:>12}: {row['tokens_per_s_median']:8.0f} tok/s "
            f"({row['tokens_per_s_min']:.0f}-{row['tokens_per_s_max']:.0f}), x{row['vs_verl_dynamic']:.2f} "
            f"vs verl dynamic, {row['micro_batches_mean']:.1f} micro-batches, "
            f"padding x{row['padding_ratio_median']:.2f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
