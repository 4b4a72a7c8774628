"""The multi-turn CPU task: two-digit addition with a calculator tool, through verl's tool agent loop.

An episode (docs/multi_turn.md)::

    user       What is 37 + 48?
    assistant  calc 37+48            <- turn 1: a tool call in the calculator's compact syntax
    tool       85                    <- the tool's answer (tokens masked out of the loss)
    assistant  85                    <- turn 2: the answer

The tiny model cannot add two-digit numbers by itself; copying them into a call and copying the
tool's result out is what it learns. The reward judges the bare number on the final turn's last line
(rewards/math_verify_reward.py), so neither a tool call nor an episode that stops after the tool's
answer earns it. verl's ``hermes`` call syntax costs the
tiny tokenizer ~25 tokens per call, so the task registers a compact one with verl's
``ToolParser.register`` (:func:`register_tool_parser`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from areal_plugins.tiny.task import AdditionProblem, make_problems, to_verl_row, write_dataset

DATA_SOURCE = "areal/calculator"
TOOL_NAME = "calculator"
#: verl's ``actor_rollout_ref.rollout.multi_turn.format`` of the compact call syntax.
PARSER_NAME = "areal_calc"
CALL_PATTERN = re.compile(r"calc\s*(\d+)\s*\+\s*(\d+)")
MAX_OPERAND = 99


def calculator_row(problem: AdditionProblem, split: str, index: int) -> dict:
    return to_verl_row(problem, split, index, DATA_SOURCE)


def write_calculator_dataset(out_dir: Path, train_size: int, test_size: int, seed: int) -> dict[str, Path]:
    """``train.parquet`` and ``test.parquet`` of two-digit sums, scored by the final-turn rule."""
    return write_dataset(out_dir, train_size, test_size, seed, max_operand=MAX_OPERAND, data_source=DATA_SOURCE)


def call_text(problem: AdditionProblem) -> str:
    return f"calc {problem.a}+{problem.b}"


def evaluate(expression: str) -> str:
    """The calculator: ``"a+b"`` of whole numbers, else a ValueError that says what it accepts."""
    match = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*", expression)
    if match is None:
        raise ValueError(f"the calculator adds two whole numbers written as 'a+b', got {expression!r}")
    return str(int(match.group(1)) + int(match.group(2)))


def parse_call(text: str) -> tuple[str, str | None]:
    """``(text before the call, "a+b")`` of the first calculator call in ``text``, or ``(text, None)``."""
    match = CALL_PATTERN.search(text)
    if match is None:
        return text, None
    return text[: match.start()], f"{match.group(1)}+{match.group(2)}"


def register_tool_parser() -> None:
    """Register the compact call syntax as verl tool parser :data:`PARSER_NAME` (idempotent)."""
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

    if PARSER_NAME in ToolParser._registry:
        return

    @ToolParser.register(PARSER_NAME)
    class CalculatorCallParser(ToolParser):
        async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None):
            content, expression = parse_call(self.tokenizer.decode(responses_ids, skip_special_tokens=True))
            if expression is None:
                return content, []
            return content, [FunctionCall(name=TOOL_NAME, arguments=json.dumps({"expression": expression}))]


def episode_tokens(tokenizer: Any, problem: AdditionProblem) -> tuple[list[int], list[int]]:
    """The token ids of a correct episode as verl's tool agent loop lays them out, and the labels
    (the assistant's tokens; prompt, tool and template tokens -100).

    Built with verl's own continuous-token builder for Qwen chat templates, the one the agent loop
    uses, so the warm start teaches exactly the token layout the model meets in training.
    """
    from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder

    builder = QwenContinuousTokenBuilder(tokenizer)
    user = [{"role": "user", "content": problem.question}]
    ids = builder.build_initial_tokens(user)
    labels = [-100] * len(ids)
    call = [*tokenizer.encode(call_text(problem), add_special_tokens=False), tokenizer.eos_token_id]
    ids, labels = ids + call, labels + call
    assistant = {"role": "assistant", "content": ""}
    tool = {"role": "tool", "content": problem.answer}
    merged = builder.merge_context_tokens([*user, assistant], [*user, assistant, tool], ids)
    context = merged.token_ids[len(ids) :]
    ids, labels = ids + context, labels + [-100] * len(context)
    answer = [*tokenizer.encode(problem.answer, add_special_tokens=False), tokenizer.eos_token_id]
    return ids + answer, labels + answer


def warm_start(model: Any, tokenizer: Any, steps: int, batch: int, lr: float, seed: int) -> dict[str, float]:
    """Supervised steps on correct episodes, the loss on the assistant's tokens only."""
    from areal_plugins.tiny import supervised

    problems = make_problems(steps * batch, seed=seed + 10_000, max_operand=MAX_OPERAND)
    batches = (
        [episode_tokens(tokenizer, p) for p in problems[step * batch : (step + 1) * batch]] for step in range(steps)
    )
    return supervised.warm_start(model, batches, steps, lr, tokenizer.pad_token_id, "calculator")
