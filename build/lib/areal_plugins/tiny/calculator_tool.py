"""The calculator as a verl function tool; recipes name this file in ``multi_turn.function_tool_path``.

verl executes the file in each agent-loop worker when it loads its tools; that is also where the
calculator's compact call syntax is registered as a verl tool parser (tiny/calculator.py).
"""

from verl.tools.function_tool import function_tool

from areal_plugins.tiny.calculator import TOOL_NAME, evaluate, register_tool_parser

register_tool_parser()


@function_tool(TOOL_NAME)
def calculator(expression: str) -> str:
    """Add two whole numbers.

    Args:
        expression: the sum to compute, written as a+b, e.g. 37+48.
    """
    return evaluate(expression)
