"""The synchronous baseline's replay buffer: verl's own class, polling at the interval the bench asks for."""

from __future__ import annotations

from omegaconf import OmegaConf


def make(sampler_kwargs: dict):
    from areal_bench.baseline_sampler import PollingReplayBuffer

    return PollingReplayBuffer(
        trainer_mode="sync",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs=OmegaConf.create(sampler_kwargs),  # verl hands a DictConfig
        refill_fn=None,
    )


def test_polls_at_the_configured_interval_and_stays_verls_replay_buffer():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    buffer = make({"poll_interval_s": 0.25})
    assert isinstance(buffer, ReplayBuffer) and buffer.poll_interval == 0.25
    assert make({}).poll_interval == 0.05  # our async trainer's default poll
    assert ReplayBuffer.__init__.__defaults__ is not None and 2.0 in ReplayBuffer.__init__.__defaults__  # verl's
