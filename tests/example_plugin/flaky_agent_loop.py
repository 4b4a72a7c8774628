"""A verl agent loop that fails the first attempt of the first few prompts it sees (test-only).

Registered the way verl documents custom loops: a YAML list given to
``actor_rollout_ref.rollout.agent.agent_loop_config_path`` whose entries are instantiated by Hydra
with their extra keys (``marker_dir``, ``failures``) as constructor arguments. Markers on disk count
attempts across verl's agent-loop worker processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


class FailFirstAttemptAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn loop, except that the first attempt of the first ``failures`` prompts raises."""

    def __init__(self, *args: Any, marker_dir: str, failures: int, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marker_dir = Path(marker_dir)
        self.failures = failures

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        uid = str(kwargs["uid"])
        if kwargs.get("session_id", 0) == 0 and self._first_attempt_to_fail(uid):
            raise RuntimeError(f"deliberate failure of the first attempt of prompt {uid}")
        return await super().run(sampling_params, **kwargs)

    def _first_attempt_to_fail(self, uid: str) -> bool:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        marker = self.marker_dir / uid
        if marker.exists() or len(os.listdir(self.marker_dir)) >= self.failures:
            return False
        try:  # exclusive create: two workers cannot both claim a failure
            marker.touch(exist_ok=False)
        except FileExistsError:
            return False
        return len(os.listdir(self.marker_dir)) <= self.failures
