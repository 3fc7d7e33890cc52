"""What a rank tells the coordinator it registers with, and answers GetStats with: every version it holds, and
which of them it serves already (a restarted coordinator, or one reconciling a rank back from the dead, then
promotes again only the others)."""

from __future__ import annotations

import torch

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.coordinator_link import CoordinatorLink
from shardserve.server.rank.service import ShardServerServicer
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore


class Leader:
    """The coordinators a link registers with: one leader, whose RegisterRank keeps the request."""

    current = "127.0.0.1:1"

    def __init__(self) -> None:
        self.requests: list[pb.RegisterRankRequest] = []

    def stub(self, address: str) -> Leader:
        return self

    def RegisterRank(self, request, timeout):  # noqa: N802 - the stub's name
        self.requests.append(request)
        return pb.RegisterRankResponse(heartbeat_interval_s=1.0)


EXPECTED = [("t", 1, True), ("t", 2, False), ("u", 3, True)]  # t 2: filled, not promoted yet


def _store() -> ShardStore:
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (4, 4), TensorProperties(dtype=torch.float32)
    )
    store = ShardStore(0)
    for version in (1, 2):
        store.allocate("t", version, meta, fill=InitFill.ZEROS)
    store.promote("t", 1)
    store.allocate("u", 3, meta, fill=InitFill.ZEROS)
    store.promote("u", 3)
    return store


def test_a_registration_names_the_versions_the_rank_serves():
    store = _store()
    leader = Leader()
    info = pb.RankInfo(rank=0, address="127.0.0.1:7000", device="cpu", world_size=1, pid=1)
    CoordinatorLink(leader, info, store).register(timeout=5.0)  # type: ignore[arg-type]
    [request] = leader.requests
    assert [(h.name, h.version, h.served) for h in request.held] == EXPECTED


def test_get_stats_names_the_versions_the_rank_serves():
    """GetStats, which a coordinator asks of a rank back from the dead, marks the served versions alike."""
    stats = ShardServerServicer(_store()).GetStats(pb.GetStatsRequest(), None)  # type: ignore[arg-type]
    assert [(h.name, h.version, h.served) for h in stats.held] == EXPECTED
