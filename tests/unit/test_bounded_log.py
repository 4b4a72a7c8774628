"""train.log cannot fill a disk: repeated lines are counted, not written, and the file rotates."""

from __future__ import annotations

from areal_plugins.cli.bounded_log import BoundedLog, line_shape


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_error_is_written_a_few_times_then_counted(tmp_path):
    clock = FakeClock()
    path = tmp_path / "train.log"
    with BoundedLog(path, repeats_per_window=3, window_s=60, clock=clock) as log:
        for attempt in range(1000):  # the same error, only its numbers change
            log.write(f"(AgentLoopWorker pid=123{attempt}) ActorDiedError: actor {attempt:032x} died\n")
            log.write(f"step line {attempt}\n" if attempt == 500 else "")
        clock.now = 61.0
        log.write("a different line\n")
    lines = path.read_text().splitlines()
    assert len([line for line in lines if "ActorDiedError" in line and "[areal-plugins]" not in line]) == 3
    summary = [line for line in lines if line.startswith("[areal-plugins] 997 more lines like this one in 60 s")]
    assert len(summary) == 1 and "ActorDiedError" in summary[0]
    assert "step line 500" in lines and lines[-1] == "a different line"
    assert log.suppressed_total == 997


def test_every_distinct_line_is_kept():
    assert line_shape("step:12 - loss:0.5") == line_shape("step:13 - loss:0.7")
    assert line_shape("step:12") != line_shape("validation done")


def test_the_log_rotates_at_its_size_limit_keeping_one_older_copy(tmp_path):
    path = tmp_path / "train.log"
    with BoundedLog(path, max_bytes=1000, repeats_per_window=10**9) as log:
        for index in range(300):
            log.write(f"line {index:04d} of a long run\n")  # 25 bytes each: 7,500 bytes in all
    assert path.stat().st_size <= 1000 and (tmp_path / "train.log.1").stat().st_size <= 1000
    assert path.read_text().splitlines()[-1] == "line 0299 of a long run"
    assert not (tmp_path / "train.log.2").exists()
