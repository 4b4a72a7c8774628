"""tools/faults.py's reading of a run: which line is the stop message, and the table of docs/results/faults.md."""

from __future__ import annotations

import json

from tests.unit.tool_scripts import load_tool

faults = load_tool("faults")

LOG = """\x1b[36m(AgentLoopWorkerTQ pid=354)\x1b[0m ray.exceptions.ActorDiedError: The actor died unexpectedly
\x1b[36m(TaskRunnerV1 pid=12)\x1b[0m areal_plugins.RunActorDiedError: CPURolloutServer (pid 9) died
Error executing job with overrides: ['trainer.total_training_steps=8']
"""


def test_the_stop_message_is_ours_without_rays_prefix():
    assert faults.last_error(LOG).startswith("areal_plugins.RunActorDiedError: CPURolloutServer")
    # A class name only in Ray's "(Class pid=...)" prefix does not count as naming it.
    assert not any("AgentLoopWorkerTQ" in line for line in faults.stop_lines(LOG))


def test_the_table_has_a_row_per_case_and_a_column_per_placement():
    row = {"case": "rollout_server", "placement": "colocated", "outcome": "stopped", "seconds_to_end": 9.1,
           "exit_code": 1, "names_the_actor": True, "steps_lost": 0, "log_growth_bytes": 126603,
           "processes_left": 0, "restarts": 0}  # fmt: skip
    table = faults.markdown_table({"cases": [row]}).splitlines()
    assert table[0] == "| killed | colocated |"
    assert table[2] == (
        "| our areal_cpu rollout server (Ray actor) | **stopped** without a restart in 9.1 s, exit 1, named; "
        "steps lost 0, log +126 kB, 0 processes left |"
    )
    recovered = dict(row, outcome="recovered", exit_code=0, restarts=1, seconds_to_next_step=140.2,
                     seconds_to_end=201.0, groups_check="each group once", steps_lost=1)  # fmt: skip
    (line,) = faults.markdown_table({"cases": [recovered]}).splitlines()[2:]
    assert "**recovered** after 1 restart: next step 140.2 s after the kill, all 6 steps 201.0 s after it" in line
    earlier = {k: v for k, v in row.items() if k != "restarts"}  # a row measured before automatic resume
    (line,) = faults.markdown_table({"cases": [earlier]}).splitlines()[2:]
    assert "**stopped** (earlier run: 8 steps, no `--max-restarts`) in 9.1 s, exit 1, named" in line


def write_samples(run_dir, attempts: list[tuple[str, dict[int, list[str]]]]) -> None:
    lines = [
        json.dumps({"step": step, "attempt": attempt, "group": group})
        for attempt, steps in attempts
        for step, groups in steps.items()
        for group in groups
        for _answer in range(2)  # two samples a group, as a group of n answers writes n lines
    ]
    (run_dir / "areal_samples.jsonl").write_text("\n".join(lines) + "\n")


def test_the_groups_check_reads_each_step_from_the_last_attempt_that_trained_it(tmp_path, monkeypatch):
    monkeypatch.setattr(faults, "GROUPS_PER_STEP", 2)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    # Attempt a trains steps 1-3 and dies after the step-2 checkpoint; b redoes step 3, and g6, trained in the
    # lost step 3, comes back in step 4: once in the run that counts.
    first = ("a", {1: ["g1", "g2"], 2: ["g3", "g4"], 3: ["g5", "g6"]})
    write_samples(tmp_path, [first, ("b", {3: ["g5", "g7"], 4: ["g6", "g10"]})])
    assert faults.groups_check(tmp_path, steps=4) == "each group once"
    assert faults.steps_lost(tmp_path, exit_code=0) == 1  # step 3, trained twice
    # Had b trained step 2's groups again in step 4, they would count twice.
    write_samples(tmp_path, [first, ("b", {3: ["g7", "g8"], 4: ["g3", "g10"]})])
    assert faults.groups_check(tmp_path, steps=4) == "1 groups trained twice"
    write_samples(tmp_path, [first])
    assert faults.groups_check(tmp_path, steps=4) == "steps [4] not trained"
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    assert faults.steps_lost(tmp_path, exit_code=1) == 1  # a stopped run: step 3 was trained, not saved
    write_samples(tmp_path, [("a", {1: ["g1"], 2: ["g3", "g4"]})])
    assert faults.groups_check(tmp_path, steps=2) == "step 1 trained 1 groups, not 2"
