from __future__ import annotations

from pathlib import Path

import pytest

from areal_plugins.cli.cluster_env import with_ray_defaults
from areal_plugins.cli.progress import format_progress, parse_metrics, recipe_files, total_steps

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_parses_verl_console_metrics():
    fields = "critic/score/mean:0.25 - val-core/x/acc/mean@1:np.float64(0.5) - num_turns/min:np.int32(2) - a:b"
    assert parse_metrics(fields) == {"critic/score/mean": 0.25, "val-core/x/acc/mean@1": 0.5, "num_turns/min": 2.0}


def test_progress_line_shows_training_and_validation():
    fields = "critic/score/mean:0.25 - timing_s/step:11.04 - val-core/x/acc/mean@1:np.float64(0.5)"
    assert format_progress(15, "30", fields).splitlines() == [
        "step 15/30  reward=0.25  step_s=11",
        "validation after step 15: x/acc/mean@1=0.5",
    ]


def test_total_steps_from_overrides_or_the_shared_recipe_body():
    recipe = RECIPES / "grpo_cpu_async.yaml"
    assert [p.name for p in recipe_files(recipe)] == ["grpo_cpu_async.yaml", "_cpu_grpo_tiny.yaml"]
    assert total_steps(recipe, ["trainer.total_training_steps=7"]) == "7"
    assert total_steps(recipe, []) == "30"  # set in _cpu_grpo_tiny.yaml


def test_training_takes_any_built_workload_and_a_build_refuses_a_directory_of_another(tmp_path):
    import json

    from areal_plugins.cli.launch import ensure_tiny_assets

    (tmp_path / "BUILT.json").write_text(json.dumps({"workload": "longtail"}))
    assert ensure_tiny_assets(tmp_path) == tmp_path  # train --tiny-dir: use what is there
    assert ensure_tiny_assets(tmp_path, workload="longtail") == tmp_path
    with pytest.raises(SystemExit, match="holds the 'longtail' workload, not 'addition'"):
        ensure_tiny_assets(tmp_path, workload="addition")


def test_two_runs_started_at_once_on_one_folder_build_it_once(tmp_path, monkeypatch):
    """The second waits for the first's build and then uses it (two demos, or two test files, started at once)."""
    import json
    import threading
    import time

    from areal_plugins.cli import launch

    builds = []

    def slow_build(tiny_dir, workload):
        builds.append(workload)
        time.sleep(0.5)  # the other caller arrives while this one builds
        (tiny_dir / "BUILT.json").write_text(json.dumps({"workload": "addition"}))
        return tiny_dir

    monkeypatch.setattr(launch, "_build_tiny_assets", slow_build)
    folder = tmp_path / "tiny"
    results = []
    callers = [threading.Thread(target=lambda: results.append(launch.ensure_tiny_assets(folder))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert builds == [None] and results == [folder, folder]


def test_ray_task_event_cap_is_a_default_the_user_can_override():
    cap = "RAY_task_events_max_num_task_in_gcs"
    assert with_ray_defaults({"PATH": "/bin"}) == {"PATH": "/bin", cap: "10000"}
    assert with_ray_defaults({cap: "-1"})[cap] == "-1"  # the user's own setting (here: unlimited) wins


def test_ctrl_c_asks_for_a_checkpointed_stop_only_where_the_trainer_reads_the_request():
    from omegaconf import OmegaConf

    from areal_plugins.cli.launch import stops_with_a_checkpoint

    def config(**areal):
        return OmegaConf.create({"trainer": {"save_freq": 5}, **({"areal": areal} if areal else {})})

    assert stops_with_a_checkpoint(config(enable=True, mode="async"))
    assert not stops_with_a_checkpoint(config())  # a plain verl recipe: no areal node
    assert not stops_with_a_checkpoint(config(enable=False, mode="async"))  # verl's own trainers
    assert not stops_with_a_checkpoint(config(enable=True, mode="sync"))
    no_checkpoints = OmegaConf.create({"trainer": {"save_freq": -1}, "areal": {"enable": True, "mode": "async"}})
    assert not stops_with_a_checkpoint(no_checkpoints)
