"""verl's rollout-server contract served by a real vLLM server process (the ``areal_vllm`` backend).

The same contract as :class:`areal_plugins.rollout.cpu.server.CPURolloutServer` (generate, abort
and resume, weight update with a version and checksum reply, stats), implemented over HTTP
against :class:`VLLMServer`:

- **Interruptible generation.** ``abort_all_requests`` calls vLLM's ``/pause?mode=abort``; every
  streamed request returns its tokens so far. verl's interruptible client (ours) re-submits them as
  prompt + partial output; here they wait at a gate until the new weights are loaded.
- **Per-token versions.** Weights change only while the gate is closed, so every token of one
  streamed chunk comes from the version served when the chunk started.
- **Weight transfer on CPU.** The state dict is written as safetensors to a directory the server
  reads, then loaded in place by our worker extension (``reload_weights``), which answers with the
  version and a layout-free checksum; the trainer compares it with its own (no silent non-sync).
- **A dead server** is restarted and the requests it was serving continue from their partial output.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import torch

from areal_plugins.rollout.activity import RequestActivity
from areal_plugins.rollout.base import (
    Generated,
    RolloutServer,
    WeightSyncError,
    record_replica_event,
    record_weight_sync,
)
from areal_plugins.rollout.vllm.http_client import ABORTED, Generation, VLLMClient
from areal_plugins.rollout.vllm.process import GpuSettings, VLLMServer
from areal_plugins.rollout.vllm.worker_extension import layout_free_checksum
from areal_plugins.run.record_sink import remote_sink
from areal_plugins.run.records import run_dir

logger = logging.getLogger(__name__)

#: Relative tolerance of the checksum comparison (float64 sums of the same numbers in another order).
CHECKSUM_RTOL = 1e-7
#: What a request or control call raises when the server process is gone.
SERVER_GONE = (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError)
#: Retries of a call that failed while the server stayed up (e.g. a connection reset) before giving up.
TRANSIENT_RETRIES = 3


def verl_stop_reason(finish_reason: str | None) -> str:
    """verl's stop reason for a vLLM finish reason; verl re-issues "aborted" requests from their partial output.

    A stream that ends without a finish reason was cut, not completed (the soak saw one with no tokens when
    /pause raced the request's start; as "completed" it reached verl's reward step empty and failed the group).
    """
    return "aborted" if finish_reason in (ABORTED, None) else "completed"


def expected_checksum(state_dict: dict[str, torch.Tensor]) -> list[float]:
    """What the worker extension must report after loading ``state_dict`` (every tensor sent)."""
    return layout_free_checksum(state_dict[name] for name in sorted(state_dict))


def check_sync(report: dict[str, Any], version: int, expected: list[float], where: str) -> None:
    """Raise :class:`WeightSyncError` unless the engine reports ``version`` and the ``expected`` checksum."""
    got = report.get("checksum") or [0.0, 0.0, 0.0]
    same = got[0] == expected[0] and all(
        abs(a - b) <= CHECKSUM_RTOL * max(abs(b), 1.0) for a, b in zip(got[1:], expected[1:], strict=True)
    )
    if report.get("version") != version or not same:
        raise WeightSyncError(
            f"weight sync to {where} failed: the engine reports version {report.get('version')} checksum {got}, "
            f"the trainer sent version {version} checksum {expected}. The rollout would keep sampling stale "
            "weights; stopping."
        )


def save_safetensors(state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    # Own copies: tied weights share storage, which safetensors refuses to write twice.
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()}
    save_file(tensors, str(directory / "model.safetensors"))


class VLLMRolloutServer(RolloutServer):
    """One rollout replica: a vLLM server process and the HTTP client that drives it.

    Args:
        model_path: Hugging Face model directory (the server loads it at start).
        response_length: default ``max_tokens``.
        max_model_len: prompt + response limit.
        max_batch_size: vLLM's ``max_num_seqs``.
        num_threads: CPU threads of the server process.
        seed: sampling seed.
        log_dir: where the server log goes (default: the run directory on its machine, else a temporary one).
        free_cache_engine: verl's ``rollout.free_cache_engine`` (true is refused: no sleep mode on CPU).
        gpu: :class:`GpuSettings` fields when the replica's workers hold GPUs (None: the CPU build).
    """

    backend_name = "areal_vllm"
    releases_memory_on_sleep = False  # vLLM's sleep mode needs CUDA's allocator
    uses_reserved_gpus = True  # on a GPU machine the server runs on its replica's devices

    def __init__(
        self,
        model_path: str,
        response_length: int,
        max_model_len: int,
        max_batch_size: int = 64,
        num_threads: int = 1,
        seed: int = 0,
        replica_rank: int = 0,
        log_dir: str | None = None,
        free_cache_engine: bool = False,
        ignore_eos: bool = False,
        gpu: dict[str, Any] | None = None,
    ) -> None:
        # The run directory is on the driver's machine: a server on another node logs to a local folder.
        local_run_dir = run_dir() if remote_sink() is None else None
        log_dir = log_dir or (str(local_run_dir) if local_run_dir else None) or tempfile.mkdtemp(prefix="areal_vllm_")
        self.replica_rank = replica_rank
        self.ignore_eos = ignore_eos
        self.response_length = response_length
        self.max_model_len = max_model_len
        self.server = VLLMServer(
            model_path,
            log_path=Path(log_dir) / f"vllm_server_{replica_rank}.log",
            max_model_len=max_model_len,
            max_num_seqs=max_batch_size,
            seed=seed,
            num_threads=num_threads,
            gpu=GpuSettings(**gpu) if gpu else None,
        )
        self.server.start()
        self.client = VLLMClient(self.server.url, model_path)
        self.weights_dir = Path(tempfile.mkdtemp(prefix=f"areal_vllm_weights_{replica_rank}_"))
        self.version = 0
        self.generated_tokens = 0
        self.activity = RequestActivity()
        self._init_gate(free_cache_engine)
        self._aborts: dict[str, asyncio.Event] = {}  # in-flight request id -> set to abort it
        self._restart_lock = asyncio.Lock()

    # ------------------------------------------------------------------ generation

    async def _generate(self, prompt_ids: list[int], max_tokens: int, params: dict[str, Any], request_id: str):
        abort = self._aborts.setdefault(request_id, asyncio.Event())
        try:
            tokens, logprobs, versions, reason = await self._generate_surviving_restarts(
                prompt_ids, max_tokens, params, abort
            )
        finally:
            self._aborts.pop(request_id, None)
        return Generated(tokens, logprobs, versions, verl_stop_reason(reason))

    @property
    def served_version(self) -> int:
        return self.version

    async def _generate_surviving_restarts(
        self, prompt_ids: list[int], max_tokens: int, params: dict[str, Any], abort: asyncio.Event
    ) -> tuple[list[int], list[float], list[int], str | None]:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        self.activity.enter()
        attempt = 0
        try:
            while True:
                attempt += 1
                version, incarnation = self.version, self.server.restarts
                chunk = Generation()
                stream = asyncio.ensure_future(
                    self.client.generate(
                        prompt_ids + tokens,
                        max_tokens=max_tokens - len(tokens),
                        temperature=float(params.get("temperature", 1.0)),
                        top_p=float(params.get("top_p", 1.0)),
                        top_k=int(params.get("top_k", -1)),
                        ignore_eos=bool(params.get("ignore_eos", False)),
                        on_tokens=self._count_tokens,
                        into=chunk,
                    )
                )
                aborted = asyncio.ensure_future(abort.wait())
                try:
                    await asyncio.wait({stream, aborted}, return_when=asyncio.FIRST_COMPLETED)
                    if not stream.done():  # abort_request: closing the stream makes vLLM abort the request
                        stream.cancel()
                        await asyncio.gather(stream, return_exceptions=True)
                        chunk.finish_reason = ABORTED
                    else:
                        stream.result()
                except SERVER_GONE as error:
                    tokens += chunk.token_ids  # what streamed before the server died
                    logprobs += chunk.logprobs
                    versions += [version] * len(chunk.token_ids)
                    if await self._recover(error, incarnation, attempt):
                        attempt = 0  # retries count failures of one server
                    if not self._gate_open.is_set():
                        # Paused while the server died: hand back the partial output, as /pause would have.
                        return tokens, logprobs, versions, ABORTED
                    continue
                finally:
                    aborted.cancel()
                tokens += chunk.token_ids
                logprobs += chunk.logprobs
                versions += [version] * len(chunk.token_ids)
                return tokens, logprobs, versions, chunk.finish_reason
        finally:
            self.activity.leave()

    async def _on_live_server(self, call: Callable[[VLLMClient], Awaitable[Any]]) -> Any:
        """A control call (pause, resume, reload) that replaces a server found dead instead of failing the run."""
        attempt = 0
        while True:
            attempt += 1
            incarnation = self.server.restarts
            try:
                return await call(self.client)
            except SERVER_GONE as error:
                if await self._recover(error, incarnation, attempt):
                    attempt = 0

    async def _recover(self, error: BaseException, incarnation: int, attempt: int) -> bool:
        """After a failed call: retry on a server that is still up (a dropped connection; raises after
        ``TRANSIENT_RETRIES``), else replace it. True when the caller now talks to a new server."""
        if self.server.restarts == incarnation and self.server.alive() and self.server.healthy():
            if attempt > TRANSIENT_RETRIES:
                raise RuntimeError(f"vLLM call failed {attempt} times while the server is up: {error!r}") from error
            logger.warning("vLLM call failed on a live server (%r); retrying (attempt %d)", error, attempt)
            await asyncio.sleep(0.1 * attempt)
            return False
        await self._restart_if_dead(error, incarnation)
        return True

    async def _restart_if_dead(self, error: BaseException, incarnation: int) -> None:
        async with self._restart_lock:
            if self.server.restarts != incarnation:
                return  # another request already replaced the server that failed us
            if self.server.alive() and self.server.healthy():
                raise RuntimeError(f"vLLM request failed while the server is up: {error!r}") from error
            logger.warning("vLLM server of replica %d is gone (%r); restarting it", self.replica_rank, error)
            # Requests wait for the new server; statistics and abort calls on this loop do not.
            await self.server.restart_async()
            self.client = VLLMClient(self.server.url, self.server.model_path)
            if self.version > 0:  # the fresh server starts from the original weights
                report = await self.client.reload_weights(str(self.weights_dir), self.version)
                check_sync(report, self.version, self._last_checksum, f"restarted replica {self.replica_rank}")

    def _count_tokens(self, count: int) -> None:
        self.generated_tokens += count  # live, as tokens stream in (activity metrics, tests)

    # ------------------------------------------------------------------ interruption

    async def _abort_in_flight(self) -> list[str]:
        request_ids = list(self._aborts)
        await self._on_live_server(lambda client: client.pause())  # running requests return their partial output
        # vLLM's pause holds requests it had not scheduled yet; they would run after the next resume
        # under new weights while stamped with the old version. Close their streams: vLLM drops them
        # and each returns what it has (nothing), to be re-submitted after the update.
        for request_id in request_ids:
            abort = self._aborts.get(request_id)
            if abort is not None:
                abort.set()
        await self.wait_for_requests_to_drain()
        return request_ids

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        abort = self._aborts.get(request_id)
        if abort is None:
            return {"aborted": False, "request_id": request_id, "error": "not in flight"}
        abort.set()
        return {"aborted": True, "request_id": request_id}

    async def _resume_engine(self) -> None:
        await self._on_live_server(lambda client: client.resume())

    async def wait_for_requests_to_drain(self) -> None:
        while self.activity.in_flight:
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ memory

    async def _release_memory(self, weights: bool = True) -> None:
        raise NotImplementedError(
            "areal_vllm cannot release memory on sleep (vLLM's sleep mode needs CUDA); "
            "set actor_rollout_ref.rollout.free_cache_engine=false"
        )

    async def _restore_memory(self, tags: set[str]) -> None:
        await self._release_memory()

    async def clear_kv_cache(self) -> None:
        await self._on_live_server(lambda client: client.reset_prefix_cache())

    # ------------------------------------------------------------------ weights

    @staticmethod
    def verify_weights(reply: dict[str, Any], state_dict: dict[str, torch.Tensor], version: int, where: str) -> None:
        check_sync(reply, version, expected_checksum(state_dict), where)

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Write the weights, load them in the server, and return what the server reports."""
        staging = self.weights_dir.with_name(self.weights_dir.name + ".next")
        await asyncio.to_thread(save_safetensors, state_dict, staging)
        # Load from the staging files and only then replace weights_dir: until the server reports the new
        # version, weights_dir holds what it serves, which a restart in between reloads.
        report = await self._on_live_server(lambda client: client.reload_weights(str(staging), version))
        shutil.rmtree(self.weights_dir, ignore_errors=True)
        staging.rename(self.weights_dir)
        self.version = int(report["version"])
        self._last_checksum = report["checksum"]
        record_weight_sync(self.replica_rank, version, report["checksum"], "update")
        record_replica_event(self.replica_rank, "update", version=version)
        return {"version": report["version"], "checksum": report["checksum"]}

    async def get_version(self) -> int:
        return self.version

    async def get_stats(self) -> dict[str, Any]:
        return {
            "generated_tokens": self.generated_tokens,
            "in_flight": self.activity.in_flight,
            "busy_s": self.activity.busy_seconds(),
            "version": self.version,
            "restarts": self.server.restarts,
        }

    async def kill_server_for_test(self) -> int:
        """SIGKILL the server process (fault injection in tests); returns its pid."""
        import signal

        assert self.server.process is not None
        pid = self.server.process.pid
        os.killpg(pid, signal.SIGKILL)
        return pid

    async def shutdown(self) -> None:
        await self.client.close()
        self.server.stop()
