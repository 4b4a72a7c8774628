"""Record which version generated each trained token in the bench's verl rows, read-only (issue 63, item 1).

*Why*: the bench reports one staleness for every row, per trained token (:mod:`areal_bench.token_staleness`). Our
rows record each trajectory's requests and their versions (``areal_samples.jsonl``); verl 0.9.1 keeps only a
trajectory's first and last version: ``FullyAsyncLLMServerClient.generate`` (``workers/rollout/llm_server.py``
281-349) merges the requests of an interrupted answer and drops each one's version and length, so the share of an
answer's tokens each version generated is lost. Nothing in the run changes: this adds one field to the answer's
``extra_fields`` (kept in TransferQueue with the rest) and, after verl's own metrics of a step, reads that field of
the step's trajectories and appends one line each to :data:`~areal_bench.token_staleness.VERL_RECORD`.
*Upstream*: no seam exists (verl 0.9.1; its client keeps ``min_global_steps``/``max_global_steps`` only).
*Remove when*: verl records per-token (or per-request) versions of a trajectory.

Where it runs: the bench names this module in ``VERL_USE_EXTERNAL_MODULES`` for its verl rows only (the synchronous
baseline and verl's asynchronous modes: :func:`areal_bench.external_modules`), so verl imports it in every process
of those runs; our rows never load it. Importing it patches nothing: it watches for the two verl modules (as
``areal_plugins.verl_plugin`` watches verl's registries) and wraps their methods the moment each has been imported,
so a process that never loads verl's client or trainer pays nothing. Three methods are wrapped:

- ``FullyAsyncLLMServerClient.generate`` (agent-loop workers): collects the requests of one answer, and writes them
  as ``extra_fields["areal_chunks"]`` (``[first response token, version, None]`` each, our rows' shape);
- ``LLMServerClient.generate`` (agent-loop workers): inside the one above, each request's length and version (the
  engine's ``global_steps``); outside it (the synchronous client) nothing;
- ``PPOTrainer._compute_metrics`` (verl's trainer, driver): after verl's metrics, the step's trajectories' field and
  tags from TransferQueue (before verl clears them), one record each with ``T = global_steps - 1``. A trajectory with
  no recorded requests (the synchronous client) gets one at its only version, where verl's first and last agree.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

from areal_plugins.patches._after_import import spec_running_after
from areal_plugins.patches._base import AttributePatch

from areal_bench.token_staleness import VERL_RECORD
from areal_plugins._compat import SUPPORTED_VERL
from areal_plugins.core.trajectory_rows import CHUNKS_FIELD

logger = logging.getLogger(__name__)

CLIENTS = "verl.workers.rollout.llm_server"
TRAINER = "verl.trainer.ppo.v1.trainer_base"

#: The requests of the answer being generated in this task: ``{"chunks": [...], "tokens": n}``; None outside one.
_ANSWER: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("areal_bench_answer", default=None)


def _answer_wrapper(original: Any) -> Any:
    @functools.wraps(original)
    async def generate(self: Any, request_id: Any, **kwargs: Any) -> Any:
        answer: dict[str, Any] = {"chunks": [], "tokens": 0}
        token = _ANSWER.set(answer)
        try:
            output = await original(self, request_id, **kwargs)
        finally:
            _ANSWER.reset(token)
        output.extra_fields.setdefault(CHUNKS_FIELD, answer["chunks"])
        return output

    return generate


def _request_wrapper(original: Any) -> Any:
    @functools.wraps(original)
    async def generate(self: Any, request_id: Any, **kwargs: Any) -> Any:
        output = await original(self, request_id, **kwargs)
        answer = _ANSWER.get()
        if answer is not None and output.token_ids:
            answer["chunks"].append([answer["tokens"], output.extra_fields.get("global_steps"), None])
            answer["tokens"] += len(output.token_ids)
        return output

    return generate


def _trainer_wrapper(original: Any) -> Any:
    @functools.wraps(original)
    def _compute_metrics(self: Any, batch: Any, metrics: Any, timing_raw: Any, global_steps: int, epoch: Any) -> Any:
        result = original(self, batch, metrics, timing_raw, global_steps, epoch)
        import transfer_queue as tq

        record_trained(batch, global_steps, tq)
        return result

    return _compute_metrics


def trained_records(keys: list[str], tags: list[dict[str, Any]], extras: Any, global_steps: int) -> list[dict]:
    """One :data:`VERL_RECORD` line per trajectory a step trained: ``keys``/``tags`` of the step's batch (no
    padding), ``extras`` their ``extra_fields`` rows from TransferQueue."""
    out = []
    for row, (key, tag) in enumerate(zip(keys, tags, strict=True)):
        extra = extras[row]
        extra = dict(getattr(extra, "data", extra) or {})
        chunks = extra.get(CHUNKS_FIELD)
        first, last = tag.get("min_global_steps"), tag.get("max_global_steps")
        if not chunks and first is not None and first == last:  # one version generated it all
            chunks = [[0, first, None]]
        out.append(
            {
                "step": global_steps,
                "trainer_version": global_steps - 1,
                "key": key,
                "chunks": chunks or [],
                "response_tokens": int(tag["response_len"]),
                "min_global_steps": first,
                "max_global_steps": last,
            }
        )
    return out


def record_trained(batch: Any, global_steps: int, store: Any) -> None:
    """Append the records of the trajectories ``batch`` (verl's ``KVBatchMeta``) trained at step ``global_steps``."""
    from areal_plugins.records.writer import append_record

    kept = [(key, tag) for key, tag in zip(batch.keys, batch.tags, strict=True) if not tag.get("is_padding", False)]
    if not kept:
        return
    keys, tags = [key for key, _ in kept], [tag for _, tag in kept]
    data = store.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    for record in trained_records(keys, tags, data["extra_fields"], global_steps):
        append_record(VERL_RECORD, record)


CLIENT_PATCHES = (
    AttributePatch("bench_answer_versions", ((CLIENTS, "FullyAsyncLLMServerClient.generate"),), _answer_wrapper,
                   SUPPORTED_VERL),
    AttributePatch("bench_request_versions", ((CLIENTS, "LLMServerClient.generate"),), _request_wrapper,
                   SUPPORTED_VERL),
)  # fmt: skip
TRAINER_PATCHES = (
    AttributePatch("bench_trained_versions", ((TRAINER, "PPOTrainer._compute_metrics"),), _trainer_wrapper,
                   SUPPORTED_VERL),
)  # fmt: skip
#: The verl module whose import each group of patches waits for.
WATCHED = {CLIENTS: CLIENT_PATCHES, TRAINER: TRAINER_PATCHES}


def apply(verl_version: str | None = None) -> None:
    """Wrap the three methods now (module docstring); idempotent; refuses a verl outside ``SUPPORTED_VERL``."""
    for patches in WATCHED.values():
        for patch in patches:
            patch.apply(verl_version)


def revert() -> None:
    """Put back verl's very methods."""
    for patches in WATCHED.values():
        for patch in patches:
            patch.revert()


def is_applied() -> bool:
    return all(patch.is_applied() for patches in WATCHED.values() for patch in patches)


def _apply_watched(name: str) -> None:
    """Apply the patches waiting for verl module ``name`` (idempotent); an error is raised into its import."""
    for patch in WATCHED[name]:
        patch.apply()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Applies a watched module's patches right after it is imported; finds nothing itself."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname not in WATCHED:
            return None
        return spec_running_after(self, fullname, path, target, functools.partial(_apply_watched, fullname))


_WATCH_LOCK = threading.Lock()


def watch() -> None:
    """Patch each watched module once it is imported (at once if it is already); idempotent, one watcher."""
    with _WATCH_LOCK:
        if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
    for name in WATCHED:
        if name in sys.modules:
            _apply_watched(name)


watch()  # verl imports this module (VERL_USE_EXTERNAL_MODULES) only in the processes of a verl row
