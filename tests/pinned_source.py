"""Upstream Python source read without importing it: a wheel fetched by name (pip download) or an installed package.

Used by tests/unit/test_gpu_pins.py to hold the table in tests/gpu_pins.py against the versions a GPU run installs
(vLLM 0.24.0's CUDA wheel does not import on a CPU machine; its source parses). Only ``ast``: nothing here runs
upstream code. The model of a module is what a reader sees at its top level (definitions, assignments, annotations and
imports, inside ``if``/``try`` too); a class's members are its methods, class-level names and every ``self.X`` any of
its methods assigns, then its bases' in order, bases resolved through the module's imports.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: What pip prints when it cannot reach the package index (as opposed to an index that has no such version).
UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|Max retries exceeded|ConnectTimeout|ProxyError|"
    r"No route to host|Connection refused|Could not fetch URL"
)


class RegistryUnreachableError(RuntimeError):
    """pip could not reach the package index."""


def download_wheel(requirement: str, cache: Path, platform: str = "manylinux_2_28_x86_64") -> Path:
    """The wheel of ``requirement`` (``name==version``), fetched by pip into ``cache`` once and reused after.

    The platform and Python are pinned so that the same Linux wheel a GPU machine installs is fetched on any machine.
    Raises :class:`RegistryUnreachableError` where pip cannot reach the index; RuntimeError with pip's output otherwise.
    """
    name, _, version = requirement.partition("==")
    folder = cache / f"{name}-{version}"
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(folder.glob(f"{stem}*.whl")) if folder.is_dir() else []
    if found:
        return found[0]
    partial = cache / f".{name}-{version}.{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    command = [
        sys.executable, "-m", "pip", "download", requirement, "--no-deps", "--only-binary=:all:",
        "--platform", platform, "--python-version", "3.11", "--dest", str(partial),
        "--disable-pip-version-check", "--quiet", "--retries", "2", "--timeout", "30",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    output = f"{result.stdout}\n{result.stderr}".strip()
    wheels = sorted(partial.glob(f"{stem}*.whl"))
    if result.returncode != 0 or not wheels:
        shutil.rmtree(partial, ignore_errors=True)
        if UNREACHABLE.search(output):
            raise RegistryUnreachableError(
                f"pip download {requirement}: the package index is unreachable\n{output[-2000:]}"
            )
        raise RuntimeError(f"pip download {requirement} failed (exit {result.returncode}):\n{output[-4000:]}")
    try:
        os.replace(partial, folder)  # whole or not at all: a second process finds a finished download
    except OSError:  # another process finished first
        shutil.rmtree(partial, ignore_errors=True)
    return sorted(folder.glob(f"{stem}*.whl"))[0]


@dataclass
class Module:
    """One parsed module of a :class:`SourceTree`."""

    name: str
    path: str
    text: str
    tree: ast.Module
    is_package: bool

    def top_level(self) -> Iterator[ast.stmt]:
        """The module's top-level statements, those inside top-level ``if``/``try``/``with`` blocks included."""
        pending = list(self.tree.body)
        while pending:
            node = pending.pop(0)
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                pending[:0] = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
                for handler in getattr(node, "handlers", []):
                    pending[:0] = handler.body
                continue
            yield node

    def package(self, level: int) -> str:
        """The package a relative import of ``level`` dots starts from."""
        parts = self.name.split(".")
        keep = len(parts) - level + (1 if self.is_package else 0)
        return ".".join(parts[:keep])


@dataclass
class Definition:
    """A name resolved to where it is defined: ``node`` in ``module`` (a module itself where ``node`` is None)."""

    module: Module
    node: ast.AST | None
    name: str

    @property
    def where(self) -> str:
        line = getattr(self.node, "lineno", 1)
        return f"{self.module.path}:{line}"


@dataclass
class Member:
    """A class member: a method (``function``), a class-level name or an attribute a method assigns."""

    owner: Definition
    name: str
    function: ast.FunctionDef | ast.AsyncFunctionDef | None
    node: ast.AST

    @property
    def where(self) -> str:
        return f"{self.owner.module.path}:{getattr(self.node, 'lineno', 1)}"

    @property
    def decorators(self) -> set[str]:
        if self.function is None:
            return set()
        return {ast.unparse(d).rsplit(".", 1)[-1] for d in self.function.decorator_list}


@dataclass
class SourceTree:
    """The Python source of one distribution: ``read`` gives a file's text by its path in the distribution."""

    label: str
    read: Callable[[str], str | None]
    _modules: dict[str, Module | None] = field(default_factory=dict)

    @classmethod
    def of_wheel(cls, label: str, wheel: Path) -> SourceTree:
        archive = zipfile.ZipFile(wheel)
        names = set(archive.namelist())
        return cls(label, lambda path: archive.read(path).decode() if path in names else None)

    @classmethod
    def of_folder(cls, label: str, root: Path) -> SourceTree:
        def read(path: str) -> str | None:
            file = root / path
            return file.read_text() if file.is_file() else None

        return cls(label, read)

    def module(self, name: str) -> Module | None:
        """Module ``name`` (``a.b.c``: ``a/b/c.py`` or ``a/b/c/__init__.py``), or None where the source has none."""
        if name not in self._modules:
            base = name.replace(".", "/")
            found = None
            for path, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = self.read(path)
                if text is not None:
                    found = Module(name, path, text, ast.parse(text, filename=path), is_package)
                    break
            self._modules[name] = found
        return self._modules[name]

    def resolve(self, module_name: str, name: str, depth: int = 0) -> Definition | None:
        """Where ``module_name``'s top-level ``name`` is defined, following imports (re-exports) within the source;
        a submodule ``name`` of a package too. None where neither the module nor its imports define it."""
        module = self.module(module_name)
        if module is None or depth > 12:
            return None
        for node in module.top_level():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return Definition(module, node, name)
            if isinstance(node, ast.Assign) and any(_assigns(target, name) for target in node.targets):
                return Definition(module, node, name)
            if isinstance(node, ast.AnnAssign) and _assigns(node.target, name):
                return Definition(module, node, name)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    source = node.module or ""
                    if node.level:
                        source = ".".join(p for p in (module.package(node.level), source) if p)
                    found = self.resolve(source, alias.name, depth + 1)
                    if found is not None:
                        return found
                    sub = self.module(f"{source}.{alias.name}")
                    if sub is not None:
                        return Definition(sub, None, alias.name)
                    return Definition(module, node, name)  # imported from outside the source (torch, ...)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name and self.module(alias.name) is not None:
                        return Definition(self.module(alias.name), None, name)  # type: ignore[arg-type]
        if module.is_package:
            sub = self.module(f"{module_name}.{name}")
            if sub is not None:
                return Definition(sub, None, name)
        return None

    def resolve_expression(self, module: Module, expression: ast.expr) -> Definition | None:
        """What a base-class expression of ``module`` names (``Name``, ``a.b.Name``, ``Generic[T]``'s ``Generic``)."""
        if isinstance(expression, ast.Subscript):
            return self.resolve_expression(module, expression.value)
        if isinstance(expression, ast.Name):
            return self.resolve(module.name, expression.id)
        if isinstance(expression, ast.Attribute):
            owner = self.resolve_expression(module, expression.value)
            if owner is not None and owner.node is None:  # a module
                return self.resolve(owner.module.name, expression.attr)
        return None

    def members(self, cls: Definition) -> tuple[dict[str, Member], list[str]]:
        """Every member of class ``cls`` (its own first, then its bases' in order) and the bases it could not follow
        (outside this source: ``torch.nn.Module``, ``ABC``, ...)."""
        members: dict[str, Member] = {}
        unresolved: list[str] = []
        seen: set[int] = set()
        pending = [cls]
        while pending:
            current = pending.pop(0)
            node = current.node
            if not isinstance(node, ast.ClassDef) or id(node) in seen:
                continue
            seen.add(id(node))
            for name, member in _own_members(current).items():
                members.setdefault(name, member)
            for base in node.bases:
                found = self.resolve_expression(current.module, base)
                if found is not None and isinstance(found.node, ast.ClassDef):
                    pending.append(found)
                elif ast.unparse(base) not in ("object", "Generic", "ABC", "Protocol"):
                    unresolved.append(ast.unparse(base))
        return members, unresolved


def _assigns(target: ast.expr, name: str) -> bool:
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_assigns(element, name) for element in target.elts)
    return False


def _own_members(cls: Definition) -> dict[str, Member]:
    """A class's own members: methods, class-level names, and each ``self.X`` (or ``setattr(self, "X", ...)``) any
    of its methods assigns (the first place it does)."""
    assert isinstance(cls.node, ast.ClassDef)
    members: dict[str, Member] = {}
    functions = []
    for node in cls.node.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if "setter" not in {ast.unparse(d).rsplit(".", 1)[-1] for d in node.decorator_list}:
                members.setdefault(node.name, Member(cls, node.name, node, node))
            functions.append(node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in _names(target):
                    members.setdefault(name, Member(cls, name, None, node))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.setdefault(node.target.id, Member(cls, node.target.id, None, node))
    for function in functions:
        this = function.args.posonlyargs[:1] or function.args.args[:1]
        if not this:
            continue
        self_name = this[0].arg
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == self_name
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                members.setdefault(node.args[1].value, Member(cls, node.args[1].value, None, node))
            for target in targets:
                for element in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    if (
                        isinstance(element, ast.Attribute)
                        and isinstance(element.value, ast.Name)
                        and element.value.id == self_name
                    ):
                        members.setdefault(element.attr, Member(cls, element.attr, None, node))
    return members


def _names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _names(element)]
    return []


def binding_problem(function: ast.FunctionDef | ast.AsyncFunctionDef, call: str, bound: bool) -> str | None:
    """Why calling ``function`` as ``call`` (our call's argument list, ``"(a, b, key=...)"``) fails to bind, or None.
    ``bound``: called through an instance or class (its first parameter is filled: a method, not a staticmethod)."""
    parsed = ast.parse(f"f{call}", mode="eval").body
    assert isinstance(parsed, ast.Call), call
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args][1 if bound else 0 :]
    keyword_names = {a.arg for a in arguments.args[1 if bound and not arguments.posonlyargs else 0 :]}
    keyword_names |= {a.arg for a in arguments.kwonlyargs}
    if any(isinstance(a, ast.Starred) for a in parsed.args) or any(k.arg is None for k in parsed.keywords):
        return None  # *args / **kwargs at the call: anything may bind
    given = len(parsed.args)
    if given > len(positional) and arguments.vararg is None:
        return f"takes {len(positional)} positional arguments, our call passes {given}"
    filled = {a.arg for a in positional[:given]}
    for keyword in parsed.keywords:
        name = keyword.arg
        if name in filled:
            return f"argument {name!r} given twice"
        if name not in keyword_names and arguments.kwarg is None:
            return f"has no parameter {name!r}"
        filled.add(name or "")
    defaults = len(arguments.defaults)
    required = [a.arg for a in positional[: len(positional) - defaults] if a.arg not in filled]
    required += [a.arg for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True) if d is None]
    missing = [name for name in required if name not in filled]
    return f"requires {missing}, which our call does not pass" if missing else None


def override_problem(
    ours: ast.FunctionDef | ast.AsyncFunctionDef, theirs: ast.FunctionDef | ast.AsyncFunctionDef
) -> str | None:
    """Why our override cannot stand in for upstream's method (a call upstream's signature admits that ours does
    not, or a parameter ours requires that upstream's callers need not pass), or None."""
    our_args, their_args = ours.args, theirs.args
    our_positional = [a.arg for a in [*our_args.posonlyargs, *our_args.args]][1:]
    their_positional = [a.arg for a in [*their_args.posonlyargs, *their_args.args]][1:]
    our_names = set(our_positional) | {a.arg for a in our_args.kwonlyargs}
    their_optional = set(their_positional[len(their_positional) - len(their_args.defaults) :])
    their_optional |= {a.arg for a, d in zip(their_args.kwonlyargs, their_args.kw_defaults, strict=True) if d}
    for index, name in enumerate(their_positional):
        if index < len(our_positional):
            if our_positional[index] != name and not (our_args.vararg and our_args.kwarg):
                return f"positional parameter {index + 1} is {name!r} upstream, {our_positional[index]!r} in ours"
        elif our_args.vararg is None or (name not in our_names and our_args.kwarg is None):
            return f"upstream takes {name!r}, ours does not (nor *args/**kwargs)"
    for argument in their_args.kwonlyargs:
        if argument.arg not in our_names and our_args.kwarg is None:
            return f"upstream takes keyword {argument.arg!r}, ours does not"
    if their_args.vararg is not None and our_args.vararg is None:
        return f"upstream takes *{their_args.vararg.arg}, ours does not"
    if their_args.kwarg is not None and our_args.kwarg is None:
        return f"upstream takes **{their_args.kwarg.arg}, ours does not"
    our_optional = set(our_positional[len(our_positional) - len(our_args.defaults) :])
    our_optional |= {a.arg for a, d in zip(our_args.kwonlyargs, our_args.kw_defaults, strict=True) if d}
    for name in sorted(our_names - our_optional):
        if name in their_optional or name not in set(their_positional) | {a.arg for a in their_args.kwonlyargs}:
            return f"ours requires {name!r}, which upstream's callers need not pass"
    return None
