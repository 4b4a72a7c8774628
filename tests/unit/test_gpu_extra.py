"""The ``gpu`` extra defers to verl 0.9.1's own GPU extras instead of restating their pins: it asks for verl, at the
version the project depends on, with extras verl provides, and those extras carry vLLM's and cupy's pins. The one
pin restated, flash-attention's, is named on the install line as verl pins it. Read from verl's installed metadata,
not copied by hand."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def verl_requirements() -> list[Requirement]:
    return [Requirement(line) for line in importlib.metadata.requires("verl") or []]


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def gpu_extra() -> list[Requirement]:
    return [Requirement(line) for line in project()["optional-dependencies"]["gpu"]]


def verl_pins(name: str, extras: set[str] | None = None) -> set[str]:
    """verl's specifiers for ``name``, in its base requirements and, when given, in ``extras`` (followed through
    verl's own ``verl[...]`` references, as pip does)."""
    wanted = {canonicalize_name(extra) for extra in extras or ()}
    closed: set[str] = set()
    while wanted - closed:
        extra = (wanted - closed).pop()
        closed.add(extra)
        for r in verl_requirements():
            if canonicalize_name(r.name) == "verl" and r.marker and r.marker.evaluate({"extra": extra}):
                wanted |= {canonicalize_name(e) for e in r.extras}
    return {
        str(r.specifier)
        for r in verl_requirements()
        if canonicalize_name(r.name) == canonicalize_name(name)
        and (r.marker is None or any(r.marker.evaluate({"extra": extra}) for extra in closed))
    }


def test_the_gpu_extra_is_verl_itself_at_our_pin_with_extras_verl_provides():
    provided = {canonicalize_name(e) for e in importlib.metadata.metadata("verl").get_all("Provides-Extra") or []}
    (base,) = [Requirement(line) for line in project()["dependencies"] if Requirement(line).name == "verl"]
    for requirement in gpu_extra():
        assert canonicalize_name(requirement.name) == "verl", f"{requirement}: restates a pin instead of verl's extra"
        assert requirement.specifier == base.specifier, (requirement, base)
        assert requirement.extras and {canonicalize_name(e) for e in requirement.extras} <= provided, requirement


def test_verls_extras_we_ask_for_carry_vllm_and_one_cupy_build():
    """verl 0.9.1's ``vllm`` extra pins vllm==0.24.0, its ``cupy-cu130`` cupy-cuda13x==14.0.1 (the build ``fsdp`` and
    ``megatron`` pull): the extra brings exactly verl's pins, and no second cupy build beside verl's."""
    extras = {extra for requirement in gpu_extra() for extra in requirement.extras}
    assert verl_pins("vllm", extras) == {"==0.24.0"}
    assert verl_pins("cupy-cuda13x", extras) == {"==14.0.1"}
    cupy_builds = {canonicalize_name(r.name) for r in verl_requirements() if r.name.lower().startswith("cupy")}
    assert cupy_builds == {"cupy-cuda13x"}


def test_the_flash_attention_install_line_names_verls_pin():
    (pin,) = verl_pins("flash-attn", {"fsdp"})
    assert f"flash-attn{pin} --no-build-isolation" in PYPROJECT.read_text()
