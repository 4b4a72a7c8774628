"""Tensors larger than the transfer bucket: cut into flat ranges, joined back (weight_sync/split_tensors.py).

The whole path through verl's bucketed transport and our vLLM worker extension is tested in
tests/verl_vllm/test_over_bucket_weights.py; here the cut and the join, with sizes derived by hand.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_plugins.weight_sync.errors import WeightSyncError
from areal_plugins.weight_sync.split_tensors import Joiner, Piece, cut_large, pieces


def test_pieces_are_consecutive_flat_ranges_of_at_most_a_bucket():
    tensor = torch.arange(30, dtype=torch.float32).reshape(3, 10)  # 120 bytes
    cut = pieces("w", tensor, 48)  # 48 bytes hold 12 float32 values: 12 + 12 + 6
    decoded = [Piece.decode(name) for name, _ in cut]
    assert [piece.start for piece in decoded] == [0, 12, 24]
    assert [part.numel() for _, part in cut] == [12, 12, 6]
    assert all(piece.name == "w" and piece.shape == (3, 10) and piece.total == 30 for piece in decoded)
    assert torch.equal(cut[1][1], torch.arange(12, 24, dtype=torch.float32))
    assert all(part.numel() * part.element_size() <= 48 for _, part in cut)


def test_a_bucket_smaller_than_one_element_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes"):
        pieces("w", torch.zeros(4, dtype=torch.float64), 4)


def test_an_ordinary_name_is_no_piece():
    assert Piece.decode("model.embed_tokens.weight") is None
    assert Piece.decode("areal.partial_weight") is None  # only the mark with its separator starts a piece


def stream(tensors):
    async def generate():
        for item in tensors:
            yield item

    return generate()


def collect(weights):
    async def run():
        return [item async for item in weights]

    return asyncio.run(run())


def test_only_a_tensor_over_the_bucket_that_must_be_cut_is_cut():
    big, small, device_big = torch.zeros(8), torch.zeros(2), torch.ones(8)  # 32, 8 and 32 bytes
    out = collect(
        cut_large(stream([("big", big), ("small", small), ("kept", device_big)]), 16, lambda t: t is not device_big)
    )
    assert [name for name, _ in out][2:] == ["small", "kept"]  # 16 bytes: "big" as 2 pieces of 4 values
    assert [Piece.decode(name).start for name, _ in out[:2]] == [0, 4]


def test_joined_across_buckets_with_other_tensors_around_it():
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(5, 7, generator=generator).to(torch.bfloat16)  # 70 bytes: pieces of 16, 16, 3 values
    norm = torch.randn(3, generator=generator)
    cut = pieces("embed", embed, 32)
    assert [part.numel() for _, part in cut] == [16, 16, 3]
    joiner = Joiner()
    # As verl's sender fills buckets: the norm, then each piece alone (a piece fills a bucket), then the head.
    out = joiner.take([("norm", norm), cut[0]]) + joiner.take([cut[1]]) + joiner.take([cut[2], ("head", norm * 2)])
    joiner.finish()
    assert [name for name, _ in out] == ["norm", "embed", "head"]
    assert joiner.joined == ["embed"]
    joined = out[1][1]
    assert joined.dtype == torch.bfloat16 and joined.shape == (5, 7) and torch.equal(joined, embed)


def test_a_piece_is_copied_out_of_the_bucket_at_once():
    # The transport reuses the bucket's memory for the next bucket: the joined tensor must not see that.
    tensor = torch.arange(8, dtype=torch.float32)
    joiner = Joiner()
    (first_name, first), (second_name, second) = pieces("w", tensor, 16)
    bucket = first.clone()
    assert joiner.take([(first_name, bucket)]) == []
    bucket.fill_(-1.0)  # the next bucket overwrites the buffer
    ((_, joined),) = joiner.take([(second_name, second)])
    assert torch.equal(joined, tensor)


def test_a_lost_last_piece_stops_the_update_naming_the_tensor():
    joiner = Joiner()
    cut = pieces("lm_head.weight", torch.zeros(10), 16)
    joiner.take(cut[:-1])
    with pytest.raises(WeightSyncError, match=r"lm_head\.weight: the update ended after 8 of its 10 elements"):
        joiner.finish()


def test_another_tensor_before_the_last_piece_stops_the_update():
    joiner = Joiner()
    cut = pieces("w", torch.zeros(10), 16)
    with pytest.raises(WeightSyncError, match="tensor w: tensor norm arrived after 4 of its 10 elements"):
        joiner.take([cut[0], ("norm", torch.zeros(2))])


def test_pieces_out_of_order_or_without_their_first_are_refused():
    cut = pieces("w", torch.zeros(12), 16)
    with pytest.raises(WeightSyncError, match="from element 8 arrived after 4 elements"):
        Joiner().take([cut[0], cut[2]])
    with pytest.raises(WeightSyncError, match="from element 4 arrived without the pieces before it"):
        Joiner().take([cut[1]])
