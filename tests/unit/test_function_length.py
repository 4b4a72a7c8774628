"""No function in the driver, the built-in plugins or the weight sync runs past ~80 lines (issue 62, item 4).

A function that long does several jobs; split it by concern (driver/limits.py's ``run_limits`` is the example). Its
length is counted from the first statement after the docstring to the last line of the body.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "areal_plugins"
FOLDERS = ("driver", "builtin", "weight_sync")
MAX_LINES = 80


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``function``'s body, its docstring left out (0 for a body that is a docstring only)."""
    body = function.body
    if (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    if not body:
        return 0
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1


def long_functions(root: Path, folders: tuple[str, ...], limit: int) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and body_lines(node) > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({body_lines(node)} lines)")
    return found


def test_the_counter_leaves_the_docstring_out_and_finds_a_long_function(tmp_path):
    statements = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "driver").mkdir()
    (tmp_path / "driver" / "m.py").write_text(
        f'def long():\n    """Doc.\n\n    More doc.\n    """\n{statements}\n\n\n'
        f'def short():\n    """Doc."""\n{statements.replace("    x80 = 80", "")}\n'
    )
    assert long_functions(tmp_path, ("driver",), MAX_LINES) == ["driver/m.py:1 long (81 lines)"]


def test_no_function_in_driver_builtin_or_weight_sync_is_over_80_lines():
    found = long_functions(PACKAGE, FOLDERS, MAX_LINES)
    assert not found, f"functions over {MAX_LINES} lines (split each by concern): {found}"
