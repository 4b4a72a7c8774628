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

The same step computing in fp32 (``MixedPrecisionPolicy(param_dtype=fp32)``, verl's ``mixed_precision.param_dtype:
fp32``, as the CPU recipes run) is measured in the ``full`` tier; the logits' own bytes in both dtypes, on verl's
``logprobs_from_logits_v2``, in the unit tier.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from areal_plugins.planning.hardware import ModelShape
from areal_plugins.planning.trainer_memory import TrainerSetup, trainer_memory
from tests.unit.store_ports import store_port

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
#: How far above the measured peak the estimate may be, by compute dtype. The estimate adds the logits' peak, the
#: gathered unit and (with gradient checkpointing) one recomputed layer, which the backward reaches apart: the logits'
#: backward holds neither the head's gathered unit (gathered for the head's own backward, after the logits' gradient
#: is summed) nor a recomputed layer, nor gloo's copy. By design up to min(logits, unit) + one layer + gloo's copy
#: high: bf16 67 + 24 + 36 = 126 MB of the checkpointed step's 227 MB measured (1.27-1.28x); fp32 101 + 43 + 36 =
#: 180 MB of 318 MB (1.53x); without checkpointing 1.07-1.12x (bf16) and 1.19x (fp32).
UPPER_FACTOR = {"bf16": 1.35, "fp32": 1.6}


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


def _train(rank: int, port: int, out: str, pin_mmap_threshold: bool, compute: str) -> None:
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
    from verl.utils.torch_functional import logprobs_from_logits_v2

    compute_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[compute]

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
        # verl's FSDPEngine: fp32 parameters (model_dtype), mixed_precision.param_dtype compute, fp32 reduce;
        # apply_fsdp2's units
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
        shard = {"mesh": init_device_mesh("cpu", (WORLD,)), "mp_policy": policy, "reshard_after_forward": True}
        for name, module in model.named_modules():
            if isinstance(module, Qwen2DecoderLayer) or name.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head"):
                fully_shard(module, **shard)
        fully_shard(model, **shard)
        trim()
        before_parameters = _kib_field("RssAnon")  # anonymous pages: tensors, not the libraries' code paged in
        model.to_empty(device="cpu")  # each rank allocates its shards only
        torch.manual_seed(0)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.to_local().normal_(0, 0.02)
        model.model.rotary_emb.__init__(config)  # its inv_freq buffer, left on the meta device
        parameters = _kib_field("RssAnon") - before_parameters
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
        generator = torch.Generator().manual_seed(rank)

        def loss_of(ids: torch.Tensor) -> torch.Tensor:
            # verl's FSDPEngine with use_remove_padding at temperature 1: logits_rmpad = output.logits.squeeze(0),
            # then verl's logprobs_from_logits_v2 with flash-attention absent (bf16: a row's log_softmax at a time;
            # fp32: the logsumexp of each row)
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0)).logits.squeeze(0)
            return -logprobs_from_logits_v2(logits, torch.roll(ids.squeeze(0), -1)).float().mean()

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
            torch.empty(unit, dtype=compute_dtype),
            torch.zeros(unit // WORLD, dtype=compute_dtype),
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


def measure(out: Path, pin_mmap_threshold: bool = True, compute: str = "bf16") -> list[dict]:
    """Run the two ranks; each rank's measurements (bytes), as ``_train`` writes them. ``pin_mmap_threshold=False``:
    glibc's default allocator, which keeps freed chunks (docs/guides/sizing.md gives both). ``compute``: the
    ``mixed_precision.param_dtype``, ``bf16`` (verl's default) or ``fp32``."""
    import torch.multiprocessing as mp

    port = store_port()
    mp.start_processes(_train, args=(port, str(out), pin_mmap_threshold, compute), nprocs=WORLD, start_method="spawn")
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(WORLD)]


def _native_bf16() -> bool:
    """Whether torch computes bf16 with bf16 instructions here (the logits' constant is native bf16's, as a GPU
    computes it): the CPU has them (avx512_bf16, amx_bf16) and oneDNN is not capped below them
    (``ONEDNN_MAX_CPU_ISA``, with ``ATEN_CPU_CAPABILITY=avx2`` how CONTRIBUTING.md emulates an AVX2-only box)."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "DEFAULT").upper()
    capped = cap != "DEFAULT" and not any(word in cap for word in ("BF16", "AMX", "FP16", "AVX10"))
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and not capped


#: The compute dtypes measured. In the unit tier verl's default bf16 where the CPU computes bf16 itself; elsewhere
#: fp32, since without bf16 instructions torch computes the bf16 step through fp32 conversions (446-599 s on an
#: AVX2-only box, against about 2 min for the fp32 step), and bf16 in the ``full`` tier. The other one is in ``full``.
NATIVE_BF16 = _native_bf16()
COMPUTE = [
    pytest.param("bf16", id="bf16", marks=() if NATIVE_BF16 else pytest.mark.full),
    pytest.param("fp32", id="fp32", marks=pytest.mark.full if NATIVE_BF16 else ()),
]
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}


@pytest.fixture(scope="module", params=COMPUTE)
def measured(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return request.param, measure(tmp_path_factory.mktemp("trainer_memory_measured"), compute=request.param)


def estimate(gradient_checkpointing: bool, compute: str = "bf16"):
    return trainer_memory(SHAPE, TrainerSetup(shard_gpus=WORLD, param_bytes=4, micro_batch_tokens=TOKENS,
                                              gradient_checkpointing=gradient_checkpointing,
                                              compute_bytes=COMPUTE_BYTES[compute]))  # fmt: skip


def test_the_estimate_for_this_shape_by_hand():
    """Over S = 2: gradients 4 x P / 2 = 81,788,928; the gathered unit, the head (16,384 x 512 = 8,388,608, larger
    than a layer's 3,014,656) x 8 = 67,108,864; logits 1,024 x 16,384 x 4 = 67,108,864; activations, a layer
    20·512 + 8·1536 + 4·2·64 + 4·8 + 8 = 23,080 bytes a token: without checkpointing 1,024 x (8 x 23,080 + 8·512)
    = 193,265,664, with it 1,024 x (8 x 2·512 + 23,080 + 8·512) = 36,216,832.

    fp32 compute: the unit 8,388,608 x (4 + 4 + 4) = 100,663,296; logits 1,024 x 16,384 x 12 = 201,326,592; a layer
    4 x (6·512 + 4·1536 + 2·2·64) + 4 x (2·512 + 8) + 8 = 42,024 bytes a token, the final norm and head 12·512 = 6,144:
    without checkpointing 1,024 x (8 x 42,024 + 6,144) = 350,552,064, with it 1,024 x (8 x 4·512 + 42,024 + 6,144) =
    66,101,248."""
    assert SHAPE.params == 40_894_464
    for compute, checkpointing, total in (
        ("bf16", False, 409_272_320),
        ("bf16", True, 252_223_488),
        ("fp32", False, 81_788_928 + 100_663_296 + 201_326_592 + 350_552_064),
        ("fp32", True, 81_788_928 + 100_663_296 + 201_326_592 + 66_101_248),
    ):
        memory = estimate(checkpointing, compute)
        assert memory.update_peak - memory.parameters - memory.optimizer == total


def test_the_model_trained_is_the_shape_sized(measured):
    """The built model has P plus its biases (8 x (512 + 128 + 128)) and norm weights (8 x 2 x 512 + 512), and
    materialising a rank's shards adds their fp32 bytes to its anonymous RSS (``RssAnon``: the libraries' code that
    the first calls page in is left out): 4 x P / 2 = 81.8 MB, within 4%."""
    _, ranks = measured
    for rank in ranks:
        assert rank["numel"] == 40_894_464 + 6_144 + 8_704
        assert rank["parameters_rss"] == pytest.approx(estimate(False).parameters, rel=0.04)


def test_gloo_stages_a_copy_of_each_collective(measured):
    """The CPU's own term: gloo's reduce-scatter of the head's fp32 gradient (16,384 x 512 x 4 = 33,554,432 bytes)
    holds a copy of its input, its all-gather of the head in the compute dtype (bf16 16,777,216 bytes, fp32
    33,554,432) a copy of its output (NCCL writes in place: on a GPU neither is there). Each within 8% of the
    copy."""
    compute, ranks = measured
    for rank in ranks:
        assert rank["gloo_reduce_scatter"] == pytest.approx(33_554_432, rel=0.08)
        assert rank["gloo_all_gather"] == pytest.approx(8_388_608 * COMPUTE_BYTES[compute], rel=0.08)


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_the_estimate_bounds_the_measured_peak_of_a_step(measured, gradient_checkpointing):
    """gradients + gathered unit + activations + logits, + gloo's larger staging copy (the head's reduce-scatter,
    measured on the same rank), is at least what the step added to each rank's RSS, and not more than
    ``UPPER_FACTOR`` of the compute dtype times it."""
    compute, ranks = measured
    memory = estimate(gradient_checkpointing, compute)
    for rank in ranks:
        estimated = memory.update_peak - memory.parameters - memory.optimizer
        estimated += max(rank["gloo_reduce_scatter"], rank["gloo_all_gather"])
        peak = rank[f"checkpointing={gradient_checkpointing}"]["rss_added"]
        assert peak <= estimated <= UPPER_FACTOR[compute] * peak, (compute, peak, estimated)


#: The logits' own measurement: T tokens of hidden h through an output head of V entries, then verl's log-probs.
LOGIT_T, LOGIT_H, LOGIT_V = 1024, 64, 32768


def _logits_step(_rank: int, compute: str, out: str) -> None:
    """One forward and backward of ``head(x)`` through verl's ``logprobs_from_logits_v2``; what it adds to the RSS
    at its peak (mmap threshold pinned, measured after a warm-up run)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    import torch
    from verl.utils.torch_functional import logprobs_from_logits_v2

    torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[compute]
    torch.manual_seed(0)
    head = torch.nn.Linear(LOGIT_H, LOGIT_V, bias=False).to(dtype)
    hidden = torch.randn(LOGIT_T, LOGIT_H, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, LOGIT_V, (LOGIT_T,))

    def run() -> None:
        (-logprobs_from_logits_v2(head(hidden), labels).float().mean()).backward()
        head.weight.grad = hidden.grad = None

    run()
    gc.collect()
    libc.malloc_trim(0)
    base = _kib_field("VmRSS")
    _reset_peak()
    run()
    Path(out).write_text(str(_kib_field("VmHWM") - base))


@pytest.mark.parametrize("compute", ["bf16", "fp32"])
def test_the_logits_bytes_are_what_verls_log_probs_hold(tmp_path, compute):
    """What the backward of verl's log-probs (flash-attention absent) holds at its peak, per token and vocabulary
    entry: ``LOGIT_BYTES`` of the compute dtype (bf16 4, fp32 12), within 10%, once the head's own weight gradient
    (h x V in the compute dtype) is taken off."""
    import torch.multiprocessing as mp

    from areal_plugins.planning.trainer_memory import LOGIT_BYTES

    if compute == "bf16" and not _native_bf16():
        pytest.skip(
            "this CPU has no bf16 instructions (avx512_bf16, amx_bf16): torch computes bf16 through fp32 here, and "
            "the step held 4.40-4.45 bytes an entry on an AVX2-only box (2026-12-06) where native bf16 holds 4"
        )
    # The least of 3 processes' peaks: what else the machine runs can only add to a process's peak RSS (one run
    # beside a busy xdist worker held 4.41 bytes an entry in bf16 on this native-bf16 box; alone, within 10% of 4).
    peaks = []
    for attempt in range(3):
        out = tmp_path / f"peak{attempt}"
        mp.start_processes(_logits_step, args=(compute, str(out)), nprocs=1, start_method="spawn")
        peaks.append(int(out.read_text()))
    added = min(peaks) - LOGIT_H * LOGIT_V * COMPUTE_BYTES[compute]
    assert added / (LOGIT_T * LOGIT_V) == pytest.approx(LOGIT_BYTES[COMPUTE_BYTES[compute]], rel=0.10)
