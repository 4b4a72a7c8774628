"""tools/faults.py's reading of a run: which line is the stop message, and the table of docs/results/faults.md."""

from __future__ import annotations

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
           "processes_left": 0}  # fmt: skip
    table = faults.markdown_table({"cases": [row]}).splitlines()
    assert table[0] == "| killed | colocated |"
    assert table[2] == (
        "| our areal_cpu rollout server (Ray actor) | **stopped** in 9.1 s, exit 1, named; steps lost 0, "
        "log +126 kB, 0 processes left |"
    )
