"""Loss code runs where the loss's tensors are: every tensor it creates names a device.

A tensor factory without ``device=`` builds a CPU tensor; mixed with the loss's CUDA tensors it fails on a GPU
(the CPU box cannot show that by running, so the source is read). ``*_like`` factories inherit the device.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "areal_plugins"
#: Every module that builds tensors inside a policy loss or its statistics.
LOSS_CODE = [
    PACKAGE / "core" / "losses.py",
    PACKAGE / "trainer_workers" / "policy_loss.py",
    *sorted((PACKAGE / "objectives").glob("*.py")),
]
FACTORIES = {"zeros", "ones", "arange", "full", "empty", "tensor", "as_tensor", "rand", "randn", "eye", "linspace"}


def factories_without_device(source: str) -> list[int]:
    """Line numbers of ``torch.<factory>(...)`` calls with no ``device=`` keyword."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and not any(keyword.arg == "device" for keyword in node.keywords)
        ):
            lines.append(node.lineno)
    return lines


def test_the_reader_finds_a_factory_without_a_device():
    source = (
        "import torch\na = torch.ones(3, dtype=torch.bool)\nb = torch.arange(3, device=x.device)\n"
        "c = torch.zeros_like(b)\n"
    )
    assert factories_without_device(source) == [2]


def test_every_tensor_factory_in_loss_code_takes_a_device():
    found = {path.name: factories_without_device(path.read_text()) for path in LOSS_CODE}
    assert not {name: lines for name, lines in found.items() if lines}, found
