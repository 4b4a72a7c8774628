"""The package's dependency rules, read from the source: no import cycle, pure core, leaf settings.

Every ``import areal_plugins...`` counts, at module level or inside a function: a lazy import still
ties two modules together, so it may not close a cycle either.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "areal_plugins"
#: The top-level ``patches/`` folder is installed as ``areal_plugins.patches`` (pyproject's package-dir).
PATCHES = REPO / "patches"


def module_name(path: Path) -> str:
    if path.is_relative_to(PATCHES):
        parts = ("areal_plugins", "patches", *path.relative_to(PATCHES).with_suffix("").parts)
    else:
        parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a ``from pkg import name`` of a submodule counts as it)."""
    sources = [*PACKAGE.rglob("*.py"), *PATCHES.rglob("*.py")]
    modules = {module_name(path): path for path in sources}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (depth-first search, colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_imports(graph: dict[str, set[str]], prefix: str) -> dict[str, set[str]]:
    return {name: targets for name, targets in graph.items() if name == prefix or name.startswith(prefix + ".")}


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_core_imports_nothing_else_of_the_package():
    graph = import_graph()
    for name, targets in package_imports(graph, "areal_plugins.core").items():
        outside = {t for t in targets if not t.startswith("areal_plugins.core")}
        assert not outside, f"{name} imports {sorted(outside)}: the core must stay pure"


def test_settings_is_a_leaf():
    assert import_graph()["areal_plugins.config.settings"] == set(), "settings.py must import nothing of the package"


def test_hook_specs_import_only_the_core_and_the_contracts_for_types():
    graph = import_graph()
    assert graph["areal_plugins.hooks.hookspecs"] <= {"areal_plugins.core.trajectory", "areal_plugins.hooks.contracts"}
    # _moved: the deprecated old names' forwarding (AdmissionCounters), a leaf of the standard library only.
    assert graph["areal_plugins.hooks.contracts"] <= {"areal_plugins.core.buffer", "areal_plugins._moved"}
    assert graph["areal_plugins._moved"] == set(), "_moved.py must import nothing of the package"


def test_the_core_imports_neither_verl_nor_ray():
    for path in (PACKAGE / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.split(".")[0] in ("verl", "ray", "transfer_queue") for n in names), path


def test_every_design_citation_names_a_section_of_the_design_doc():
    import re

    repo = PACKAGE.parent
    headings = re.findall(r"^## (.+)$", (repo / "docs" / "design.md").read_text(), flags=re.M)
    cited, unresolved = 0, []
    for folder in ("areal_plugins", "patches", "tests", "tools"):
        for path in (repo / folder).rglob("*.py"):
            for after in re.findall(r"docs/design\.md[,(] ?(\w[^\n]{0,40})", path.read_text()):
                cited += 1
                if not any(after.startswith(heading) for heading in headings):
                    unresolved.append(f"{path.name}: {after}")
    assert cited > 10, "the code cites the design doc's sections"
    assert not unresolved, f"citations of missing sections: {unresolved}"


def folder_of(module: str) -> str:
    """The folder (subpackage) of a package module, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for name, targets in graph.items():
        here = folder_of(name)
        folders.setdefault(here, set()).update(folder_of(t) for t in targets if folder_of(t) != here)
    for targets in list(folders.values()):
        for target in targets:
            folders.setdefault(target, set())
    return folders


#: The one folder edge a cycle may use: the plugin manager registers the built-in plugins (the host loads its own
#: plugins; a built-in plugin may build driver objects, e.g. the default rollout manager, the admission loop).
HOST_LOADS_BUILTINS = ("plugin_manager", "builtin")
#: Folders whose code runs in the workers or anywhere (engines, records, the pure core): never the driver's code.
WORKER_SIDE = ("agent_loop", "trainer_workers", "actors", "rollout", "weight_sync", "records", "core", "replay")


def test_no_cycle_between_folders():
    folders = folder_graph(import_graph())
    assert HOST_LOADS_BUILTINS[1] in folders[HOST_LOADS_BUILTINS[0]], "the allowed edge is still needed"
    folders[HOST_LOADS_BUILTINS[0]].discard(HOST_LOADS_BUILTINS[1])
    cycle = find_cycle(folders)
    assert cycle is None, "folders import each other in a cycle: " + " -> ".join(cycle or [])


def test_worker_side_code_never_imports_the_drivers():
    graph = import_graph()
    offending = {
        (name, target)
        for name, targets in graph.items()
        if folder_of(name) in WORKER_SIDE and folder_of(name) != "replay"
        for target in targets
        if folder_of(target) == "driver"
    }
    # The replay package has one side in each process; only its driver side may reach the driver's code.
    offending |= {
        (name, target)
        for name, targets in graph.items()
        if folder_of(name) == "replay" and name != "areal_plugins.replay.driver_side"
        for target in targets
        if folder_of(target) == "driver"
    }
    assert not offending, f"worker-side modules import the driver's: {sorted(offending)}"


def test_the_trainer_workers_import_neither_the_driver_nor_the_agent_loop():
    graph = import_graph()
    for name, targets in package_imports(graph, "areal_plugins.trainer_workers").items():
        assert not {folder_of(t) for t in targets} & {"driver", "agent_loop", "replay"}, (name, sorted(targets))


def test_nothing_imports_the_cli():
    graph = import_graph()
    importers = {name for name, targets in graph.items() for t in targets if folder_of(t) == "cli"}
    assert {name for name in importers if folder_of(name) != "cli"} == set()


def test_the_rule_checks_catch_a_broken_layout():
    # The checks above on a made-up graph: an agent-loop module importing the driver, and a folder cycle.
    graph = {
        "areal_plugins.agent_loop.client": {"areal_plugins.driver.admission"},
        "areal_plugins.driver.admission": {"areal_plugins.agent_loop.client"},
    }
    assert find_cycle(folder_graph(graph)) == ["agent_loop", "driver", "agent_loop"]
    assert folder_of("areal_plugins.agent_loop.client") in WORKER_SIDE


def test_the_plugin_api_is_the_packages_top():
    import areal_plugins

    for name in areal_plugins.__all__:
        assert getattr(areal_plugins, name) is not None, name
    assert {"hookimpl", "Trajectory", "SampleBuffer", "RolloutManager", "PolicyLoss"} <= set(areal_plugins.__all__)
