"""``--max-restarts`` on a cluster whose nodes do not all see the checkpoint folder is refused before anything starts.

A real two-node Ray cluster on one host: the head (``ray.cluster_utils.Cluster``) and a worker node started by
``ray start`` inside a mount namespace of its own (``unshare -m``), where a private tmpfs hides one folder, as a
node-local disk would. The other folder both nodes see, as a shared filesystem. No verl run.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_plugins import cli
from areal_plugins.cli import launch
from areal_plugins.cli.shared_folders import unshared_nodes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster_with_a_private_folder(tmp_path_factory):
    """(address, the worker node's private folder, a folder both nodes see)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to give one node a private folder")
    import ray
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    base = tmp_path_factory.mktemp("shared_checkpoints")
    private, shared = base / "node_local", base / "shared"
    private.mkdir()
    shared.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {private}"], capture_output=True)
    if probe.returncode != 0:  # not root, or namespaces off in this container
        pytest.skip(f"unshare -m with a tmpfs mount is not permitted here: {probe.stderr.decode().strip()}")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    ray_cli = str(Path(sys.executable).parent / "ray")
    node = subprocess.Popen(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs tmpfs {private} && exec {ray_cli} start --address={cluster.address} --num-cpus=1 --block"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        ray.init(address=cluster.address, logging_level=logging.ERROR)
        deadline = time.monotonic() + 120
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert node.poll() is None, "the namespaced node did not start (unshare or mount refused?)"
            assert time.monotonic() < deadline, "the second node never joined"
            time.sleep(0.5)
        ray.shutdown()
        yield cluster.address, private, shared
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
        cluster.shutdown()
        Path(get_ray_address_file(None)).unlink(missing_ok=True)


def test_a_folder_one_node_cannot_see_is_named_with_that_node(cluster_with_a_private_folder):
    address, private, shared = cluster_with_a_private_folder
    missing = unshared_nodes(private, address)
    assert len(missing) == 1 and missing[0].endswith(": no such file"), missing
    assert unshared_nodes(shared, address) == []
    assert not [p for p in (*private.iterdir(), *shared.iterdir())], "the probe's marker files were left behind"


def test_restarts_with_an_unshared_checkpoint_folder_are_refused_naming_the_key(
    cluster_with_a_private_folder, tmp_path, monkeypatch, caplog
):
    address, private, shared = cluster_with_a_private_folder
    monkeypatch.setenv("AREAL_TINY_DIR", str(tmp_path))  # the recipe's model path; nothing is built for a refusal
    monkeypatch.setattr(launch, "ensure_tiny_assets", lambda *a, **k: pytest.fail("a refused run built assets"))
    recipe = str(REPO / "recipes" / "grpo_cpu_async.yaml")
    args = ["train", recipe, "trainer.save_freq=1", f"+ray_kwargs.ray_init.address={address}", "--max-restarts", "1"]
    args += ["--run-dir", str(tmp_path / "run")]
    with caplog.at_level(logging.INFO):
        code = cli.main([*args, f"trainer.default_local_dir={private}"])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == launch.REFUSED_EXIT_CODE and len(errors) == 1, errors
    assert f"trainer.default_local_dir={private}" in errors[0] and "--max-restarts 0" in errors[0]
    assert "\n" not in errors[0]
    # The same run with a folder every node sees passes the check (and is then stopped before verl starts).
    monkeypatch.setattr(launch, "ensure_tiny_assets", lambda *a, **k: tmp_path)
    monkeypatch.setattr(launch, "run_verl", lambda *a, **k: pytest.fail("stop here"))
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(pytest.fail.Exception, match="stop here"):
        cli.main([*args, f"trainer.default_local_dir={shared}"])
    assert any("every node of the cluster sees" in r.getMessage() for r in caplog.records)
