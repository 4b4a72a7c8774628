from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from areal_plugins.records.writer import read_jsonl  # the tests import it from here

REPO = Path(__file__).resolve().parents[2]
TINY_DIR = REPO / ".areal" / "tiny"  # shared with the demo: built once per machine
CALCULATOR_DIR = REPO / ".areal" / "tiny_calculator"  # likewise, for the multi-turn recipe
MOE_DIR = REPO / ".areal" / "tiny_moe"  # likewise: the tiny Qwen2-MoE (4 experts, 2 per token, a shared expert)
#: A folder holding an example plugin and its .dist-info: on PYTHONPATH, it is an installed plugin.
EXAMPLE_PLUGIN_DIR = REPO / "tests" / "example_plugin"


def with_example_plugin(**extra: str) -> dict[str, str]:
    """Environment in which the example plugin is installed (for the run and its Ray workers)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE_PLUGIN_DIR), env.get("PYTHONPATH")) if p)
    return env


def run_cli_process(python: str, *args: str, timeout: int, env: dict[str, str] | None = None):
    """``python -m areal_plugins.cli ARGS`` from the repository, its output captured (``.venv`` or
    ``.venv-verl-vllm``'s interpreter)."""
    return subprocess.run(
        [python, "-m", "areal_plugins.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


def run_cli(*args: str, timeout: int = 900, env: dict[str, str] | None = None, check: bool = True):
    """Run ``areal-plugins`` as a user would; fail with its output on a non-zero exit if ``check``."""
    result = run_cli_process(sys.executable, *args, timeout=timeout, env=env)
    if check and result.returncode != 0:
        pytest.fail(f"areal-plugins {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def start_cli(*args: str, env: dict[str, str] | None = None):
    """Start ``areal-plugins`` in the background, in a process group of its own (the driver, verl and the
    Ray processes it starts), for tests that signal or kill it mid-run. Its terminal output goes to a file:
    :func:`cli_output` reads it for a failure message."""
    import tempfile

    output = tempfile.NamedTemporaryFile(prefix="areal-cli-", suffix=".out", delete=False)
    process = subprocess.Popen(
        [sys.executable, "-m", "areal_plugins.cli", *args],
        cwd=REPO,
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    process.output_path = Path(output.name)  # type: ignore[attr-defined]
    output.close()
    return process


def cli_output(process, last: int = 3000) -> str:
    """The end of what a run started by :func:`start_cli` printed (its error line, when it failed)."""
    return process.output_path.read_text(errors="replace")[-last:]


def run_processes(cli) -> list:
    """Every process of the run started by ``cli``: its descendants (verl's driver, Ray's head processes and the
    workers they spawned) and whatever left the tree but kept its process group (``start_cli`` gives it one)."""
    import os

    import psutil

    members = {p.pid: p for p in psutil.Process(cli.pid).children(recursive=True)}
    for process in psutil.process_iter():
        try:
            if process.pid not in members and os.getpgid(process.pid) == cli.pid:
                members[process.pid] = process
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return list(members.values())


def sigkill_processes_running(name: str, at_most: int | None = None) -> int:
    """SIGKILL every process (or the first ``at_most``, by pid) whose command line holds ``name`` (a Ray actor's
    title, e.g. ``ray::WorkerDict``); how many were killed."""
    import signal

    import psutil

    found = [p for p in psutil.process_iter(["cmdline"]) if name in " ".join(p.info["cmdline"] or [])]
    found = sorted(found, key=lambda process: process.pid)[:at_most]
    for process in found:
        process.send_signal(signal.SIGKILL)
    return len(found)


def kill_tree(process) -> None:
    """SIGKILL a run started by :func:`start_cli` and every process of it (verl, Ray, engines): a crash.
    Other processes on the machine (another Ray cluster included) are left alone."""
    import psutil

    try:
        members = [*run_processes(process), psutil.Process(process.pid)]
    except psutil.NoSuchProcess:
        members = []
    for member in members:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    run_cli("build-tiny", "--out", str(TINY_DIR))
    return TINY_DIR


@pytest.fixture(scope="session")
def calculator_dir() -> Path:
    run_cli("build-tiny", "--workload", "calculator", "--out", str(CALCULATOR_DIR))
    return CALCULATOR_DIR


@pytest.fixture(scope="session")
def moe_dir() -> Path:
    run_cli("build-tiny", "--workload", "moe", "--out", str(MOE_DIR), timeout=1800)
    return MOE_DIR


def train_args(recipe: str, run_dir: Path, tiny_dir: Path, steps: int, *overrides: str) -> list[str]:
    """``areal-plugins train`` arguments for ``steps`` steps of ``recipe`` without validation."""
    return [
        "train",
        str(REPO / "recipes" / recipe),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        *overrides,
        "--run-dir",
        str(run_dir),
        "--tiny-dir",
        str(tiny_dir),
    ]


def train_tiny(
    recipe: str, run_dir: Path, tiny_dir: Path, steps: int, *overrides: str, env: dict[str, str] | None = None
) -> list[dict]:
    """Train ``recipe`` for ``steps`` steps without validation; return the per-step metrics."""
    import json

    run_cli(*train_args(recipe, run_dir, tiny_dir, steps, *overrides), env=env)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["data"] for line in lines if line.strip()]


def consumed_by_step(run_dir: Path) -> dict[int, Counter]:
    """What each step trained, from verl's dump of every trained sample: (input, output) text -> count."""
    by_step: dict[int, Counter] = {}
    for path in (run_dir / "rollouts").glob("*.jsonl"):
        for record in read_jsonl(path):
            by_step.setdefault(record["step"], Counter())[(record["input"], record["output"])] += 1
    return by_step


def assert_same_samples_each_step(sync_run: Path, eta0_run: Path) -> None:
    """η = 0 trained, step by step, exactly the samples synchronous verl trained (verl's dumps of both runs)."""
    sync, eta0 = consumed_by_step(sync_run), consumed_by_step(eta0_run)
    assert sorted(sync) == list(range(1, SYNC_STEPS + 1))
    for step in sync:
        assert eta0[step] == sync[step], f"step {step}: different samples"


def assert_float32_losses_match(sync_steps: list[dict], eta0_steps: list[dict]) -> None:
    """Per step (verl's metrics ``data``), the same scores, and the loss and gradient norm of verl's vanilla PPO
    against our decoupled objective with w = π_prox/π_behav ≈ 1 within float32 drift."""
    assert len(sync_steps) == len(eta0_steps)
    for a, b in zip(sync_steps, eta0_steps, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-3, abs=1e-5)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-3)


def differing_fraction_by_step(sync_run: Path, eta0_run: Path) -> dict[int, float]:
    """Per step, the fraction of synchronous verl's trained samples that the η = 0 run did not train."""
    sync, eta0 = consumed_by_step(sync_run), consumed_by_step(eta0_run)
    assert sorted(sync) == sorted(eta0) == list(range(1, SYNC_STEPS + 1)), (sorted(sync), sorted(eta0))
    return {step: 1 - sum((eta0[step] & sync[step]).values()) / sum(sync[step].values()) for step in sync}


def assert_bf16_pair_trains_the_same_samples(sync_run: Path, eta0_run: Path) -> dict[int, float]:
    """η = 0 against synchronous verl in bf16 (the ``tool_runs`` pair). Step 1 starts from the same weights with
    the same seeds: the same samples. From step 2 the two runs' weights differ by bf16 noise (test_gpu_numerics.py),
    and a token sampled near a tie between two tokens may flip: measured 1 sample of 128 at step 2 on an AVX2-only
    machine, none on an AVX-512 one. At least 90% must be the same. Returns the differing fraction per step."""
    differing = differing_fraction_by_step(sync_run, eta0_run)
    assert differing[1] == 0, f"step 1: {differing[1]:.1%} of the samples differ"
    for step, fraction in differing.items():
        assert fraction <= 0.1, f"step {step}: {fraction:.1%} of the samples differ"
    return differing


def assert_within_staleness_bound(samples: list[dict], steps: list[dict], eta: int) -> None:
    """``areal.on_stale: wait`` (the default) bounds staleness by count at admission, not per sample
    (docs/design.md): a group older than η when taken is trained and counted (``areal/over_stale_trained``,
    cumulative). So every sample beyond η belongs to a counted group, and no sample is from the future."""
    staleness = [s["trainer_version"] - s["head_version"] for s in samples]
    assert staleness and min(staleness) >= 0
    over = {s["group"] for s, age in zip(samples, staleness, strict=True) if age > eta}
    assert len(over) == (steps[-1]["areal/over_stale_trained"] if steps else 0), "an over-stale group went uncounted"


# ---------------------------------------------------------------- runs shared by several test modules
# Each verl start costs 1.5-2.5 min on 2 cores: tests that can read the same run directory share one run.

#: Steps of the runs compared with synchronous verl (η = 0 and the plain sync checks).
SYNC_STEPS = 2
#: Steps of the observed async run: step 1 trains fresh samples, later steps stale ones (η = 2).
OBSERVED_STEPS = 3
#: Token budget of one micro-batch in the observed run: a few of its sequences (up to ~130 tokens each).
MICRO_BATCH_TOKENS = 512


@pytest.fixture(scope="session")
def distinct_prompts(tmp_path_factory) -> Path:
    """Training data without repeated prompts, so that GRPO groups are identified by their prompt."""
    import pandas as pd

    from areal_plugins.tiny.task import AdditionProblem, to_verl_row

    problems = [AdditionProblem(a, b) for a in range(10) for b in range(10)]
    path = tmp_path_factory.mktemp("distinct") / "train.parquet"
    pd.DataFrame([to_verl_row(p, "train", i) for i, p in enumerate(problems)]).to_parquet(path)
    return path


def run_with_dump(recipe: str, tiny_dir: Path, tmp_path_factory, data: Path, *overrides: str, env=None) -> Path:
    """``recipe`` for :data:`SYNC_STEPS` steps on ``data``, with verl's dump of every trained sample."""
    run_dir = tmp_path_factory.mktemp(recipe.split(".")[0])
    train_tiny(
        recipe,
        run_dir,
        tiny_dir,
        SYNC_STEPS,
        f"data.train_files={data}",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        *overrides,
        env=env,
    )
    return run_dir


@pytest.fixture(scope="session")
def long_response_model(tiny_dir, tmp_path_factory) -> Path:
    """The tiny tokenizer with random weights: it rarely says EOS, so responses run to the limit and
    weight updates find requests mid-generation."""
    from areal_plugins.tiny.model import TinyModelSpec, build_tiny_model

    out = tmp_path_factory.mktemp("random_model")
    build_tiny_model(out, TinyModelSpec(warmstart_steps=0))
    return out


#: The synchronous baseline's run directory once a test made it: its step times say how fast this machine is.
_BASELINE: dict[str, Path] = {}


@pytest.fixture(scope="session")
def sync_run(tiny_dir, distinct_prompts, tmp_path_factory) -> Path:
    """Synchronous verl with our features off (``grpo_cpu_sync``): the baseline every comparison uses."""
    _BASELINE["grpo_cpu_sync, float32"] = run_with_dump(
        "grpo_cpu_sync.yaml", tiny_dir, tmp_path_factory, distinct_prompts
    )
    return _BASELINE["grpo_cpu_sync, float32"]


def machine_speed_line(label: str, run_dir: Path) -> str | None:
    """The baseline's seconds per step (verl's ``timing_s/step``; the first step, which compiles, left out)."""
    import statistics

    times = [m["data"]["timing_s/step"] for m in read_jsonl(run_dir / "metrics.jsonl") if "timing_s/step" in m["data"]]
    if len(times) < 2:
        return None
    later = times[1:]
    return (
        f"machine speed: synchronous verl ({label}) {statistics.median(later):.2f} s per "
        f"step, median of steps 2-{len(times)} (range {min(later):.2f}-{max(later):.2f}); compare the tier's time "
        "with CONTRIBUTING.md's at the speed stated there"
    )


def pytest_terminal_summary(terminalreporter) -> None:
    """Every integration run says how fast its machine was, so its time can be read against another's."""
    for label, run_dir in _BASELINE.items():
        if (line := machine_speed_line(label, run_dir)) is not None:
            terminalreporter.write_line(line)


#: The observed run's settings, on the command line as a verl user adds them to verl's own recipe: every ``areal``
#: key with a leading + (the recipe has no ``areal: default`` in its defaults list; docs/guides/own_recipe.md).
OBSERVED_AREAL = ("+areal.enable=true", "+areal.max_staleness=2", f"+areal.micro_batch.max_tokens={MICRO_BATCH_TOKENS}")


@pytest.fixture(scope="session")
def observed_run(tiny_dir, tmp_path_factory):
    """A stock-shaped verl recipe (``tests/user_recipe.py:stock_recipe``: verl's ``ppo_trainer`` and our CPU body,
    every other key verl's default, so verl's default trainer engine ``fsdp``, FSDP1) plus :data:`OBSERVED_AREAL`
    (async, η = 2, token-budget micro-batches), with the example plugin observing and filtering. verl's composed
    config is kept in ``<run>/hydra/.hydra/config.yaml`` (``hydra.run.dir``).

    Returns the per-step metrics, the plugin's event log and the run directory.
    """
    import json
    import shutil

    from tests.user_recipe import stock_recipe

    tmp_path = tmp_path_factory.mktemp("observed")
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    shutil.copy(REPO / "recipes" / "_cpu_grpo_tiny.yaml", recipes)
    (recipes / "grpo_cpu_stock.yaml").write_text(stock_recipe())
    log = tmp_path / "observer.jsonl"
    run_dir = tmp_path / "run"
    args = train_args("grpo_cpu_async.yaml", run_dir, tiny_dir, OBSERVED_STEPS, *OBSERVED_AREAL)
    args[1] = str(recipes / "grpo_cpu_stock.yaml")
    args.insert(-4, f"hydra.run.dir={run_dir / 'hydra'}")
    env = with_example_plugin(AREAL_EXAMPLE_OBSERVER_LOG=str(log), AREAL_EXAMPLE_OBSERVER_MIN_REWARD="0.5")
    run_cli(*args, env=env)
    steps = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return steps, read_jsonl(log), run_dir


#: What GPU users run: bf16 mixed precision and packed sequences (the multi-turn pair runs with both on).
GPU_NUMERICS = (
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
)
#: Prompts a step of the bf16 pair (x 8 answers: 64 episodes a step): half the recipe's 16, since on a CPU without
#: bf16 instructions the pair's trainer computes bf16 through fp32 conversions (its setup took 296-367 s on an
#: AVX2-only box with 16). One differing sample is then 1.6% of a step, against the 10% allowed.
PAIR_PROMPTS = 8
PAIR_BATCH = (f"data.train_batch_size={PAIR_PROMPTS}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PAIR_PROMPTS}")


@pytest.fixture(scope="session")
def distinct_sums(tmp_path_factory) -> Path:
    """Calculator problems without repeats, so GRPO groups are identified by their prompt."""
    import pandas as pd

    from areal_plugins.tiny.calculator import calculator_row
    from areal_plugins.tiny.task import AdditionProblem

    problems = [AdditionProblem(a, b) for a in range(10, 90, 11) for b in range(12, 99, 7)]
    path = tmp_path_factory.mktemp("sums") / "train.parquet"
    pd.DataFrame([calculator_row(p, "train", i) for i, p in enumerate(problems)]).to_parquet(path)
    return path


@pytest.fixture(scope="session")
def tool_runs(calculator_dir, distinct_sums, tmp_path_factory) -> tuple[Path, Path, Path]:
    """Synchronous verl and ours at η = 0 on the calculator recipe (verl's tool_agent loop), both in bf16
    with packed sequences; ours with the episodes recorded. Multi-turn and GPU numerics share one pair:
    every verl start costs minutes of CI."""
    recipe = "grpo_cpu_async_calculator.yaml"
    pair = (*GPU_NUMERICS, *PAIR_BATCH)
    sync = run_with_dump(recipe, calculator_dir, tmp_path_factory, distinct_sums, "areal.enable=false", *pair)
    _BASELINE[f"calculator recipe, areal off, bf16 packed multi-turn, {PAIR_PROMPTS} prompts a step"] = sync  # CI's
    episodes = tmp_path_factory.mktemp("episodes") / "episodes.jsonl"
    env = with_example_plugin(AREAL_EXAMPLE_OBSERVER_EPISODES=str(episodes))
    overrides = ("areal.max_staleness=0", *pair)
    eta0 = run_with_dump(recipe, calculator_dir, tmp_path_factory, distinct_sums, *overrides, env=env)
    return sync, eta0, episodes


def assert_schedule_is_consistent(sample: dict, seeded: bool) -> None:
    """A trained sample's recorded requests (``chunks``: first token, version, seed) against its versions as the
    engine stamped them: they start at token 0 and in order, the first runs under the head version and the last
    under the tail version, one request more per interruption at most, and each has a seed where the engine seeds."""
    chunks = sample["chunks"]
    starts = [chunk[0] for chunk in chunks]
    assert starts and starts[0] == 0 and starts == sorted(set(starts)), sample
    assert starts[-1] < sample["response_tokens"], sample
    assert (chunks[0][1], chunks[-1][1]) == (sample["head_version"], sample["tail_version"]), sample
    assert len(chunks) - 1 <= sample["num_interrupts"] + sample.get("turns", 1) - 1, sample
    assert all((chunk[2] is not None) == seeded for chunk in chunks), sample
