from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def random_qwen2():
    """A randomly initialised tiny Qwen2 (no tokenizer needed), in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()
