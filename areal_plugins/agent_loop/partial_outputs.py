"""Requests in flight kept across a checkpoint: their output so far, so that a resumed run continues them.

Each agent-loop worker's rollout client keeps the output so far of every request it is generating, by episode
answer (verl's prompt uid and answer index): :data:`IN_FLIGHT`. An answer that finished stays there, marked with
its stop reason, until its whole group has (verl re-issues a group in flight as a whole: its finished answers are
taken back as they were, not generated again). At a checkpoint every worker writes its own into
``areal_partials/worker_<i>.jsonl`` beside verl's files, on the node it runs on, with a small index of where each
answer's line starts (``worker_<i>.index``); nothing passes through the driver (at scale this is gigabytes).

When a run resumes, the trainer tells every agent-loop worker which checkpoint it resumed (before any request is
made). Each worker reads the indexes it can see from its node (a few numbers per answer, not the outputs) and, when
a request of a kept uid, answer index and prompt arrives, reads that one answer's line from disk: its tokens keep
the versions they were generated under (and, under router replay, the experts that routed them), and the resume
counts as one more interruption (docs/faults.md, Requests
in flight at a checkpoint). No process ever holds every worker's outputs at once: a worker holds the outputs of the
requests it continues, which it held before the checkpoint too. Measured at 41k requests x 2k tokens:
docs/results/resume_partials.md.

Where the checkpoint folder is not shared by every node, a worker sees only the files written on its own node; a
request re-issued to a worker on another node is generated anew. The driver says at startup which it is
(driver/kept_outputs.py, ``storage_report``).

Without this, verl regenerates every in-flight prompt from scratch on resume (as SkyRL and slime do).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_plugins.agent_loop.routed_experts import decode_experts, encode_experts, routed_experts_fields
from areal_plugins.core.trajectory_rows import prompt_digest

logger = logging.getLogger(__name__)

#: The folder a checkpoint keeps them in, in verl's ``global_step_N/``: one JSON-lines file per agent-loop worker.
PARTIALS_DIR = "areal_partials"
#: Beside each worker's file: one line per answer, ``[uid, session, prompt digest, byte offset, length, tokens]``.
INDEX_SUFFIX = ".index"
#: Answers copied per turn of the worker's event loop while a checkpoint takes its copy (its requests go on between).
SNAPSHOT_BATCH = 256
#: The marker the driver writes into the checkpoint folder at startup; each node's agent-loop worker looks for it.
SHARED_MARKER_PREFIX = ".areal_shared_"


@dataclass
class PartialOutput:
    """One request's output so far. The client extends these lists in place as its requests return."""

    prompt_digest: str
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    chunks: list[list[Any]] = field(default_factory=list)  # [first token, version, seed] per request
    interrupts: int = 0
    stop_reason: str | None = None  # set once the answer finished (its group may still be generating)
    #: router replay: the experts that routed each position so far (rows, layers, top-k), merged as the client does
    routed_experts: Any = None


#: This worker process's answers of groups not settled yet: prompt uid -> answer index -> output so far.
IN_FLIGHT: dict[str, dict[int, PartialOutput]] = {}


def compact(partial: PartialOutput) -> None:
    """A finished answer's output as packed arrays (8 bytes a number, not a Python object each): it stays until its
    group settles, which at thousands of answers in flight would otherwise cost gigabytes."""
    partial.tokens = array("q", partial.tokens)  # type: ignore[assignment]
    partial.log_probs = array("d", partial.log_probs)  # type: ignore[assignment]
    partial.versions = array("q", partial.versions)  # type: ignore[assignment]


def keep(uid: str, session: int, partial: PartialOutput) -> None:
    IN_FLIGHT.setdefault(uid, {})[session] = partial


def forget_group(uid: str) -> None:
    """The group settled (its final status is written): nothing of it is kept any longer."""
    IN_FLIGHT.pop(uid, None)


def _copy(values: Any) -> Any:
    """A copy that shares no buffer: a packed array copied as one block, a list as a list of the same numbers
    (numbers are immutable; nothing is converted, so the copy costs a block copy, not an object per number)."""
    return array(values.typecode, values) if isinstance(values, array) else list(values)


def _snapshot_one(uid: str, session: int, partial: PartialOutput) -> dict[str, Any]:
    return {
        "uid": uid,
        "session": session,
        "prompt_digest": partial.prompt_digest,
        "tokens": _copy(partial.tokens),
        "log_probs": _copy(partial.log_probs),
        "versions": _copy(partial.versions),
        "chunks": [list(chunk) for chunk in partial.chunks],
        "interrupts": partial.interrupts,
        "stop_reason": partial.stop_reason,
        "routed_experts": encode_experts(partial.routed_experts),
    }


async def snapshot_in_flight(batch: int = SNAPSHOT_BATCH) -> list[dict[str, Any]]:
    """This worker's answers with output, of groups not settled, copied on its event loop ``batch`` answers at a
    time: each answer is copied whole between two of its requests (no request is half-way through adding a
    chunk), and the worker's requests go on between batches. An answer that starts meanwhile is not kept (it is
    generated anew on resume); a group that settles meanwhile is finished in TransferQueue, so what was copied of
    it goes unused."""
    answers = [(uid, session) for uid, kept in list(IN_FLIGHT.items()) for session in list(kept)]
    copies: list[dict[str, Any]] = []
    for start in range(0, len(answers), batch):
        for uid, session in answers[start : start + batch]:
            partial = IN_FLIGHT.get(uid, {}).get(session)
            if partial is not None and (len(partial.tokens) or partial.stop_reason is not None):
                copies.append(_snapshot_one(uid, session, partial))
        await asyncio.sleep(0)  # the worker's requests run before the next batch is copied
    return copies


def _plain(values: Any) -> list[Any]:
    return values.tolist() if isinstance(values, array) else values


def write_partials(folder: str, worker: int, partials: list[dict[str, Any]]) -> dict[str, int]:
    """Write one worker's kept outputs into the checkpoint ``folder`` (one JSON line each, and the index of where
    each starts); how many answers and tokens. Runs in a thread: the worker's event loop goes on."""
    path = Path(folder) / PARTIALS_DIR / f"worker_{worker}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    written, index_written = path.with_suffix(".partial"), path.with_suffix(".index.partial")
    tokens = 0
    with open(written, "wb") as handle, open(index_written, "w") as index:
        for partial in partials:
            line = (json.dumps({key: _plain(value) for key, value in partial.items()}) + "\n").encode()
            entry = [partial["uid"], int(partial["session"]), partial["prompt_digest"], handle.tell(), len(line)]
            index.write(json.dumps([*entry, len(partial["tokens"])]) + "\n")
            handle.write(line)
            tokens += len(partial["tokens"])
    # Whole or not at all: the index last, so an index always describes a whole file.
    written.replace(path)
    index_written.replace(path.with_suffix(INDEX_SUFFIX))
    return {"requests": len(partials), "tokens": tokens}


def remove_rotated_partials(checkpoints: str | Path) -> int:
    """Remove the kept outputs of checkpoints verl has rotated away (``max_actor_ckpt_to_keep``: verl deletes a
    step's ``actor/`` folder and leaves the rest); they cannot be resumed from, and at scale they are the largest
    thing left. Returns how many folders were removed."""
    import shutil

    removed = 0
    for kept in Path(checkpoints).glob(f"global_step_*/{PARTIALS_DIR}"):
        if not (kept.parent / "actor").exists():
            shutil.rmtree(kept, ignore_errors=True)
            removed += 1
    return removed


def read_partials(folder: str | Path) -> list[dict[str, Any]] | None:
    """What a checkpoint kept, all workers' together, whole (for tests and tools reading a small checkpoint; a
    resume reads each answer where it is continued: :class:`KeptOutputs`); None for a checkpoint without it."""
    kept = Path(folder) / PARTIALS_DIR
    if not kept.is_dir():
        return None
    return [
        json.loads(line)
        for path in sorted(kept.glob("worker_*.jsonl"))
        for line in path.read_text().splitlines()
        if line
    ]


def _index_of(data: Path) -> Iterator[list[Any]]:
    """The index lines of one worker's file: from its index; for a checkpoint written before indexes were
    (2026-12-04), made by reading the file once, a line at a time (its numbers are parsed, then dropped)."""
    index = data.with_suffix(INDEX_SUFFIX)
    if index.exists():
        with open(index) as lines:
            yield from (json.loads(line) for line in lines if line.strip())
        return
    with open(data, "rb") as lines:
        offset = 0
        for line in lines:
            if line.strip():
                kept = json.loads(line)
                yield [kept["uid"], kept["session"], kept["prompt_digest"], offset, len(line), len(kept["tokens"])]
            offset += len(line)


class KeptOutputs:
    """The outputs a checkpoint kept, as one agent-loop worker sees them from its node: the indexes read, each
    answer's line read from disk when a request continues it, and taken at most once."""

    def __init__(self, folder: str | Path) -> None:
        kept = Path(folder) / PARTIALS_DIR
        #: (uid, answer index) -> (data file, offset, length, prompt digest)
        self.entries: dict[tuple[str, int], tuple[Path, int, int, str]] = {}
        #: per data file this worker sees: how many answers and tokens it keeps
        self.files: dict[str, dict[str, int]] = {}
        for data in sorted(kept.glob("worker_*.jsonl")) if kept.is_dir() else []:
            counts = {"requests": 0, "tokens": 0}
            for uid, session, digest, offset, length, tokens in _index_of(data):
                self.entries[(uid, int(session))] = (data, int(offset), int(length), digest)
                counts["requests"] += 1
                counts["tokens"] += int(tokens)
            self.files[data.name] = counts
        self.continued = {"requests": 0, "tokens": 0}

    def __len__(self) -> int:
        return len(self.entries)

    def take(self, uid: str, session: int, prompt_digest: str) -> dict[str, Any] | None:
        """The kept output of this answer, read from its file, if its prompt is the one it was generated for (a
        later turn's prompt: generated anew); None otherwise. Blocking file I/O: call it in a thread."""
        entry = self.entries.pop((uid, int(session)), None)
        if entry is None or entry[3] != prompt_digest:
            return None
        path, offset, length, _ = entry
        with open(path, "rb") as handle:
            handle.seek(offset)
            partial = json.loads(handle.read(length))
        self.continued["requests"] += 1
        self.continued["tokens"] += len(partial["tokens"])
        return partial


#: This worker process's view of the checkpoint it resumed from; None when it did not resume, or after the first
#: step (verl re-issues the groups in flight at once, so by then every answer that could continue has asked).
_KEPT: dict[str, KeptOutputs | None] = {"kept": None}


def node_name() -> str:
    """This process's node: Ray's node id where Ray runs, else the host name."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # no Ray here (a unit test's process): the host names the node
        pass
    return socket.gethostname()


def prepare_resume(marker: str | None, folder: str | None) -> dict[str, Any]:
    """One agent-loop worker at startup (called by the trainer on each before any request): whether it sees the
    driver's ``marker`` file (the checkpoint folder is shared with the driver's node), and, on a resume from
    ``folder``, the kept outputs it can read from here. Returns ``{"node", "sees_marker", "files"}``."""
    _KEPT["kept"] = KeptOutputs(folder) if folder is not None else None
    kept = _KEPT["kept"]
    return {
        "node": node_name(),
        "sees_marker": None if marker is None else os.path.exists(marker),
        "files": dict(kept.files) if kept is not None else {},
    }


def end_resume() -> dict[str, int]:
    """After the first step: drop this worker's view of the kept outputs; what of them it continued."""
    kept, _KEPT["kept"] = _KEPT["kept"], None
    return dict(kept.continued) if kept is not None else {"requests": 0, "tokens": 0}


async def take_resumed(uid: str, session: int, prompt_ids: list[int], media: str | None = None) -> PartialOutput | None:
    """A client's look for a kept output to continue: nothing at all in a run that did not resume; else a lookup
    in this worker's index and, for a kept answer, one line read from disk (in a thread: the loop goes on)."""
    kept = _KEPT["kept"]
    if kept is None or not kept.entries:
        return None
    digest = prompt_digest(list(prompt_ids), media)
    if (uid, int(session)) not in kept.entries:
        return None
    found = await asyncio.to_thread(kept.take, uid, session, digest)
    if found is None:
        return None
    return PartialOutput(
        prompt_digest=found["prompt_digest"],
        tokens=list(found["tokens"]),
        log_probs=list(found["log_probs"]),
        versions=list(found["versions"]),
        chunks=[list(chunk) for chunk in found["chunks"]],
        # A request still generating was cut once more by the resume; a finished one is taken as it was.
        interrupts=int(found["interrupts"]) + (found.get("stop_reason") is None),
        stop_reason=found.get("stop_reason"),
        routed_experts=decode_experts(found.get("routed_experts")),
    )


def finished_output(partial: PartialOutput, episode: Any) -> Any:
    """verl's ``TokenOutput`` of an answer that had finished before the checkpoint, as the client returned it then
    (the engine's own extra fields aside, which the trained record does not use)."""
    from verl.workers.rollout.replica import TokenOutput

    from areal_plugins.agent_loop.episodes import CHUNKS_FIELD, version_fields

    if episode is not None:
        episode.add_turn(partial.versions, partial.interrupts, partial.chunks)
    extra = version_fields(partial.versions) | {"num_interrupts": partial.interrupts}
    extra[CHUNKS_FIELD] = [list(chunk) for chunk in partial.chunks]
    extra.update(routed_experts_fields(partial.routed_experts))
    return TokenOutput(
        token_ids=list(partial.tokens),
        log_probs=list(partial.log_probs) if partial.log_probs else None,
        routed_experts=partial.routed_experts,  # verl's batch needs every answer's, or none
        stop_reason=partial.stop_reason,
        extra_fields=extra,
    )
