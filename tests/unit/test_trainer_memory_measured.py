"""The trainer's memory estimate held against a measured peak: one real FSDP2 training step on the CPU.

Two processes (``torch.multiprocessing`` spawn, gloo) shard a Qwen2 of 40.9M parameters built in code as verl's
FSDP2 engine does (``apply_fsdp2``: each decoder layer, the embedding and the head a unit of their own, then the
root; fp32 parameters, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``reshard_after_forward``),
and train it as verl's ``FSDPEngine`` does on a machine without flash-attention: two micro-batches of 1,024 tokens
each (``loss / 2`` backward, gradients accumulated), the log-probs of verl's ``logprobs_from_logits_v2`` (bf16
logits: one row's ``log_softmax`` at a time), ``clip_grad_norm_``, ``AdamW``. The peak a step adds is the kernel's
resident high-water mark (``VmHWM`` after ``/proc/self/clear_refs``) over the process once it has run a warm-up step
(which creates Adam's state and the kernels' one-time buffers), with glibc's mmap threshold pinned at 16 KiB so a
freed tensor goes back to the kernel at once (without it glibc keeps freed chunks below its dynamic threshold, up to
32 MiB, and the RSS counts memory the step no longer holds: the CPU's counterpart of the CUDA caching allocator's
reserved memory; docs/guides/sizing.md gives both).

Which terms apply on the CPU: all of ``update_peak`` (parameters, gradients, Adam, the gathered FSDP unit, the
activations, the logits): gloo all-gathers the bf16 unit and reduce-scatters the fp32 gradient as NCCL does. Not on
the CPU: the CUDA context, NCCL's buffers (``cluster_fit``'s ~2 GiB, not part of ``trainer_memory``) and the
weight sync's terms (no sync in a training step). The CPU adds one term of its own: gloo stages a copy of each
collective's buffer, which NCCL does not (measured here on the head's reduce-scatter and all-gather). The state is
resident before the measured step, so the step adds ``update_peak - parameters - optimizer`` = gradients + unit +
activations + logits, + gloo's copy.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from areal_plugins.planning.hardware import ModelShape
from areal_plugins.planning.trainer_memory import TrainerSetup, trainer_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists("/proc/self/clear_refs"),
    reason="measures with Linux's /proc/self/clear_refs and glibc's mallopt",
)

#: A layer: q, o 2 x 512 x 512 + k, v 2 x 512 x 128 + MLP 3 x 512 x 1536 = 3,014,656; 8 layers 24,117,248 + the
#: embedding and the untied head 2 x 16,384 x 512 = 16,777,216: P = 40,894,464 (the model adds 6,144 biases and
#: 8,704 norm weights: 40,909,312). fp32 state 16 x P = 654 MB against ~370 MB of imports: the state dominates.
SHAPE = ModelShape("measured-qwen2", hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, vocab=16384)
WORLD = 2
TOKENS = 1024  # a micro-batch on each rank
MICRO_BATCHES = 2
WARMUP_TOKENS = 32
#: glibc's mallopt parameter numbers (malloc.h).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 16 << 10
#: How far above the measured peak the estimate may be. The estimate adds the logits' 4·T·V and the gathered unit's
#: 8·V·h, which the backward holds at different moments (the logits' gradient is freed before the head's
#: reduce-scatter): by design up to min(4·T·V, 8·V·h) = 67 MB high here, 30% of the checkpointed step's 227 MB.
UPPER_FACTOR = 1.35


def _kib_field(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(field + r":\s+(\d+) kB", status.read()).group(1)) * 1024  # type: ignore[union-attr]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # proc(5): "reset the peak resident set size" (Linux 4.0)


def _max_mmapped(libc: ctypes.CDLL) -> int:
    """glibc's high-water mark of mmapped bytes (``malloc_stats``' "max mmap bytes"): every tensor of 16 KiB or more."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            libc.malloc_stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        text = sink.read().decode()
    return int(re.search(r"max mmap bytes\s*=\s*(\d+)", text).group(1))  # type: ignore[union-attr]


def _train(rank: int, port: int, out: str, pin_mmap_threshold: bool) -> None:
    """One rank: build, shard, warm up, then measure a step without and a step with gradient checkpointing."""
    libc = ctypes.CDLL("libc.so.6")
    if pin_mmap_threshold:  # fixes the threshold (no dynamic raise): a freed tensor goes back to the kernel
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    def trim() -> int:
        gc.collect()
        libc.malloc_trim(0)
        return _kib_field("VmRSS")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        config = Qwen2Config(
            hidden_size=SHAPE.hidden, intermediate_size=SHAPE.intermediate, num_hidden_layers=SHAPE.layers,
            num_attention_heads=SHAPE.heads, num_key_value_heads=SHAPE.kv_heads, vocab_size=SHAPE.vocab,
            max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
        # verl's FSDPEngine: fp32 parameters (model_dtype), bf16 compute, fp32 reduce; apply_fsdp2's units
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
        shard = {"mesh": init_device_mesh("cpu", (WORLD,)), "mp_policy": policy, "reshard_after_forward": True}
        for name, module in model.named_modules():
            if isinstance(module, Qwen2DecoderLayer) or name.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head"):
                fully_shard(module, **shard)
        fully_shard(model, **shard)
        before_parameters = trim()
        model.to_empty(device="cpu")  # each rank allocates its shards only
        torch.manual_seed(0)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.to_local().normal_(0, 0.02)
        model.model.rotary_emb.__init__(config)  # its inv_freq buffer, left on the meta device
        parameters = trim() - before_parameters
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
        generator = torch.Generator().manual_seed(rank)

        def loss_of(ids: torch.Tensor) -> torch.Tensor:
            # verl's FSDPEngine with use_remove_padding at temperature 1: logits_rmpad = output.logits.squeeze(0),
            # then logprobs_from_logits_v2 (bf16: a row's log_softmax at a time) with flash-attention absent
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0)).logits.squeeze(0)
            labels = torch.roll(ids.squeeze(0), -1)
            rows = [
                torch.log_softmax(row, -1).gather(-1, label.view(1)).squeeze(-1)
                for row, label in zip(logits, labels, strict=True)
            ]
            return -torch.stack(rows).float().mean()

        def step(tokens: int, micro_batches: int) -> None:
            for _ in range(micro_batches):
                loss = loss_of(torch.randint(0, SHAPE.vocab, (1, tokens), generator=generator))
                (loss / micro_batches).backward()
                del loss
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step(WARMUP_TOKENS, 1)
        result: dict[str, object] = {"parameters_rss": parameters, "numel": sum(p.numel() for p in model.parameters())}

        def added(run) -> int:
            """What ``run`` adds to the RSS at its peak, over the process as it stands."""
            base = trim()
            _reset_peak()
            run()
            return _kib_field("VmHWM") - base

        # gloo's own staging, which NCCL does not make: each collective of the largest unit (the head) alone, as
        # FSDP2 calls it; measured on a second call, as the warm-up step made the first of these sizes
        unit = SHAPE.vocab * SHAPE.hidden
        result["gloo_reduce_scatter"] = _second_call_adds(
            added, dist.reduce_scatter_single, torch.empty(unit // WORLD), torch.zeros(unit)
        )
        result["gloo_all_gather"] = _second_call_adds(
            added,
            dist.all_gather_single,
            torch.empty(unit, dtype=torch.bfloat16),
            torch.zeros(unit // WORLD, dtype=torch.bfloat16),
        )
        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base_mmapped = _mmapped_now(libc)
            result[f"checkpointing={checkpointing}"] = {"rss_added": added(lambda: step(TOKENS, MICRO_BATCHES))}
            if not checkpointing:  # glibc's high-water mark is the process's: only the larger step's is this step's
                result["tensors_added"] = _max_mmapped(libc) - base_mmapped
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _second_call_adds(added, collective, output, source) -> int:
    collective(output, source)
    return added(lambda: collective(output, source))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def _mmapped_now(libc: ctypes.CDLL) -> int:
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().hblkhd)


def measure(out: Path, pin_mmap_threshold: bool = True) -> list[dict]:
    """Run the two ranks; each rank's measurements (bytes), as ``_train`` writes them. ``pin_mmap_threshold=False``:
    glibc's default allocator, which keeps freed chunks (docs/guides/sizing.md gives both)."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_train, args=(port, str(out), pin_mmap_threshold), nprocs=WORLD, start_method="spawn")
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    return measure(tmp_path_factory.mktemp("trainer_memory_measured"))


def estimate(gradient_checkpointing: bool):
    return trainer_memory(SHAPE, TrainerSetup(shard_gpus=WORLD, param_bytes=4, micro_batch_tokens=TOKENS,
                                              gradient_checkpointing=gradient_checkpointing))  # fmt: skip


def test_the_estimate_for_this_shape_by_hand():
    """Over S = 2: gradients 4 x P / 2 = 81,788,928; the gathered unit, the head (16,384 x 512 = 8,388,608, larger
    than a layer's 3,014,656) x 8 = 67,108,864; logits 1,024 x 16,384 x 4 = 67,108,864; activations, a layer
    20·512 + 8·1536 + 4·2·64 + 4·8 + 8 = 23,080 bytes a token: without checkpointing 1,024 x (8 x 23,080 + 8·512)
    = 193,265,664, with it 1,024 x (8 x 2·512 + 23,080 + 8·512) = 36,216,832."""
    assert SHAPE.params == 40_894_464
    for checkpointing, total in ((False, 409_272_320), (True, 252_223_488)):
        memory = estimate(checkpointing)
        assert memory.update_peak - memory.parameters - memory.optimizer == total


def test_the_model_trained_is_the_shape_sized(measured):
    """The built model has P plus its biases (8 x (512 + 128 + 128)) and norm weights (8 x 2 x 512 + 512), and
    materialising a rank's shards adds their fp32 bytes to its RSS: 4 x P / 2 = 81.8 MB, within 4% (2.4 MB more
    measured: the pages of 107 tensors, the rotary buffer, Python's own objects)."""
    for rank in measured:
        assert rank["numel"] == 40_894_464 + 6_144 + 8_704
        assert rank["parameters_rss"] == pytest.approx(estimate(False).parameters, rel=0.04)


def test_gloo_stages_a_copy_of_each_collective(measured):
    """The CPU's own term: gloo's reduce-scatter of the head's fp32 gradient (16,384 x 512 x 4 = 33,554,432 bytes)
    holds a copy of its input, its all-gather of the bf16 head (16,777,216 bytes) a copy of its output (NCCL writes
    in place: on a GPU neither is there). Each within 8% of the copy."""
    for rank in measured:
        assert rank["gloo_reduce_scatter"] == pytest.approx(33_554_432, rel=0.08)
        assert rank["gloo_all_gather"] == pytest.approx(16_777_216, rel=0.08)


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_the_estimate_bounds_the_measured_peak_of_a_step(measured, gradient_checkpointing):
    """gradients + gathered unit + activations + logits, + gloo's larger staging copy (the head's reduce-scatter,
    measured on the same rank), is at least what the step added to each rank's RSS, and not more than
    ``UPPER_FACTOR`` times it."""
    memory = estimate(gradient_checkpointing)
    for rank in measured:
        estimated = memory.update_peak - memory.parameters - memory.optimizer
        estimated += max(rank["gloo_reduce_scatter"], rank["gloo_all_gather"])
        peak = rank[f"checkpointing={gradient_checkpointing}"]["rss_added"]
        assert peak <= estimated <= UPPER_FACTOR * peak, (peak, estimated)
