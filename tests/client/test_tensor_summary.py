"""The client's summary of a coordinator's TensorInfo: its state's name, and the shards it cannot read (the
unavailable and the lost) as the answer gave them."""

from __future__ import annotations

import pytest
import torch

from shardserve.client.info import TensorSummary
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb

LAYOUT = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]).build_metadata(
    (6, 4), TensorProperties(dtype=torch.float32)
)


def info(**fields) -> pb.TensorInfo:
    return pb.TensorInfo(name="t", version=3, metadata=metadata_to_proto(LAYOUT), **fields)


@pytest.mark.parametrize(
    ("unavailable", "lost", "cannot_read"),
    [([], [], set()), ([1], [], {1}), ([], [2], {2}), ([0, 1], [2], {0, 1, 2})],
)
def test_the_shards_it_cannot_read_are_the_unavailable_and_the_lost(unavailable, lost, cannot_read):
    summary = TensorSummary.from_proto(
        info(state=pb.READY, unavailable_shards=unavailable, lost_shards=lost)
    )
    assert summary.unavailable == frozenset(cannot_read) and summary.lost == frozenset(lost)
    assert summary.state == "READY" and summary.version == 3 and summary.metadata == LAYOUT
    assert summary.nbytes == 6 * 4 * 4


def test_each_state_is_named_and_a_newer_servers_state_by_its_number():
    assert TensorSummary.from_proto(info(state=pb.PENDING)).state == "PENDING"
    assert TensorSummary.from_proto(info()).state == "UNSPECIFIED"
    assert TensorSummary.from_proto(info(state=9)).state == "9"
