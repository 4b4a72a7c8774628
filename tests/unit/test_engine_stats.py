"""The engines' statistics: a slow answer is counted and skipped, never a reason to stop the run (no Ray)."""

from __future__ import annotations

import types

import pytest
import ray

from areal_plugins.driver import engine_stats
from areal_plugins.driver.engine_stats import EngineStats
from areal_plugins.records.writer import RunRecorder


class Server:
    def __init__(self, name: str, tokens: int) -> None:
        self._actor_id = types.SimpleNamespace(hex=lambda: name)
        self.tokens = tokens
        self.get_stats = types.SimpleNamespace(remote=lambda: self)


class Pool:
    def __init__(self, servers: list[Server]) -> None:
        self._servers = servers

    def servers(self) -> list[tuple[int, Server]]:
        return list(enumerate(self._servers))

    def survivable(self, key: str) -> bool:
        return False


@pytest.fixture
def answers(monkeypatch):
    """Each server answers after ``delay[name]`` seconds of a fake clock; ``ray.get`` times out past its limit."""
    now = [0.0]
    delay: dict[str, float] = {}
    asked: list[float] = []

    def get(server, timeout=None):
        asked.append(timeout)
        name = server._actor_id.hex()
        if timeout is not None and delay.get(name, 0.0) > timeout:
            now[0] += timeout
            raise ray.exceptions.GetTimeoutError("late")
        now[0] += delay.get(name, 0.0)
        return {"busy_s": 1.0, "generated_tokens": server.tokens, "in_flight": 2}

    monkeypatch.setattr(engine_stats.ray, "get", get)
    monkeypatch.setattr(engine_stats.time, "monotonic", lambda: now[0])
    return delay, asked


def test_a_server_slower_than_the_limit_keeps_its_last_counters_and_is_counted(tmp_path, answers):
    """watchdog_s 3600 (recipes/gpu/). First reading: no answer measured, limit 3600 s; both answer in 2 s and
    0.5 s (the slowest measured: 2.5 s since the calls went out). Limit then 10 x 2.5 = 25 s; a server taking
    40 s is skipped with its last counters (100 tokens), counted once, and the reading goes on."""
    delay, asked = answers
    servers = [Server("a", 100), Server("b", 50)]
    stats = EngineStats("areal_cpu", Pool(servers), RunRecorder(str(tmp_path)), watchdog_s=3600.0)
    delay.update(a=2.0, b=0.5)
    assert stats.read()["generated_tokens"] == 150
    assert asked[0] == 3600.0 and stats.slowest_s == 2.5
    assert stats.limit_s() == 25.0
    delay.update(a=40.0, b=0.0)
    servers[0].tokens, servers[1].tokens = 120, 60
    total = stats.read()  # no exception: the run goes on
    assert total["generated_tokens"] == 100 + 60
    assert stats.timeouts == 1 and asked[2] == 25.0


def test_the_limit_never_exceeds_the_watchdog(tmp_path, answers):
    delay, _ = answers
    stats = EngineStats("areal_cpu", Pool([Server("a", 1)]), RunRecorder(str(tmp_path)), watchdog_s=60.0)
    delay.update(a=30.0)
    stats.read()
    assert stats.limit_s() == 60.0  # 10 x 30 s would be 300 s
