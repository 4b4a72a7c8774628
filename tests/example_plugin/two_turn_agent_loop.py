"""A custom verl agent loop of two turns with a slow environment step between them (test-only).

Registered the way verl documents custom loops (a YAML list given to
``actor_rollout_ref.rollout.agent.agent_loop_config_path``; extra keys become constructor arguments).
Turn 1 generates up to ``first_tokens``; the environment step sleeps ``tool_seconds`` (so weight
updates land between turns) and answers with a fixed observation; turn 2 generates up to
``second_tokens`` (long enough to be interrupted inside the turn). On the first attempt of the first
``raising`` prompts the environment step raises; on the first attempt of the next ``hanging``
prompts it never returns. Every environment call is logged to ``calls_log`` (one JSON line with the
prompt's uid, the session and the episode id), so a test can count calls per episode.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

OBSERVATION = " observation"


class TwoTurnAgentLoop(AgentLoopBase):
    def __init__(
        self,
        *args: Any,
        calls_log: str,
        marker_dir: str,
        tool_seconds: float,
        first_tokens: int,
        second_tokens: int,
        raising: int = 0,
        hanging: int = 0,
        name: str | None = None,
        tools: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.calls_log = Path(calls_log)
        self.marker_dir = Path(marker_dir)
        self.tool_seconds = tool_seconds
        self.first_tokens, self.second_tokens = first_tokens, second_tokens
        self.raising, self.hanging = raising, hanging

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        episode = uuid4().hex
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        limit = {"max_tokens": self.first_tokens}
        first = await self.server_manager.generate(
            request_id=episode, prompt_ids=prompt_ids, sampling_params=sampling_params | limit
        )
        observation = await self._environment(str(kwargs["uid"]), int(kwargs.get("session_id", 0)), episode)
        context = prompt_ids + first.token_ids + observation
        second = await self.server_manager.generate(
            request_id=episode, prompt_ids=context, sampling_params=sampling_params | {"max_tokens": self.second_tokens}
        )
        response = first.token_ids + observation + second.token_ids
        mask = [1] * len(first.token_ids) + [0] * len(observation) + [1] * len(second.token_ids)
        logprobs = list(first.log_probs) + [0.0] * len(observation) + list(second.log_probs)
        length = self.rollout_config.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response[:length],
            response_mask=mask[:length],
            response_logprobs=logprobs[:length],
            num_turns=3,
            metrics={},
            extra_fields={"test_episode_id": episode},
        )

    async def _environment(self, uid: str, session: int, episode: str) -> list[int]:
        with self.calls_log.open("a") as handle:
            handle.write(json.dumps({"uid": uid, "session": session, "episode": episode}) + "\n")
        fault = self._fault_of_first_attempt(uid) if session == 0 else None
        if fault == "raise":
            raise RuntimeError(f"deliberate environment failure in prompt {uid}")
        if fault == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(self.tool_seconds)
        return self.tokenizer.encode(OBSERVATION, add_special_tokens=False)

    def _fault_of_first_attempt(self, uid: str) -> str | None:
        """ "raise" or "hang" for the first attempt of the first prompts (claimed by marker files), else None."""
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        if (self.marker_dir / uid).exists() or len(os.listdir(self.marker_dir)) >= self.raising + self.hanging:
            return None
        try:
            (self.marker_dir / uid).touch(exist_ok=False)
        except FileExistsError:
            return None
        claimed = len(os.listdir(self.marker_dir))
        if claimed <= self.raising:
            (self.marker_dir / uid).write_text("raise")
            return "raise"
        if claimed <= self.raising + self.hanging:
            (self.marker_dir / uid).write_text("hang")
            return "hang"
        return None
