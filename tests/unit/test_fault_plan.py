"""The tests' fault and speed plan (areal_plugins/testing/faults.py): each variable's form, parsed by hand here, a
malformed value refused naming its variable, the one question each engine asks, and no other module reading them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from areal_plugins.testing import faults
from areal_plugins.testing.faults import (
    CORRUPT_LOADED_ENV,
    CORRUPT_RECEIVED_ENV,
    DROP_RECEIVED_ENV,
    ENGINE_STEP_DELAY_ENV,
    RENAME_RECEIVED_ENV,
    TRAINER_MICROBATCH_DELAY_ENV,
    FaultPlan,
    FromUpdate,
    fault_plan,
)
from areal_plugins.testing.holds import FINISH_GROUPS_KEY, HOLD_AT_TOKEN_KEY, holds_from_custom

REPO = Path(__file__).resolve().parents[2]
VARIABLES = (
    CORRUPT_RECEIVED_ENV,
    DROP_RECEIVED_ENV,
    RENAME_RECEIVED_ENV,
    CORRUPT_LOADED_ENV,
    ENGINE_STEP_DELAY_ENV,
    TRAINER_MICROBATCH_DELAY_ENV,
)


def test_the_variables_names_are_the_ones_the_tests_and_docs_set():
    assert VARIABLES == (
        "AREAL_CORRUPT_RECEIVED_WEIGHT",
        "AREAL_DROP_RECEIVED_WEIGHT",
        "AREAL_RENAME_RECEIVED_WEIGHT",
        "AREAL_CORRUPT_LOADED_WEIGHT",
        "AREAL_TEST_ENGINE_STEP_DELAY_S",
        "AREAL_TEST_TRAINER_MICROBATCH_DELAY_S",
    )


def test_no_variable_set_is_a_plan_that_changes_nothing():
    assert FaultPlan.parse({}) == FaultPlan.parse(dict.fromkeys(VARIABLES, "")) == FaultPlan()
    plan = FaultPlan()
    assert plan.engine_step_delay_s == 0.0 and plan.trainer_microbatch_delay_s == 0.0
    assert plan.loaded_target(1) is None
    sent = [("a", torch.tensor([1.0]))]
    assert plan.received(sent, 7) == sent and plan.received(sent, 7)[0][1] is sent[0][1]


def test_each_variables_form():
    plan = FaultPlan.parse(
        {
            CORRUPT_RECEIVED_ENV: "model.norm.weight@4",
            DROP_RECEIVED_ENV: "a.weight,b.bias@2",
            RENAME_RECEIVED_ENV: "v.lora_A=k.lora_A,v.lora_B=k.lora_B",
            CORRUPT_LOADED_ENV: "lm_head.weight",
            ENGINE_STEP_DELAY_ENV: "0.05",
            TRAINER_MICROBATCH_DELAY_ENV: " 0.5\n",  # a shell's stray whitespace
        }
    )
    assert plan == FaultPlan(
        corrupt_received=FromUpdate("model.norm.weight", 4),
        drop_received=FromUpdate(frozenset({"a.weight", "b.bias"}), 2),
        rename_received=FromUpdate((("v.lora_A", "k.lora_A"), ("v.lora_B", "k.lora_B")), 1),
        corrupt_loaded=FromUpdate("lm_head.weight", 1),
        engine_step_delay_s=0.05,
        trainer_microbatch_delay_s=0.5,
    )


def test_a_fault_starts_at_its_update_and_stays():
    # NAME@3: updates 1 and 2 untouched, 3 and every later one faulted.
    fault = FromUpdate("w", 3)
    assert [fault.at(update) for update in (1, 2, 3, 4, 10)] == [None, None, "w", "w", "w"]
    plan = FaultPlan.parse({CORRUPT_LOADED_ENV: "w@3"})
    assert [plan.loaded_target(update) for update in (1, 2, 3, 4)] == [None, None, "w", "w"]


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        (CORRUPT_RECEIVED_ENV, "w@x"),  # K not a number
        (CORRUPT_RECEIVED_ENV, "w@0"),  # updates count from 1
        (CORRUPT_RECEIVED_ENV, "w@"),
        (CORRUPT_RECEIVED_ENV, "@2"),  # no tensor named
        (CORRUPT_RECEIVED_ENV, "a,b"),  # one tensor only
        (CORRUPT_RECEIVED_ENV, "w@2@3"),
        (CORRUPT_LOADED_ENV, "w@1.5"),
        (DROP_RECEIVED_ENV, "a,,b"),
        (DROP_RECEIVED_ENV, "a,@2"),
        (DROP_RECEIVED_ENV, "a@-1"),
        (RENAME_RECEIVED_ENV, "a"),  # not NAME=OTHER
        (RENAME_RECEIVED_ENV, "a=b,c"),
        (RENAME_RECEIVED_ENV, "=b"),
        (RENAME_RECEIVED_ENV, "a="),
        (ENGINE_STEP_DELAY_ENV, "fast"),
        (ENGINE_STEP_DELAY_ENV, "-1"),
        (ENGINE_STEP_DELAY_ENV, "nan"),
        (ENGINE_STEP_DELAY_ENV, "inf"),
        (TRAINER_MICROBATCH_DELAY_ENV, "-0.5"),
    ],
)
def test_a_malformed_value_is_refused_naming_its_variable_and_value(variable, value):
    with pytest.raises(ValueError, match=rf"^{variable}={re.escape(repr(value))}: .*; set it to .*, or unset it$"):
        FaultPlan.parse({variable: value})


def test_what_arrives_drops_renames_then_corrupts_a_copy():
    # a is renamed to x, and x (its name on arrival) is corrupted: its first value 1 -> 2; b is lost; c untouched.
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([[5.0, 6.0], [7.0, 8.0]])
    plan = FaultPlan.parse({DROP_RECEIVED_ENV: "b", RENAME_RECEIVED_ENV: "a=x", CORRUPT_RECEIVED_ENV: "x"})
    arrived = plan.received([("a", a), ("b", b), ("c", c)], update=1)
    assert [name for name, _ in arrived] == ["x", "c"]
    assert arrived[0][1].tolist() == [2.0, 2.0]
    assert a.tolist() == [1.0, 2.0], "the sender's tensor keeps what was sent"
    assert arrived[1][1] is c


def test_what_arrives_before_a_faults_first_update_is_what_was_sent():
    sent = [("a", torch.tensor([1.0])), ("b", torch.tensor([2.0]))]
    plan = FaultPlan.parse({DROP_RECEIVED_ENV: "a@2", RENAME_RECEIVED_ENV: "b=c@3", CORRUPT_RECEIVED_ENV: "b@2"})
    assert [(n, t.tolist()) for n, t in plan.received(sent, 1)] == [("a", [1.0]), ("b", [2.0])]
    assert [(n, t.tolist()) for n, t in plan.received(sent, 2)] == [("b", [3.0])]  # a lost, b corrupted
    assert [(n, t.tolist()) for n, t in plan.received(sent, 3)] == [("c", [2.0])]  # b now arrives as c
    assert [t.tolist() for _, t in sent] == [[1.0], [2.0]]


def test_the_plan_is_read_from_the_environment_once_and_again_when_it_changes(monkeypatch):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert fault_plan() == FaultPlan()
    assert fault_plan() is fault_plan()  # parsed once
    monkeypatch.setenv(CORRUPT_RECEIVED_ENV, "w@2")
    assert fault_plan().corrupt_received == FromUpdate("w", 2)
    assert fault_plan() is fault_plan()
    monkeypatch.setenv(TRAINER_MICROBATCH_DELAY_ENV, "slow")
    with pytest.raises(ValueError, match=TRAINER_MICROBATCH_DELAY_ENV):  # whatever the question, the plan is refused
        fault_plan()


def test_the_vllm_servers_holds_come_from_its_custom_keys():
    assert FINISH_GROUPS_KEY == "areal_finish_groups_per_version"
    assert HOLD_AT_TOKEN_KEY == "areal_hold_others_at_token"
    assert holds_from_custom({}) is None
    holds = holds_from_custom({FINISH_GROUPS_KEY: 16})
    assert holds is not None and (holds.groups_per_version, holds.hold_at_token) == (16, 1)
    holds = holds_from_custom({FINISH_GROUPS_KEY: "2", HOLD_AT_TOKEN_KEY: "3"})
    assert holds is not None and (holds.groups_per_version, holds.hold_at_token) == (2, 3)


def python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in (REPO / folder).rglob("*.py")]


def test_no_module_outside_testing_reads_a_test_variable():
    """The plan is the one reader: outside ``areal_plugins/testing/`` no module names a variable as a string of its
    own or imports the plan's constants to read one."""
    testing = REPO / "areal_plugins" / "testing"
    constants = {name for name in dir(faults) if name.endswith("_ENV")}
    offending = []
    for path in python_files("areal_plugins", "patches"):
        if path.is_relative_to(testing):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in VARIABLES:
                offending.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value}")
            if isinstance(node, ast.ImportFrom) and node.module == faults.__name__:
                offending += [
                    f"{path.relative_to(REPO)}:{node.lineno}: {a.name}" for a in node.names if a.name in constants
                ]
    assert offending == []


def test_the_scan_finds_a_module_that_reads_a_test_variable():
    # The check above on a made-up module: a string equal to a variable's name is found.
    tree = ast.parse('import os\nDELAY = os.environ.get("AREAL_TEST_ENGINE_STEP_DELAY_S", "")\n')
    assert [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in VARIABLES] == [
        "AREAL_TEST_ENGINE_STEP_DELAY_S"
    ]


def test_a_worker_that_asks_the_plan_imports_neither_pytest_nor_the_kit():
    code = (
        "import sys, areal_plugins.testing.faults as f; f.fault_plan(); "
        "print(sorted(m for m in ('pytest', 'areal_plugins.testing.buffer_kit', 'areal_plugins.testing.fixtures') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_plugin_authors_fixtures_still_load_as_a_pytest_plugin(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["areal_plugins.testing"]\n')
    (tmp_path / "test_author.py").write_text(
        textwrap.dedent(
            """
            from areal_plugins.testing import ContractViolationError, check_sample_buffer, plugin_registered


            class Observer:
                pass


            def test_fixtures(areal_plugin_manager, registered_plugin):
                with registered_plugin(Observer(), name="observer"):
                    assert areal_plugin_manager.has_plugin("observer")
                assert not areal_plugin_manager.has_plugin("observer")
                assert issubclass(ContractViolationError, AssertionError) and callable(check_sample_buffer)
                assert callable(plugin_registered)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout
