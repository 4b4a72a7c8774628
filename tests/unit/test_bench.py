"""The benchmark's arithmetic (tools/bench.py): what it counts, and the bounds it compares against."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.tool_scripts import load_tool

bench = load_tool("bench")


def test_busy_cores_over_the_counted_steps():
    # (monotonic s, machine busy CPU s, steps finished): step 1 ends by t = 1, step 3 by t = 5; in between
    # the machine was busy 8 CPU-s in 4 s -> 2 cores.
    samples = [(0.0, 0.0, 0), (1.0, 0.5, 1), (3.0, 4.5, 1), (5.0, 8.5, 3), (6.0, 9.0, 3)]
    assert bench.busy_cores(samples, first_step=1, last_step=3) == pytest.approx(2.0)
    assert bench.busy_cores(samples, first_step=1, last_step=4) is None  # step 4 never finished
    assert bench.busy_cores(samples[:1], first_step=1, last_step=3) is None


def test_cpu_by_role_counts_each_process_from_the_first_counted_step():
    # (steps finished, pid -> (role, CPU s)). Between step 1 and step 3: the engine 7 - 2 s, the trainer worker
    # 4 - 1 s; an agent-loop worker started meanwhile counts all its 1.5 s; a pid reused by another role
    # counts from zero (0.5 s); the reward worker gone by the last sample counts to its last one (2.5 - 2 s).
    samples = [
        (0, {10: ("CPURolloutServer", 1.0)}),
        (1, {10: ("CPURolloutServer", 2.0), 11: ("WorkerDict", 1.0), 12: ("raylet", 3.0), 14: ("Reward", 2.0)}),
        (2, {10: ("CPURolloutServer", 5.0), 11: ("WorkerDict", 3.0), 14: ("Reward", 2.5)}),
        (3, {10: ("CPURolloutServer", 7.0), 11: ("WorkerDict", 4.0), 12: ("IDLE", 0.5), 13: ("WorkerDict", 1.5)}),
        (3, {10: ("CPURolloutServer", 9.0)}),  # after the counted steps: not counted
    ]
    roles = bench.cpu_by_role(samples, first_step=1, last_step=3)
    assert roles == {"CPURolloutServer": 5.0, "WorkerDict": 4.5, "IDLE": 0.5, "Reward": 0.5}
    assert bench.cpu_by_role(samples, first_step=1, last_step=4) is None


def test_process_roles_from_ray_titles_and_command_lines():
    assert bench.process_role(["ray::CPURolloutServer.generate"]) == "CPURolloutServer"
    assert bench.process_role(["ray::TaskRunnerV1"]) == "TaskRunnerV1"
    assert bench.process_role(["ray::IDLE"]) == "IDLE"
    assert bench.process_role(["/x/.venv/bin/python", "-m", "areal_plugins.cli", "train"]) == "driver"
    assert bench.process_role(["/x/ray/core/src/ray/raylet/raylet", "--flag"]) == "raylet"
    assert bench.process_role([]) == "other"


def step(gen: float, total: float, tokens: int, reward: float) -> dict:
    return {
        "timing_s/gen": gen,
        "timing_s/step": total,
        "perf/total_num_tokens": tokens,
        "critic/score/mean": reward,
        "response_length/mean": 3.0,
        "response_length/max": 9.0,
        "prompt_length/mean": 17.0,
    }


def test_measure_skips_step_one_and_reads_the_phases(tmp_path):
    rows = [step(50.0, 60.0, 999, 0.0), step(3.0, 4.0, 200, 0.1), step(1.0, 4.0, 200, 0.2), step(2.0, 4.0, 200, 0.3)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "data": r}) + "\n" for i, r in enumerate(rows))
    )
    figures = bench.measure(tmp_path)
    assert figures["wall_s"] == 12.0 and figures["trained_tokens"] == 600  # step 1 (start-up) not counted
    assert figures["s_per_1k_tokens"] == pytest.approx(20.0)
    assert (figures["gen_s_median"], figures["train_s_median"]) == (2.0, 2.0)
    # Per step (gen + train) / max: 4/3, 4/3, 4/2 -> median 4/3.
    assert figures["overlap_bound"] == pytest.approx(4 / 3)
    assert figures["final_reward"] == pytest.approx(0.2)  # the last 3 steps' mean
    assert figures["trajectories_per_step"] == pytest.approx(10.0)  # 200 tokens / (17 + 3) per trajectory
    assert figures["trained_trajectories"] == 30  # 3 counted steps of 10
    # Two warm-up steps: steps 3 and 4 counted, 8 s for 400 tokens.
    later = bench.measure(tmp_path, warmup_steps=2)
    assert (later["wall_s"], later["trained_tokens"], later["trained_trajectories"]) == (8.0, 400, 20)


def test_speedup_splits_into_less_work_and_busier_cores():
    # sync: 10 s per 1k tokens on 1.5 busy cores = 15 CPU-s; async: 5 s on 2.0 cores = 10 CPU-s.
    sync = [{"s_per_1k_tokens": 10.0, "busy_cores": 1.5, "cpu_s_per_1k_tokens": 15.0}]
    fast = [{"s_per_1k_tokens": 5.0, "busy_cores": 2.0, "cpu_s_per_1k_tokens": 10.0}]
    row = bench.summarise("async-separate-eta4", fast, sync)
    assert row["speedup"]["median"] == pytest.approx(2.0)
    assert row["speedup_from_less_work"]["median"] == pytest.approx(1.5)  # 15 / 10 CPU-s
    assert row["speedup_from_busier_cores"]["median"] == pytest.approx(4 / 3)  # 2.0 / 1.5 cores: 1.5 x 4/3 = 2


def test_a_sweep_names_the_second_loss_mode():
    plan = bench.configs([4], ["separate"], ["loglinear", "recompute"], sync_poll_s=0.05)
    assert [c.name for c in plan] == ["sync", "async-separate-eta4", "async-separate-eta4-recompute"]
    assert "areal.loss.prox_logp=recompute" in plan[2].overrides


def test_a_step_of_b_groups_of_n_is_one_mini_batch_in_every_row():
    assert bench.batch_overrides(128, 16) == [
        "data.train_batch_size=128",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.rollout.n=16",
    ]
    assert bench.batch_overrides(None, None) == []
    with pytest.raises(SystemExit, match="at least 2"):
        bench.batch_overrides(8, 1)


def test_verls_async_modes_run_on_the_sync_recipe_with_the_same_polling():
    plan = bench.configs([4], ["colocated"], ["recompute"], 0.05, ["colocate_async", "separate_async"])
    assert [c.name for c in plan] == ["sync", "verl-colocate_async", "verl-separate_async", "async-colocated-eta4"]
    polling = "+trainer.v1.sampler.sampler_kwargs.poll_interval_s=0.05"
    for config in plan[:3]:
        assert config.recipe == "grpo_cpu_sync.yaml" and polling in config.overrides
    assert "trainer.v1.trainer_mode=colocate_async" in plan[1].overrides
    separate = plan[2].overrides
    assert "trainer.v1.separate_async.parameter_sync_step=1" in separate  # one optimizer step per batch
    assert "actor_rollout_ref.rollout.checkpoint_engine.backend=areal_gloo" in separate


def test_a_concurrency_sweep_names_its_limit():
    plan = bench.configs([4], ["colocated"], ["recompute"], 0.05, [], [None, 16])
    assert [c.name for c in plan] == ["sync", "async-colocated-eta4", "async-colocated-eta4-mcr16"]
    assert "areal.max_concurrent_rollouts=16" in plan[2].overrides
    assert not [o for o in plan[1].overrides if "max_concurrent" in o]


def test_a_micro_batch_budget_reaches_verls_rows_and_ours_under_their_own_keys():
    plan = bench.configs([1], ["colocated"], ["recompute"], 0.05, ["colocate_async"], [None], [None, 512])
    names = [c.name for c in plan]
    assert names == [
        "sync",
        "verl-colocate_async",
        "verl-colocate_async-mb512",
        "async-colocated-eta1",
        "async-colocated-eta1-mb512",
    ]
    verl_budget = plan[2].overrides
    assert "actor_rollout_ref.actor.use_dynamic_bsz=true" in verl_budget
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512" in verl_budget
    assert "areal.micro_batch.max_tokens=512" in plan[4].overrides
    for fixed in (plan[0], plan[1]):  # verl's recipe has fixed micro-batches: no budget anywhere
        assert not [o for o in fixed.overrides if "dynamic_bsz" in o or "max_tokens" in o or "token_len" in o]
    # Ours: the async recipes ship a 512-token budget, so "fixed" has to switch it off to be fixed.
    assert "areal.micro_batch.max_tokens=null" in plan[3].overrides
    assert [c.micro_batching for c in plan] == ["fixed", "fixed", "budget 512", "fixed", "budget 512"]


def test_a_signal_to_the_bench_stops_its_current_run_and_the_bench(tmp_path):
    """SIGTERM to the bench goes on to its ``train`` child (which stops verl); the bench waits for it and exits."""
    import signal
    import subprocess
    import sys
    import time

    child_log = tmp_path / "child.log"
    child = tmp_path / "train_like.py"  # stands for `areal-plugins train`: stops itself on SIGTERM
    child.write_text(
        "import signal, sys, time\n"
        "def stop(*_):\n"
        f"    open({str(child_log)!r}, 'w').write('stopped')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    script = tmp_path / "bench_like.py"
    script.write_text(
        "import subprocess, sys\n"
        f"sys.path.insert(0, {str(bench.__file__).rsplit('/tools/', 1)[0]!r})\n"
        "from tests.unit.tool_scripts import load_tool\n"
        "bench = load_tool('bench')\n"
        f"child = subprocess.Popen([sys.executable, {str(child)!r}], stdout=subprocess.PIPE, text=True)\n"
        "child.stdout.readline()\n"
        "with bench.forwarding_signals(child):\n"
        "    print('child ready', flush=True)\n"
        "    child.communicate()\n"
    )
    repo = str(bench.__file__).rsplit("/tools/", 1)[0]
    process = subprocess.Popen([sys.executable, str(script)], cwd=repo, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "child ready"
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 30
    assert child_log.read_text() == "stopped"  # the child got the signal and stopped itself


def test_the_gpu_shaped_workload_names_the_case_its_scales_and_the_scaled_cap():
    """The paper's answers are capped at 27,648 tokens: 27,648 / 64 = 432 at the default scale."""
    overrides = bench.gpu_shaped_overrides("paper-1.5b", 1 / 64, 8.5)
    key = "++actor_rollout_ref.rollout.engine_kwargs.areal_paced"
    assert overrides == [
        f"{key}.case=paper-1.5b",
        f"{key}.length_scale=0.015625",
        f"{key}.time_scale=8.5",
        "data.max_response_length=432",
    ]
    _, base = bench.WORKLOADS["gpu-shaped"]
    assert "actor_rollout_ref.rollout.name=areal_paced" in base and not any("tokens_per_s" in o for o in base)


def gpu_shaped_bench(
    tmp_path, monkeypatch, *extra: str, cores_seen: list | None = None
) -> tuple[list[tuple[str, Path, list[str]]], dict]:
    """tools/bench.py --workload gpu-shaped with every run faked: (config, run directory, overrides) per run, and
    each run's ``trainer_cores`` appended to ``cores_seen``."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "BUILT.json").write_text(json.dumps({"workload": "addition"}))
    runs: list[tuple[str, Path, list[str]]] = []

    def fake_run(
        config, steps, repeat, seed, out_dir, tiny_dir, workload_overrides, warmup_steps=1, trainer_cores=None
    ):
        runs.append((config.name, out_dir, list(workload_overrides + config.overrides)))
        if cores_seen is not None:
            cores_seen.append(trainer_cores)
        return {"s_per_1k_tokens": 1.0, "step_s_median": 1.0, "final_reward": 0.0, "wall_s": 10.0,
                "overlap_bound": 1.5, "train_s_median": 2.5, "prompt_len_mean": 20.0}  # fmt: skip

    monkeypatch.setattr(bench, "run_one", fake_run)
    monkeypatch.setattr(bench, "plot", lambda bench_json, out: None)
    argv = ["--workload", "gpu-shaped", "--steps", "3", "--repeats", "1", "--etas", "2", "--placements",
            "separate", "--tiny-dir", str(tiny), "--out", str(tmp_path / "out"), *extra]  # fmt: skip
    assert bench.main(argv) == 0
    return runs, json.loads((tmp_path / "out" / "bench.json").read_text())


def test_the_gpu_shaped_bench_measures_the_trainer_first_and_runs_every_row_at_that_time_scale(tmp_path, monkeypatch):
    from areal_bench.gpu_shaped import StandInShape, case, time_scale_for

    runs, result = gpu_shaped_bench(tmp_path, monkeypatch)
    (calibration, *rows) = runs
    assert calibration[0] == "sync" and calibration[1] == tmp_path / "out" / "calibrate"
    assert any(o.endswith("areal_paced.time_scale=1.0") for o in calibration[2])
    # The measured 2.5 s trainer step, the recipes' 16 x 8 batch, 20-token prompts, one engine.
    expected = time_scale_for(case("paper-1.5b"), 2.5, StandInShape(16, 8, 20, 1 / 64))
    assert result["time_scale"]["time_scale"] == pytest.approx(expected.time_scale)
    assert result["time_scale"]["stated"] == expected.describe()
    assert [name for name, _, _ in rows] == ["sync", "async-separate-eta2"]
    for _, _, overrides in rows:
        assert f"++actor_rollout_ref.rollout.engine_kwargs.areal_paced.time_scale={expected.time_scale!r}" in overrides


def test_a_given_trainer_step_skips_the_measurement(tmp_path, monkeypatch):
    runs, result = gpu_shaped_bench(tmp_path, monkeypatch, "--trainer-step-s", "4.0", "--prompts-per-step", "4")
    assert [name for name, _, _ in runs] == ["sync", "async-separate-eta2"]
    assert result["time_scale"]["trainer_step_s"] == 4.0
    with pytest.raises(SystemExit):
        bench.main(["--workload", "addition", "--trainer-step-s", "4.0"])


def test_trainer_cores_reach_every_run_the_calibration_included_and_its_threads(tmp_path, monkeypatch):
    cores: list = []
    runs, result = gpu_shaped_bench(tmp_path, monkeypatch, "--trainer-cores", "1", cores_seen=cores)
    assert [name for name, _, _ in runs] == ["sync", "sync", "async-separate-eta2"]  # the calibration first
    assert cores == [1, 1, 1] and result["trainer_cores"] == 1
    for _, _, overrides in runs:  # the trainer's threads: its one core, not every core
        assert "++ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS='1'" in overrides
    with pytest.raises(SystemExit):  # a step measured on shared cores cannot size a pinned bench
        bench.main(["--workload", "gpu-shaped", "--trainer-cores", "1", "--trainer-step-s", "4.0"])


def test_tuned_verl_rows_and_other_splits_and_one_budget_for_every_row():
    plan = bench.configs([2], ["separate"], ["recompute"], 0.05, ["separate_async"], [None], [512], 2.0, [3])
    assert [c.name for c in plan] == [
        "sync",
        "verl-separate_async",
        "verl-separate_async-tuned",
        "async-separate-eta2",
        "async-separate-eta2-engines3",
    ]
    for config in plan[:3]:  # one budget: the synchronous row and verl's train with the same micro-batches
        assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512" in config.overrides
        assert config.micro_batching == "budget 512"
    assert "trainer.v1.separate_async.num_warmup_batches=2.0" in plan[2].overrides
    assert not [o for o in plan[1].overrides if "num_warmup_batches" in o]
    split = plan[4].overrides
    assert "actor_rollout_ref.rollout.n_gpus_per_node=3" in split and "ray_kwargs.ray_init.num_gpus=4" in split
    assert "areal.max_staleness=2" in split


def test_each_bench_row_maps_to_the_simulator_mode_it_is_predicted_with():
    import bench_vs_planner as planner

    assert planner.row_mode("sync", []) is None
    assert planner.row_mode("async-separate-eta4", []) == ("separate", 4.0, 1)
    assert planner.row_mode("async-separate-eta2-engines3", []) == ("separate", 2.0, 3)
    assert planner.row_mode("async-colocated-eta1", []) == ("colocated", 1.0, 1)
    tuned = ["trainer.v1.colocate_async.num_warmup_batches=2.0"]
    assert planner.row_mode("verl-colocate_async-tuned", tuned) == ("colocated", 2.0, 1)
    assert planner.row_mode("verl-separate_async", []) == ("separate", 1.0, 1)  # verl's default: 1 batch ahead
    with pytest.raises(ValueError, match="no simulator mode"):
        planner.row_mode("async-separate-eta2-mb512", [])


def test_the_physical_limit_is_the_slower_side_separate_and_the_sum_colocated(monkeypatch):
    """Hand count: sync steps 6 s of which the trainer 3 s; the engines alone need 2 s a step. Separate, a step
    cannot beat max(3, 2) = 3 s (2x sync); colocated, 3 + 2 = 5 s (1.2x)."""
    import bench_vs_planner as planner

    monkeypatch.setattr(planner, "generation_bound_step_s", lambda bench_json, engines=1: 2.0)
    monkeypatch.setattr(planner, "simulated_step_s", lambda bench_json, mode, train: 6.0 if mode is None else 4.0)

    def row(name, speedup):
        return {"config": name, "step_s_median": {"median": 6.0 / speedup}, "train_s_median": {"median": 3.0},
                "speedup": {"median": speedup, "min": speedup, "max": speedup}}  # fmt: skip

    result = planner.compare({"rows": [row("sync", 1.0) | {"speedup": None}, row("async-separate-eta2", 1.5),
                                       row("async-colocated-eta2", 1.1)]})  # fmt: skip
    by = {r["config"]: r for r in result["rows"]}
    assert by["async-separate-eta2"]["limit_speedup"] == pytest.approx(2.0)
    assert by["async-separate-eta2"]["of_limit"] == pytest.approx(0.75)
    assert by["async-colocated-eta2"]["limit_speedup"] == pytest.approx(1.2)
    assert by["async-separate-eta2"]["predicted_speedup"] == pytest.approx(1.5)  # 6 s / 4 s
    assert by["async-separate-eta2"]["within_tolerance"] and not by["async-colocated-eta2"]["within_tolerance"]


def test_the_gpu_shaped_trainer_gets_every_core_in_every_placement():
    plan = bench.configs([2], ["separate"], ["recompute"], 0.05, ["separate_async"])
    threads = f"++ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS='{os.cpu_count()}'"
    for config in map(bench.trainer_owns_the_cores, plan):
        assert config.overrides[-1] == threads
        assert sum("OMP_NUM_THREADS" in o for o in config.overrides) == 1, config.overrides


def test_a_smaller_engine_reaches_the_stand_in_the_time_scale_and_the_planner(tmp_path, monkeypatch):
    from areal_bench.gpu_shaped import StandInShape, case, time_scale_for

    key = "++actor_rollout_ref.rollout.engine_kwargs.areal_paced"
    assert f"{key}.kv_capacity_tokens=1500.0" in bench.gpu_shaped_overrides("paper-1.5b", 1 / 64, 2.0, 1500.0)
    assert not any("kv_capacity" in o for o in bench.gpu_shaped_overrides("paper-1.5b", 1 / 64, 2.0))
    runs, result = gpu_shaped_bench(tmp_path, monkeypatch, "--kv-capacity-tokens", "1500")
    # A smaller cache generates a step more slowly at time scale 1: the scale that keeps the case's ratio is smaller.
    expected = time_scale_for(case("paper-1.5b"), 2.5, StandInShape(16, 8, 20, 1 / 64, 1, 1500.0))
    full = time_scale_for(case("paper-1.5b"), 2.5, StandInShape(16, 8, 20, 1 / 64))
    assert result["time_scale"]["time_scale"] == pytest.approx(expected.time_scale)
    assert expected.time_scale < full.time_scale
    assert result["kv_capacity_tokens"] == 1500.0
    assert all(f"{key}.kv_capacity_tokens=1500.0" in overrides for _, _, overrides in runs)


def test_our_rows_run_with_each_in_flight_policy_and_the_ablation_is_named():
    plan = bench.configs([2], ["separate"], ["recompute"], 0.05, ["separate_async"], in_flights=["interrupt", "wait"])
    ours = {c.name: c.overrides for c in plan if c.eta is not None}
    assert list(ours) == ["async-separate-eta2", "async-separate-eta2-wait"]
    assert "areal.weight_update.in_flight=interrupt" in ours["async-separate-eta2"]
    assert "areal.weight_update.in_flight=wait" in ours["async-separate-eta2-wait"]
    verl_rows = [c for c in plan if c.eta is None]
    assert not any("in_flight" in o for c in verl_rows for o in c.overrides)  # verl's rows: our key means nothing


def staleness_run(run_dir: Path, samples: list[dict] | None, worst: list[float]) -> None:
    """A run directory: 3 steps of verl's metrics with ``worst`` as trajectory_staleness_worst (and 0.5 below it
    as trajectory_staleness), and ``samples`` as our areal_samples.jsonl."""
    run_dir.mkdir(parents=True)
    rows = []
    for i, head in enumerate(worst):
        data = step(1.0, 2.0, 100, 0.0) | {"timing_s/wait_in_flight": float(i)}
        for key, value in (("trajectory_staleness", head - 0.5), ("trajectory_staleness_worst", head)):
            data |= {f"training/off_policy/{key}/mean": value, f"training/off_policy/{key}/max": value + 1}
        rows.append({"step": i + 1, "data": data})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if samples is not None:
        (run_dir / "areal_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def test_every_row_gets_the_same_staleness_figures_and_an_old_verl_run_its_head_only(tmp_path):
    # ours: step 2 trains from version 1 a trajectory of 2 tokens of version 0 and 2 of version 1; step 3 from
    # version 2 one of 4 tokens of version 2. Per token (2 x 1 + 6 x 0) / 8; heads (1 + 0) / 2.
    samples = [
        {"step": 1, "trainer_version": 0, "chunks": [[0, 0, None]], "response_tokens": 4},  # warm-up
        {"step": 2, "trainer_version": 1, "chunks": [[0, 0, None], [2, 1, None]], "response_tokens": 4},
        {"step": 3, "trainer_version": 2, "chunks": [[0, 2, None]], "response_tokens": 4},
    ]
    staleness_run(tmp_path / "ours", samples, [9.0, 2.0, 4.0])
    ours = bench.staleness_figures(tmp_path / "ours", 1)
    assert ours["token_staleness_mean"] == pytest.approx(0.25) and ours["head_staleness_mean"] == 0.5
    assert ours["staleness_source"] == "areal_samples.jsonl"
    # verl's own metrics, steps 2 and 3: means (2 + 4) / 2, max 5; its lower bound 0.5 below
    assert ours["verl_trajectory_staleness_worst"] == 3.0 and ours["verl_trajectory_staleness_worst_max"] == 5.0
    assert ours["verl_trajectory_staleness"] == 2.5
    staleness_run(tmp_path / "old-verl", None, [9.0, 2.0, 4.0])  # no per-trajectory record
    old = bench.staleness_figures(tmp_path / "old-verl", 1)
    assert (old["head_staleness_mean"], old["head_staleness_max"]) == (3.0, 5.0) and "token_staleness_mean" not in old
    assert old["staleness_source"] == "metrics.jsonl (head only)"
    assert bench.measure(tmp_path / "ours")["wait_in_flight_s_median"] == 1.5  # steps 2 and 3 waited 1 s and 2 s


def test_an_earlier_benchs_staleness_is_recomputed_from_its_run_directories(tmp_path, capsys):
    samples = [{"step": 2, "trainer_version": 3, "chunks": [[0, 1, None]], "response_tokens": 2}]
    staleness_run(tmp_path / "async-separate-eta2-r0", samples, [0.0, 2.0, 2.0])
    staleness_run(tmp_path / "sync-r0", None, [0.0, 0.0, 0.0])
    old_row = {"s_per_1k_tokens": 10.0, "staleness_mean": 2.0}
    runs = {"sync": [{"s_per_1k_tokens": 20.0}], "async-separate-eta2": [dict(old_row), dict(old_row)]}
    rows = [{"config": "sync", "recipe": "r.yaml"}, {"config": "async-separate-eta2", "recipe": "a.yaml"}]
    (tmp_path / "bench.json").write_text(json.dumps({"warmup_steps": 1, "runs": runs, "rows": rows}))
    assert bench.main(["--recompute-staleness", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    ours = next(row for row in result["rows"] if row["config"] == "async-separate-eta2")
    # repeat 0 recomputed (2 tokens, 3 - 1 = 2 each); repeat 1's directory is gone: kept as it was, no figure
    assert ours["token_staleness_mean"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 1}
    assert ours["speedup"]["median"] == 2.0 and ours["recipe"] == "a.yaml"
    assert result["rows"][0]["head_staleness_mean"]["median"] == 0.0
    out = capsys.readouterr().out
    assert "| async-separate-eta2 | 100 | - | 2.00 | 2 |" in out and "async-separate-eta2-r1" in out
    assert "per trained response token T - v" in out  # the definition, under the table
