"""The multi-turn calculator task: token layout of an episode, the tool, its parser and the final-turn reward."""

from __future__ import annotations

import asyncio

import pytest

from areal_plugins.rewards.math_verify_reward import compute_score
from areal_plugins.tiny.calculator import (
    DATA_SOURCE,
    PARSER_NAME,
    episode_tokens,
    evaluate,
    parse_call,
    register_tool_parser,
)
from areal_plugins.tiny.task import AdditionProblem


def test_a_warm_start_episode_is_laid_out_as_the_tool_agent_loop_lays_it_out(tokenizer):
    ids, labels = episode_tokens(tokenizer, AdditionProblem(37, 48))
    # The ChatML of the tiny tokenizer's template, written out by hand; verl's Qwen builder adds the
    # "\n" after the model's <|im_end|> before the tool message.
    assert tokenizer.decode(ids) == (
        "<|im_start|>user\nWhat is 37 + 48?<|im_end|>\n<|im_start|>assistant\n"
        "calc 37+48<|im_end|>\n<|im_start|>tool\n85<|im_end|>\n<|im_start|>assistant\n85<|im_end|>"
    )
    trained = [token for token in labels if token != -100]
    assert tokenizer.decode(trained) == "calc 37+48<|im_end|>85<|im_end|>"  # the model's two turns, nothing else
    assert len(labels) == len(ids)


def test_the_calculator_adds_and_says_what_it_accepts():
    assert evaluate("37+48") == "85"
    assert evaluate(" 9 + 91 ") == "100"
    with pytest.raises(ValueError, match="two whole numbers written as 'a\\+b'"):
        evaluate("37*48")


def test_the_compact_call_is_found_and_handed_to_verl_as_a_function_call(tokenizer):
    assert parse_call("calc 37+48") == ("", "37+48")
    assert parse_call("85") == ("85", None)
    from verl.experimental.agent_loop.tool_parser import ToolParser

    register_tool_parser()
    register_tool_parser()  # idempotent
    parser = ToolParser.get_tool_parser(PARSER_NAME, tokenizer)
    ids = [*tokenizer.encode("calc 3+4", add_special_tokens=False), tokenizer.eos_token_id]
    content, calls = asyncio.run(parser.extract_tool_calls(ids))
    assert content == ""
    assert [(call.name, call.arguments) for call in calls] == [("calculator", '{"expression": "3+4"}')]
    assert asyncio.run(parser.extract_tool_calls(tokenizer.encode("7", add_special_tokens=False)))[1] == []


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("calc 37+48tool\n85\nassistant\n85", 1.0),  # the final turn answers
        ("85", 1.0),  # answered without the tool
        ("calc 37+48tool\n85\nassistant\n84", 0.0),
        ("calc 37+48tool\n85\nassistant\n", 0.0),  # empty final turn: the tool's 85 must not count
        ("calc 37+48", 0.0),  # a call is not an answer, though math-verify evaluates 37+48 to 85
        ("37+48", 0.0),
    ],
)
def test_the_calculator_reward_judges_the_final_turns_bare_answer(response, score):
    assert compute_score(DATA_SOURCE, response, "85") == score
    # The same text under the single-turn task is math-verify's whole-text judgement.
    if response == "37+48":
        assert compute_score("areal/addition", response, "85") == 1.0
