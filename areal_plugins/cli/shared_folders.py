"""Before a run that restarts itself on a cluster: is its checkpoint folder one every node sees?

``--max-restarts`` resumes from ``trainer.default_local_dir``. verl writes the trainer's shards on the trainer's
nodes and its ``data.pt`` and step tracker where the TaskRunner runs, and a restart may be placed elsewhere: on
nodes that do not share that folder a restart fails again, or finds no tracker and trains from step 0 (issue 59).
The check writes a marker with a fresh token into the folder and asks every alive node to read it back
(cli/every_node.py); a node that reads nothing, or another token, does not share the folder.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from areal_plugins.cli.every_node import NodeAnswer, on_every_node
from areal_plugins.records.control_files import SHARED_FOLDER_PROBE_S

MARKER_PREFIX = ".areal_shared_folder_probe-"


def read_marker(path: str) -> str | None:
    """The marker's token as this node sees it (None: the file is not there)."""
    try:
        return Path(path).read_text()
    except OSError:
        return None


def nodes_without(answers: list[NodeAnswer], token: str) -> list[str]:
    """The nodes that did not read ``token`` back, each with what they saw."""
    missing = []
    for answer in answers:
        if answer.error is not None:
            missing.append(f"{answer.name}: did not answer ({answer.error})")
        elif answer.result != token:
            missing.append(f"{answer.name}: " + ("no such file" if answer.result is None else "another file"))
    return missing


def unshared_nodes(folder: Path, address: str, timeout_s: float = SHARED_FOLDER_PROBE_S) -> list[str]:
    """The nodes of the cluster at ``address`` that do not see ``folder`` as this machine does ([] when all do)."""
    folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    marker = folder / f"{MARKER_PREFIX}{token[:8]}"
    marker.write_text(token)
    try:
        return nodes_without(on_every_node(address, read_marker, str(marker), timeout_s=timeout_s), token)
    finally:
        marker.unlink(missing_ok=True)


def refusal(max_restarts: int, folder: Path, missing: list[str]) -> str:
    return (
        f"--max-restarts {max_restarts} resumes from trainer.default_local_dir={folder}, which these nodes of the "
        f"cluster do not share: {'; '.join(missing)}. Set trainer.default_local_dir to a folder every node mounts "
        "(a shared filesystem), or --max-restarts 0"
    )
