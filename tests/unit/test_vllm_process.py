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
