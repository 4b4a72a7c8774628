"""The reward's time limit follows the answer's length; rewards lost to timeouts are warned about past a share."""

from __future__ import annotations

import logging
import threading

import pytest

from areal_plugins.config.settings import ArealConfigError, RewardConfig
from areal_plugins.rewards.service import RewardService


def service(timeout_s: float = 10.0, timeout_chars: int | None = 4096, share: float = 0.01) -> RewardService:
    made = object.__new__(RewardService)  # no worker processes: only the limit and the counts are tested
    made.timeout_s, made.timeout_chars, made.warn_timeout_share = timeout_s, timeout_chars, share
    made.timed_out, made._warned, made._lock = 0, False, threading.Lock()
    made.counts = {"calls": 0, "failures": 0, "timeouts": 0, "crashes": 0}
    return made


def test_a_16k_token_answer_gets_more_than_the_short_answers_limit():
    """A 7B run's 16k-token answer is ~64k characters (4 per token): 10 s x 65,536 / 4,096 = 160 s."""
    scorer = service()
    assert scorer.limit_s(("gsm8k", "x" * 100, "42")) == 10.0  # short answers: timeout_s
    assert scorer.limit_s(("gsm8k", "x" * 65_536, "42")) == pytest.approx(160.0)
    assert service(timeout_chars=None).limit_s(("gsm8k", "x" * 65_536, "42")) == 10.0


def test_the_warning_comes_once_the_share_lost_to_timeouts_passes_the_setting(caplog):
    """warn_timeout_share 1%: judged from 100 calls on. 1 lost in 100 is 1% (not past it); a second lost at
    call 150 is 2/150 = 1.3%: warned, once."""
    scorer = service()
    caplog.set_level(logging.WARNING)
    scorer.counts["calls"] = 99
    scorer._lost_to_timeout()  # call 100: 1 of 100
    assert "timed out" not in caplog.text
    scorer.counts["calls"] = 149
    scorer._lost_to_timeout()  # call 150: 2 of 150
    assert "2 of 150 rewards were 0 because scoring timed out" in caplog.text
    scorer.counts["calls"] = 199
    caplog.clear()
    scorer._lost_to_timeout()
    assert caplog.text == ""


def test_bad_settings_name_the_yaml_path():
    with pytest.raises(ArealConfigError, match=r"areal\.reward\.timeout_chars"):
        RewardConfig(timeout_chars=0)
    with pytest.raises(ArealConfigError, match=r"areal\.reward\.warn_timeout_share"):
        RewardConfig(warn_timeout_share=1.5)
