"""Interruptions made by construction, for tests: only the first prompt groups of each weight version finish.

Whether a weight update finds a request mid-generation is a matter of timing: on a fast machine every answer of
the tiny model ends before the trainer gets round to the update, and nothing is cut. A test that needs cuts (a
replay of interrupted trajectories, a checkpoint that keeps requests in flight) sets
``engine_kwargs.areal_cpu.finish_groups_per_version: N``: under each weight version the engine decodes to the end the
requests of the first ``N`` prompt groups it is asked for, and stops every other request after
``hold_others_at_token`` tokens of its current request, holding it (out of the running batch, its KV cache kept)
until the request is aborted or new weights are loaded. With ``N`` at least the trainer's batch of groups
(``data.train_batch_size``), the trainer always gets its batch from the groups that finish, so the held ones are in
flight when the update comes, on any machine, and nothing waits on them.

A group is the set of requests asked with the same prompt (GRPO's ``rollout.n`` answers of one prompt). A request
continued after an interruption arrives as prompt + partial output (under a new request id: verl's client draws one
per call), and a later turn of an episode as the whole conversation so far: each keeps the group whose prompt it
starts with. (Every prompt ends with the chat template's assistant header, so no fresh prompt starts with another.)
The engine keeps every group's prompt for its lifetime: a few kB per group, for test runs.

verl's ``vllm`` server holds requests the same way (rollout/verl_vllm/server.py: vLLM's scheduler is verl's, so the
server cuts a held request's ``max_tokens`` and waits for the next abort), asked by
``actor_rollout_ref.rollout.custom.areal_finish_groups_per_version: N`` and ``areal_hold_others_at_token``
(:func:`holds_from_custom`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: ``rollout.custom.<this>: N`` (verl's ``vllm``): under each weight version only the first ``N`` prompt groups'
#: requests finish; every other request stops after ``areal_hold_others_at_token`` tokens (default 1) and is held
#: until the next abort, which returns it as aborted with those tokens.
FINISH_GROUPS_KEY = "areal_finish_groups_per_version"
HOLD_AT_TOKEN_KEY = "areal_hold_others_at_token"


class FinishFirstGroups:
    """Which requests of a weight version run to the end and which are held.

    Args:
        groups_per_version: groups (distinct first prompts) per weight version whose requests finish.
        hold_at_token: tokens a held request generates (in its current request) before it is held; >= 1, so a
            held request always has output of this version to cut.
    """

    def __init__(self, groups_per_version: int, hold_at_token: int = 1) -> None:
        if groups_per_version < 1:
            raise ValueError(
                "actor_rollout_ref.rollout.engine_kwargs.areal_cpu.finish_groups_per_version must be >= 1 "
                f"(at least data.train_batch_size, else the trainer waits for held groups), got {groups_per_version}"
            )
        if hold_at_token < 1:
            raise ValueError(
                "actor_rollout_ref.rollout.engine_kwargs.areal_cpu.hold_others_at_token must be >= 1 (a held request "
                f"needs output to cut), got {hold_at_token}"
            )
        self.groups_per_version = groups_per_version
        self.hold_at_token = hold_at_token
        # The groups' prompts, by their media's digest and their length.
        self._groups: dict[str, dict[int, set[tuple[int, ...]]]] = {}
        self._finishing: set[tuple[str, tuple[int, ...]]] = set()  # groups that finish under the weights served now

    def new_version(self) -> None:
        """New weights are served: the next groups asked for are the ones that finish."""
        self._finishing.clear()

    def group_of(self, prompt_ids: list[int], media: str = "") -> tuple[str, tuple[int, ...]]:
        """The group a request asked with ``prompt_ids`` belongs to (a new group's: its own prompt). ``media``: a digest
        of the request's images, which tell apart prompts of one text (a picture's placeholders are the same tokens
        whatever the picture)."""
        groups = self._groups.setdefault(media, {})
        for length in sorted(groups):
            if length <= len(prompt_ids) and (prefix := tuple(prompt_ids[:length])) in groups[length]:
                return media, prefix
        group = tuple(prompt_ids)
        groups.setdefault(len(group), set()).add(group)
        return media, group

    def holds(self, prompt_ids: list[int], media: str = "") -> bool:
        """Whether a request asked with ``prompt_ids`` (and images of digest ``media``) is to be held under the
        weights served now."""
        group = self.group_of(prompt_ids, media)
        if group in self._finishing:
            return False
        if len(self._finishing) < self.groups_per_version:
            self._finishing.add(group)
            return False
        return True


def finish_first_groups(groups_per_version: Any, hold_at_token: Any = 1) -> FinishFirstGroups | None:
    """The holds a server's options ask for (``areal_cpu``'s ``finish_groups_per_version`` and
    ``hold_others_at_token``), or None when ``groups_per_version`` is None: every request runs to its end."""
    if groups_per_version is None:
        return None
    return FinishFirstGroups(int(groups_per_version), int(hold_at_token))


def holds_from_custom(custom: Mapping[str, Any]) -> FinishFirstGroups | None:
    """The holds verl's ``vllm`` server's ``rollout.custom`` asks for (:data:`FINISH_GROUPS_KEY`,
    :data:`HOLD_AT_TOKEN_KEY`), or None: every request runs to its end."""
    return finish_first_groups(custom.get(FINISH_GROUPS_KEY), custom.get(HOLD_AT_TOKEN_KEY, 1))
