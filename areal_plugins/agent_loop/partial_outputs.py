"""Requests in flight kept across a checkpoint: their output so far, so that a resumed run continues them.

Each agent-loop worker's rollout client keeps the output so far of every request it is generating, by episode
answer (verl's prompt uid and answer index): :data:`IN_FLIGHT`. An answer that finished stays there, marked with
its stop reason, until its whole group has (verl re-issues a group in flight as a whole: its finished answers are
taken back as they were, not generated again). At a checkpoint every worker writes its own into
``areal_partials/worker_<i>.jsonl`` beside verl's files (nothing passes through the driver: at scale this is
gigabytes). When a run resumes, the trainer starts one actor holding what that file
saved, before any request is made; verl re-issues the prompts that were in flight under their uids, and a request of
the same uid, answer index and prompt takes its saved output and asks the engine only for the rest: its tokens keep
the versions they were generated under, and the resume counts as one more interruption (docs/faults.md,
Requests in flight at a checkpoint).

Without this, verl regenerates every in-flight prompt from scratch on resume (as SkyRL and slime do).
"""

from __future__ import annotations

import json
import logging
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_plugins.core.trajectory_rows import token_digest

logger = logging.getLogger(__name__)

#: The folder a checkpoint keeps them in, in verl's ``global_step_N/``: one JSON-lines file per agent-loop worker.
PARTIALS_DIR = "areal_partials"
RESUMED_NAME = "areal_resumed_partials"


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


def snapshot_in_flight() -> list[dict[str, Any]]:
    """This worker's answers with output, of groups not settled (called on its event loop: a consistent copy;
    shallow list copies, not ``dataclasses.asdict``, which deep-copies every number)."""
    return [
        {
            "uid": uid,
            "session": session,
            "prompt_digest": partial.prompt_digest,
            "tokens": list(partial.tokens),
            "log_probs": list(partial.log_probs),
            "versions": list(partial.versions),
            "chunks": [list(chunk) for chunk in partial.chunks],
            "interrupts": partial.interrupts,
            "stop_reason": partial.stop_reason,
        }
        for uid, answers in IN_FLIGHT.items()
        for session, partial in answers.items()
        if partial.tokens or partial.stop_reason is not None
    ]


def write_partials(folder: str, worker: int, partials: list[dict[str, Any]]) -> dict[str, int]:
    """Write one worker's kept outputs into the checkpoint ``folder``; how many answers and tokens."""
    path = Path(folder) / PARTIALS_DIR / f"worker_{worker}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_suffix(".partial")
    with open(written, "w") as handle:
        for partial in partials:
            handle.write(json.dumps(partial) + "\n")
    written.replace(path)  # whole or not at all
    return {"requests": len(partials), "tokens": sum(len(p["tokens"]) for p in partials)}


def save_partials(folder: str, workers: list[Any]) -> dict[str, int]:
    """Every agent-loop worker writes its kept outputs into ``folder``; how many answers and tokens in all."""
    import ray

    counts = ray.get([worker.areal_save_partials.remote(folder, index) for index, worker in enumerate(workers)])
    return {key: sum(count[key] for count in counts) for key in ("requests", "tokens")}


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
    """What a checkpoint kept, all workers' together; None for a checkpoint written without it."""
    kept = Path(folder) / PARTIALS_DIR
    if not kept.is_dir():
        return None
    return [
        json.loads(line)
        for path in sorted(kept.glob("worker_*.jsonl"))
        for line in path.read_text().splitlines()
        if line
    ]


class ResumedPartials:
    """Ray actor: the outputs a checkpoint saved, each taken at most once by the request that continues it. Built
    from a list (tests) or the checkpoint folder, which the actor reads itself (the driver never holds them)."""

    def __init__(self, partials: list[dict[str, Any]] | str) -> None:
        if isinstance(partials, str):
            partials = read_partials(partials) or []
        self.partials = {(p["uid"], int(p["session"])): p for p in partials}
        self.saved = {"requests": len(partials), "tokens": sum(len(p["tokens"]) for p in partials)}
        self.continued = {"requests": 0, "tokens": 0}

    def take(self, uid: str, session: int, prompt_digest: str) -> dict[str, Any] | None:
        """The saved output of this answer, if its prompt is the one it was generated for; "empty" when none is
        left (the caller stops asking)."""
        if not self.partials:
            return {"empty": True}
        partial = self.partials.pop((uid, session), None)
        if partial is None or partial["prompt_digest"] != prompt_digest:  # another turn's prompt: generate anew
            return None
        self.continued["requests"] += 1
        self.continued["tokens"] += len(partial["tokens"])
        return partial

    def counts(self) -> dict[str, dict[str, int]]:
        return {"saved": self.saved, "continued": self.continued}


def start_resumed(folder: str) -> Any | None:
    """The actor holding ``folder``'s saved outputs (started before any request is made); None without any. The
    trainer stops it after the first step: verl re-issues the groups in flight at once, so by then every answer
    that could continue a kept output has asked (one left over would cost every later request a call)."""
    import ray

    kept = Path(folder) / PARTIALS_DIR
    if not kept.is_dir() or not any(path.stat().st_size for path in kept.glob("worker_*.jsonl")):
        return None
    logger.info("areal: answers in flight at the checkpoint continue from their kept output (%s)", kept)
    return ray.remote(ResumedPartials).options(name=RESUMED_NAME, num_cpus=0).remote(str(folder))


def finished_output(partial: PartialOutput, episode: Any) -> Any:
    """verl's ``TokenOutput`` of an answer that had finished before the checkpoint, as the client returned it then
    (the engine's own extra fields aside, which the trained record does not use)."""
    from verl.workers.rollout.replica import TokenOutput

    from areal_plugins.agent_loop.episodes import version_fields
    from areal_plugins.core.trajectory_rows import CHUNKS_FIELD

    if episode is not None:
        episode.add_turn(partial.versions, partial.interrupts, partial.chunks)
    extra = version_fields(partial.versions) | {"num_interrupts": partial.interrupts}
    extra[CHUNKS_FIELD] = [list(chunk) for chunk in partial.chunks]
    return TokenOutput(
        token_ids=list(partial.tokens),
        log_probs=list(partial.log_probs) if partial.log_probs else None,
        stop_reason=partial.stop_reason,
        extra_fields=extra,
    )


_resumed: dict[str, Any] = {}


async def take_resumed(uid: str, session: int, prompt_ids: list[int]) -> PartialOutput | None:
    """A client's look for a saved output to continue: one lookup of the actor per process, then one call per
    request (with its prompt's digest) until the actor has none left; nothing at all in a run that did not resume."""
    import ray

    if "actor" not in _resumed:
        try:
            _resumed["actor"] = ray.get_actor(RESUMED_NAME)
        except ValueError:
            _resumed["actor"] = None
    actor = _resumed["actor"]
    if actor is None:
        return None
    try:
        found = await actor.take.remote(uid, session, token_digest(list(prompt_ids)))
    except ray.exceptions.RayActorError:  # stopped after the first step: nothing more to continue
        _resumed["actor"] = None
        return None
    if found is None:
        return None
    if found.get("empty"):
        _resumed["actor"] = None
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
    )
