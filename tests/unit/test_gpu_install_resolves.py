"""``pip install '.[gpu]'`` resolves beside verl 0.9.1's own GPU extras, by pip's own resolver.

Offline (the unit tier): pip resolves our project (its dependencies and ``gpu`` extra, read from pyproject.toml), the
flash-attention pin its install line names, and ``verl[vllm,cupy-cu130,flash-attn-cu130torch211]==0.9.1`` against a
folder of metadata-only wheels: verl's own, its installed ``METADATA`` verbatim, and, for every other project either
side names, one stub of each version any specifier names (no dependencies of their own). Our ``gpu`` extra is verl's
own extras (``verl[vllm,cupy-cu130]``), so ``areal-plugins[gpu]`` alone brings verl's vLLM and cupy. No CUDA wheel
is needed to see a conflict: a pin added to the extra that differs from verl's is ``ResolutionImpossible``; a second
cupy build (two distributions installing the ``cupy`` module over each other) resolves, and the report shows it.

Online (``full`` tier): the same resolve against the real index, ``pip install '.[gpu]' ... --dry-run --report``.
The index this project's machines reach serves no PEP 658 metadata, so pip downloads every wheel to read its
dependencies: 4.1 GB for this resolve (torch 2.11.0 530 MB, flashinfer-cubin 448 MB, vLLM 279 MB, ...), 35-74 s here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
#: verl 0.9.1's extras whose pins ours defer to: vLLM (``vllm``), cupy for the nccl checkpoint engine (``cupy-cu130``,
#: which ``fsdp`` and ``megatron`` pull), flash-attention (``flash-attn-cu130torch211``, also pulled by ``fsdp``).
#: ``fsdp`` itself is not asked for: it pins trl and flash-linear-attention, which our install does not bring.
VERL_GPU = "verl[vllm,cupy-cu130,flash-attn-cu130torch211]==0.9.1"


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def flash_attention_pin() -> str:
    """The install line's pin (pyproject's comment, README): flash-attention builds against the CUDA torch."""
    (pin,) = set(re.findall(r"(flash-attn==[\w.]+) --no-build-isolation", PYPROJECT.read_text()))
    return pin


def _wheel(folder: Path, name: str, version: str, metadata: str) -> None:
    """A wheel that holds nothing but its metadata: all pip's resolver reads."""
    stem = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", metadata)
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def _metadata(name: str, version: str, requires: list[str] = (), extras: list[str] = ()) -> str:  # type: ignore[assignment]
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Provides-Extra: {extra}" for extra in extras]
    lines += [f"Requires-Dist: {requirement}" for requirement in requires]
    return "\n".join(lines) + "\n"


def wheelhouse(folder: Path, dependencies: list[str], gpu: list[str]) -> None:
    """verl's real metadata, our project's, and a stub of every version named of every other project."""
    verl = importlib.metadata.distribution("verl")
    assert verl.version == "0.9.1", f"this check reads verl 0.9.1's metadata; .venv has verl {verl.version}"
    _wheel(folder, "verl", verl.version, verl.read_text("METADATA") or "")
    ours = [*dependencies, *(f"{line}; extra == 'gpu'" for line in gpu)]
    _wheel(folder, "areal-plugins", "0.1.0", _metadata("areal-plugins", "0.1.0", ours, ["gpu"]))
    versions: dict[str, set[str]] = {}
    for line in [*(verl.requires or []), *ours, flash_attention_pin()]:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name in ("verl", "areal-plugins"):
            continue
        named = versions.setdefault(name, set())
        for specifier in requirement.specifier:
            try:
                named.add(str(Version(specifier.version.rstrip(".*"))))
            except InvalidVersion:
                continue
    for name, named in versions.items():
        for version in named or {"1.0"}:
            _wheel(folder, name, version, _metadata(name, version))


def resolve(args: list[str], cwd: Path, report: Path, offline_from: Path | None) -> subprocess.CompletedProcess:
    """``pip install --dry-run --ignore-installed --report``: what pip would install, as JSON in ``report``; on a
    conflict pip's own explanation on stderr."""
    env = dict(os.environ)
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report", str(report)]
    if offline_from is not None:  # this machine's pip settings (its indexes, its torch cap) play no part
        env = {key: value for key, value in env.items() if not key.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
        command += ["--no-index", "--find-links", str(offline_from)]
    return subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def installed(report: Path) -> dict[str, str]:
    items = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in items}


def cupy_builds(chosen: dict[str, str]) -> list[str]:
    """Distributions that install the ``cupy`` module (cupy, cupy-cuda12x, cupy-cuda13x, ...)."""
    return sorted(name for name in chosen if name == "cupy" or name.startswith("cupy-"))


def resolve_offline(tmp_path: Path, gpu: list[str]) -> subprocess.CompletedProcess:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheelhouse(wheels, project()["dependencies"], gpu)
    requests = ["areal-plugins[gpu]", flash_attention_pin(), VERL_GPU]
    return resolve(requests, tmp_path, tmp_path / "report.json", offline_from=wheels)


def test_the_gpu_install_resolves_beside_verls_gpu_extras(tmp_path):
    """pip picks verl's own vLLM and cupy, one cupy build, and verl's flash-attention."""
    result = resolve_offline(tmp_path, project()["optional-dependencies"]["gpu"])
    assert result.returncode == 0, result.stderr
    chosen = installed(tmp_path / "report.json")
    assert (chosen["vllm"], chosen["flash-attn"]) == ("0.24.0", "2.8.3")
    assert cupy_builds(chosen) == ["cupy-cuda13x"]


def test_the_gpu_extra_alone_brings_verls_vllm_cupy_torch_and_transformers(tmp_path):
    """``pip install '.[gpu]'`` with nothing else asked: verl's ``vllm`` extra's vLLM, torch and transformers pins
    and its ``cupy-cu130`` cupy, through our extra (no pin of ours)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheelhouse(wheels, project()["dependencies"], project()["optional-dependencies"]["gpu"])
    result = resolve(["areal-plugins[gpu]"], tmp_path, tmp_path / "report.json", offline_from=wheels)
    assert result.returncode == 0, result.stderr
    chosen = installed(tmp_path / "report.json")
    assert (chosen["verl"], chosen["vllm"], chosen["torch"], chosen["transformers"]) == (
        "0.9.1", "0.24.0", "2.11.0", "5.9.0"
    )  # fmt: skip
    assert cupy_builds(chosen) == ["cupy-cuda13x"]


@pytest.mark.parametrize("pin", ["vllm==0.23.0", "cupy-cuda13x==14.0.0", "torch==2.10.0"], ids=str)
def test_a_pin_that_differs_from_verls_is_a_resolution_conflict(tmp_path, pin):
    """A pin added to the extra beside verl's (as the extra once restated them) that differs from verl's own."""
    result = resolve_offline(tmp_path, [*project()["optional-dependencies"]["gpu"], pin])
    assert result.returncode != 0
    # pip's "The conflict is caused by:" names both sides, verl's "... depends on vllm==0.24.0" and ours
    assert "ResolutionImpossible" in result.stderr and f"areal-plugins[gpu] 0.1.0 depends on {pin}" in result.stdout


def test_another_cupy_build_resolves_and_is_caught(tmp_path):
    """The extra as it stood before issue 48 (``cupy-cuda12x>=13``) beside verl's cupy-cuda13x: pip installs both,
    two builds of one module; only the report shows it."""
    result = resolve_offline(tmp_path, [*project()["optional-dependencies"]["gpu"], "cupy-cuda12x>=13"])
    assert result.returncode == 0, result.stderr
    assert cupy_builds(installed(tmp_path / "report.json")) == ["cupy-cuda12x", "cupy-cuda13x"]


@pytest.mark.full
def test_the_gpu_install_resolves_against_the_real_index(tmp_path):
    """pip's resolver on the machine's index: 257 distributions, 4.1 GB downloaded to read their metadata (35-74 s
    here). flash-attention is left out: PyPI has only its source, whose metadata takes a build against CUDA torch."""
    result = resolve([".[gpu]"], ROOT, tmp_path / "report.json", offline_from=None)
    assert result.returncode == 0, result.stderr[-4000:]
    chosen = installed(tmp_path / "report.json")
    assert (chosen["verl"], chosen["vllm"]) == ("0.9.1", "0.24.0")
    assert cupy_builds(chosen) == ["cupy-cuda13x"]
