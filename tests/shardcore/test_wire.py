"""Wire decoding: small layouts are decoded once and shared, every layout decoded is interned (equal layouts are
one object), a bad message is refused every time it comes (failures are never kept), and decoded shards are
the constructed ones."""

from __future__ import annotations

import pytest
import torch

from shardserve.core.metadata import (
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    as_placement,
    interned,
)
from shardserve.core.wire import CACHED_MESSAGE_BYTES, metadata_from_proto, metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb


def _layout(shards: int) -> ShardedTensorMetadata:
    return ShardedTensorMetadata(
        tuple(ShardMetadata((i, 0), (1, 4), f"rank:{i % 2}/cpu") for i in range(shards)),
        (shards, 4),
        TensorProperties(dtype=torch.bfloat16),
    )


def test_a_small_layout_is_decoded_once_and_equals_the_original() -> None:
    layout = _layout(2)
    first = metadata_from_proto(metadata_to_proto(layout))
    again = metadata_from_proto(metadata_to_proto(layout))
    assert first == layout
    assert again is first  # shared: the dataclasses are frozen


def test_equal_layouts_decoded_apart_are_one_object() -> None:
    """A layout decoded from a large message (too large to be kept by its bytes) and again from another message
    of an equal layout come back as the one interned object, which caches keyed on layouts then find by
    identity instead of comparing every shard."""
    layout = _layout(400)
    message = metadata_to_proto(layout)
    assert message.ByteSize() > CACHED_MESSAGE_BYTES
    assert interned(layout) is layout  # the first one seen is the one kept
    first = metadata_from_proto(message)
    again = metadata_from_proto(metadata_to_proto(_layout(400)))
    assert first is again is layout
    small = interned(_layout(3))
    assert small is not layout and small == _layout(3) and interned(_layout(3)) is small


def test_a_bad_layout_is_refused_each_time() -> None:
    message = metadata_to_proto(_layout(1))
    message.shards_metadata[0].placement = "nowhere"
    for _ in range(2):
        with pytest.raises(ValueError, match=r"shards_metadata\[0\]"):
            metadata_from_proto(message)
    message.shards_metadata[0].placement = "rank:0/cpu"
    assert metadata_from_proto(message) == _layout(1)
    message.tensor_properties.CopyFrom(pb.TensorProperties(dtype=999))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_properties.dtype"):
        metadata_from_proto(message)


def test_a_large_layout_parses_each_placement_text_once() -> None:
    """A thousand shards on two ranks share two parsed placements; a placement refused is refused again."""
    decoded = metadata_from_proto(metadata_to_proto(_layout(1000)))
    placements = {id(shard.placement) for shard in decoded.shards_metadata}
    assert len(placements) == 2
    assert [shard.rank for shard in decoded.shards_metadata[:3]] == [0, 1, 0]
    assert as_placement("rank:1/cpu") is as_placement("rank:1/cpu") == "rank:1/cpu"
    assert as_placement(1) is as_placement("rank:1/cpu")
    for _ in range(2):
        with pytest.raises(ValueError, match="not of the form"):
            as_placement("rank:x/cpu")


def test_decoded_shards_equal_constructed_ones_and_mismatched_dims_are_refused() -> None:
    """Shards decoded from the wire (made from its int tuples without the constructor's coercions) are equal to,
    hash as and box as the ones the constructor makes; offsets and sizes of different dims are refused, naming
    the shard, as the constructor refuses them."""
    layout = _layout(300)
    decoded = metadata_from_proto(metadata_to_proto(layout)).shards_metadata
    for mine, theirs in zip(layout.shards_metadata, decoded):
        assert mine == theirs and hash(mine) == hash(theirs) and mine.box == theirs.box
        assert type(theirs.shard_offsets) is tuple and type(theirs.shard_offsets[0]) is int
    message = metadata_to_proto(_layout(2))
    message.shards_metadata[1].shard_sizes.append(7)
    with pytest.raises(
        ValueError, match=r"shards_metadata\[1\]: shard_offsets has 2 dims but shard_sizes has 3"
    ):
        metadata_from_proto(message)
    large = metadata_to_proto(
        _layout(400)
    )  # decoded whole, not kept by its bytes: named all the same
    large.shards_metadata[250].placement = "rank:x/cpu"
    with pytest.raises(ValueError, match=r"shards_metadata\[250\]: .*not of the form"):
        metadata_from_proto(large)
    with pytest.raises(ValueError, match="shard_offsets has 2 dims but shard_sizes has 3"):
        ShardMetadata((0, 0), (1, 4, 7), "rank:0/cpu")
