"""The installed layout: every package folder is listed, and ``patches/`` installs as ``areal_plugins.patches``.

The patches' source folder is the repository's top-level ``patches/`` (pyproject's package-dir mapping);
a wheel and an editable install must both import it as ``areal_plugins.patches``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def listed_packages() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def package_folders() -> set[str]:
    """Every folder with an ``__init__.py``, named as it is installed."""
    names = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "areal_plugins").rglob("__init__.py")}
    names |= {
        ".".join(("areal_plugins", "patches", *p.parent.relative_to(REPO / "patches").parts))
        for p in (REPO / "patches").rglob("__init__.py")
    }
    return names


def test_pyproject_lists_every_package_folder():
    assert listed_packages() == package_folders()


def test_the_patches_folder_is_mapped_into_the_package():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"areal_plugins.patches": "patches"}
    assert not (REPO / "areal_plugins" / "patches").exists(), "the patches live in the top-level patches/ only"


def test_the_installed_package_imports_patches_from_the_top_level_folder():
    """This environment's install (editable in development) maps ``areal_plugins.patches`` to ``patches/``."""
    code = "import areal_plugins.patches.gloo_backend as m; print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == REPO / "patches" / "gloo_backend.py"


def test_a_wheel_holds_the_patches_under_the_package_and_imports_them(tmp_path):
    """Build the wheel (no network: setuptools is already here), unpack it first on sys.path, import from it.

    Built from a copy of the sources: setuptools writes ``build/`` and ``*.egg-info`` beside the project."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("areal_plugins", "patches"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("areal_plugins-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "areal_plugins/patches/gloo_backend.py" in names
    assert "areal_plugins/config/areal/default.yaml" in names
    assert not any(name.startswith("patches/") for name in names), "no top-level module named patches"
    # The benchmarks' stand-ins are tools/areal_bench, shipped to Ray workers by the bench itself: not the wheel's.
    assert not [name for name in names if name.startswith(("areal_plugins/bench/", "areal_bench/"))]
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    code = "import areal_plugins.patches.route_areal_node as m, areal_plugins.hooks.hookspecs; print(m.__file__)"
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == unpacked / "areal_plugins" / "patches" / "route_areal_node.py"


def test_no_production_module_names_the_benchmarks_stand_ins():
    """tools/areal_bench registers itself (areal_plugins.rollout.verl_registration.register_backend); the package
    neither imports it nor names it."""
    named = [
        path.relative_to(REPO).as_posix()
        for folder in ("areal_plugins", "patches")
        for path in (REPO / folder).rglob("*.py")
        if "areal_bench" in path.read_text() or "areal_plugins.bench" in path.read_text()
    ]
    assert named == []
