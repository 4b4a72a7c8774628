"""A rollout server actor's concurrency: every request the trainer can have in flight, plus slots for control calls.

A Ray actor runs at most ``max_concurrency`` calls at once, and a ``generate`` call parked behind a closed gate
(during a weight update) holds its slot. verl sizes a server as max(1000, max_num_seqs + 16); at the paper's scale
(512 prompts x 16 answers, η = 4: up to ~41,000 requests in flight, all of which may land on one server) the parked
requests alone fill that, and the call that would let them go (``resume_generation``, ``wake_up``) never starts.
The async trainer knows its bound on requests in flight (admission), so its servers get that many slots plus
:data:`CONTROL_SLOTS`. (Ray's concurrency groups would separate the two, but they run each group on an event loop
of its own, which verl's vLLM server and our gate, bound to one loop, cannot take.)
"""

from __future__ import annotations

from typing import Any

#: Slots beyond every request in flight: abort, resume, sleep, wake-up, the weight update and its RPCs, statistics.
CONTROL_SLOTS = 64
#: Slots of one of our own servers when no bound is known: verl's own trainers drive it (sync, colocate_async,
#: separate_async), and their requests in flight are theirs to count. verl 0.9.1's colocate_async at 128 prompts
#: x 16 holds ~4,000 (255 groups) and parks them at the gate during its weight update, whose call then never got
#: a slot of verl's 1,000 (measured with areal_paced: the run hung in actor_rollout_update_weights). Our servers
#: are asyncio actors: Ray counts their slots, and a parked request holds a coroutine (and a fiber of Ray's
#: worker), not a thread; unused slots cost nothing.
UNBOUNDED_SLOTS = 1 << 16

_requests_in_flight = {"bound": 0}


def bound_requests_in_flight(requests: int) -> None:
    """Called by the trainer in its driver before the servers are built: its bound on requests in flight."""
    _requests_in_flight["bound"] = max(0, int(requests))


def server_concurrency(verl_default: int, when_unbounded: int | None = None) -> int:
    """``max_concurrency`` of a server actor: verl's, or the bound on requests in flight plus control slots;
    ``when_unbounded`` instead of the bound when the async trainer set none (verl's own trainers)."""
    bound = _requests_in_flight["bound"]
    if bound == 0 and when_unbounded is not None:
        return max(int(verl_default), int(when_unbounded))
    return max(int(verl_default), bound + CONTROL_SLOTS)


def bound_requests_from_config(config: Any) -> int:
    """Requests in flight the trainer of ``config`` can have at most: prompt groups admitted at once (the async
    trainer's ``areal.max_concurrent_rollouts``, else (η + 1) x batch; a synchronous step's batch) x answers each."""
    from omegaconf import OmegaConf

    from areal_plugins.config.settings import areal_settings

    batch = int(OmegaConf.select(config, "data.train_batch_size"))
    answers = int(OmegaConf.select(config, "actor_rollout_ref.rollout.n", default=1) or 1)
    settings = areal_settings(config)
    groups = settings.concurrent_rollouts(batch) if settings.mode == "async" else batch
    return groups * answers
