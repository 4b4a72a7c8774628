"""The ``gpu`` extra pins what verl 0.9.1's own extras pin: one cupy wheel (verl's), verl's vLLM, and the
flash-attention pin the install line names. Read from verl's installed metadata, not copied by hand."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def verl_requirements() -> list[Requirement]:
    return [Requirement(line) for line in importlib.metadata.requires("verl") or []]


def gpu_extra() -> list[Requirement]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return [Requirement(line) for line in extras["gpu"]]


def verl_pins(name: str) -> set[str]:
    return {str(r.specifier) for r in verl_requirements() if canonicalize_name(r.name) == canonicalize_name(name)}


def test_every_gpu_pin_is_verls_own():
    """verl 0.9.1 pins vllm==0.24.0 (its vllm extra) and cupy-cuda13x==14.0.1 (its cupy-cu130 extra, pulled by
    fsdp and megatron): a cupy-cuda12x wheel beside verl's would put two cupy builds over each other."""
    for requirement in gpu_extra():
        assert verl_pins(requirement.name) == {str(requirement.specifier)}, requirement


def test_the_gpu_extra_brings_the_cupy_verl_pins_and_no_other():
    theirs = {canonicalize_name(r.name) for r in verl_requirements() if r.name.lower().startswith("cupy")}
    ours = {canonicalize_name(r.name) for r in gpu_extra() if r.name.lower().startswith("cupy")}
    assert theirs and ours == theirs


def test_the_flash_attention_install_line_names_verls_pin():
    (pin,) = verl_pins("flash-attn")
    assert f"flash-attn{pin} --no-build-isolation" in PYPROJECT.read_text()
