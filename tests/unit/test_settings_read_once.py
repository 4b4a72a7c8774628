"""The ``areal:`` node is read once, through the typed settings (issue 62, item 5).

Every module outside ``areal_plugins/config/`` asks :func:`~areal_plugins.config.settings.areal_settings` (or is
handed the settings); none reads a raw ``areal`` key, so no reader can carry a default other than the one declared
in ``config/settings.py`` (``rollout/server_slots.py`` read ``areal.mode`` with default ``"sync"`` and
``max_staleness`` with 0, where the settings say ``"async"`` and 4).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from areal_plugins.config.settings import MODES, ON_STALE, PLACEMENTS, ArealConfig, ArealConfigError, areal_settings

ROOT = Path(__file__).resolve().parents[2]
#: Where the node is parsed (settings.py) and written (routing.py): the only modules that may touch it raw.
CONFIG_DIR = ROOT / "areal_plugins" / "config"


def raw_areal_reads(source: str) -> list[str]:
    """Each place in ``source`` that reads the raw ``areal`` node or one of its keys, as ``line: code``.

    Caught: ``x.get("areal")``, ``x["areal"]``, ``getattr(x, "areal")``, ``OmegaConf.select(x, "areal.…")`` (any
    call's string argument naming an ``areal.`` path, outside messages), and ``<anything but self>.areal`` (a
    verl config's node; ``self.areal`` is the trainer's typed settings).
    """
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            strings = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            if name in ("get", "getattr", "pop", "setdefault") and "areal" in strings:
                hit = True
            if name in ("select", "update") and any(s == "areal" or s.startswith("areal.") for s in strings):
                hit = True
        elif isinstance(node, ast.Subscript):
            key = node.slice
            hit = isinstance(key, ast.Constant) and key.value == "areal"
        elif isinstance(node, ast.Attribute) and node.attr == "areal":
            hit = not (isinstance(node.value, ast.Name) and node.value.id == "self")
        if hit:
            found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_module_outside_config_reads_a_raw_areal_key():
    offenders = {}
    for folder in (ROOT / "areal_plugins", ROOT / "patches"):
        for path in sorted(folder.rglob("*.py")):
            if CONFIG_DIR in path.parents:
                continue
            reads = raw_areal_reads(path.read_text())
            if reads:
                offenders[str(path.relative_to(ROOT))] = reads
    assert not offenders, (
        "raw reads of the areal node (each may default otherwise than config/settings.py): use "
        f"areal_settings(config) or the settings you were handed instead: {offenders}"
    )


@pytest.mark.parametrize(
    "code",
    [
        'config.get("areal")',
        'config["areal"]["mode"]',
        'getattr(config, "areal")',
        'OmegaConf.select(config, "areal.mode", default="sync")',
        "config.areal.max_staleness",
        "self.config.areal.plugins",
    ],
)
def test_the_scan_sees_each_form_of_raw_read(code):
    assert raw_areal_reads(code), code


@pytest.mark.parametrize(
    "code",
    [
        "self.areal.max_staleness",
        'raise ValueError("areal.mode must be async")',
        'logger.info("areal.placement=%s", x)',
        "areal_settings(config).mode",
    ],
)
def test_the_scan_passes_typed_reads_and_messages(code):
    assert not raw_areal_reads(code), code


def test_the_concurrency_default_is_eta_plus_one_batches():
    # (η + 1) x B, by hand: η = 4, B = 512 -> 5 x 512 = 2560 (the paper's 1.5B run); η = 0, B = 3 -> 3.
    assert ArealConfig.from_dict({"max_staleness": 4}).concurrent_rollouts(512) == 2560
    assert ArealConfig.from_dict({"max_staleness": 0}).concurrent_rollouts(3) == 3
    # The default η is 4: B = 8 -> 40.
    assert ArealConfig.from_dict(None).concurrent_rollouts(8) == 40
    # Set, the limit wins whatever η and B are.
    assert ArealConfig.from_dict({"max_staleness": 4, "max_concurrent_rollouts": 600}).concurrent_rollouts(512) == 600


def test_server_slots_take_the_settings_defaults():
    """``areal.mode`` and ``areal.max_staleness`` absent: the settings' async and η = 4, not "sync" and 0."""
    from areal_plugins.rollout.server_slots import bound_requests_from_config

    config = OmegaConf.create(
        {"data": {"train_batch_size": 8}, "actor_rollout_ref": {"rollout": {"n": 2}}, "areal": {"enable": True}}
    )
    assert bound_requests_from_config(config) == (4 + 1) * 8 * 2  # 80 groups' answers; the old reads gave 8 x 2
    sync = OmegaConf.create(
        {"data": {"train_batch_size": 8}, "actor_rollout_ref": {"rollout": {"n": 2}}, "areal": {"mode": "sync"}}
    )
    assert bound_requests_from_config(sync) == 8 * 2


def test_settings_are_parsed_once_per_node_and_again_when_it_changes():
    config = OmegaConf.create({"areal": {"enable": True, "max_staleness": 2}})
    first = areal_settings(config)
    assert areal_settings(OmegaConf.create({"areal": {"max_staleness": 2, "enable": True}})) is first
    config.areal.max_staleness = 3
    assert areal_settings(config).max_staleness == 3
    assert areal_settings(None) == areal_settings(OmegaConf.create({})) == ArealConfig()


def test_choices_are_literals_refused_with_their_yaml_path():
    assert MODES == ("async", "sync") and PLACEMENTS == ("colocated", "separate")
    assert ON_STALE == ("wait", "drop", "reissue")
    with pytest.raises(ArealConfigError, match=r"areal\.placement must be one of \('colocated', 'separate'\)"):
        areal_settings({"areal": {"placement": "remote"}})
    with pytest.raises(ArealConfigError, match=r"areal\.loss\.prox_logp must be one of"):
        areal_settings({"areal": {"loss": {"prox_logp": "exact"}}})
