"""Planning a rank's part of a reshard into rounds: which buckets it sends or receives in which round, and
where each bucket's bytes lie on this end (a flat view of a shard, or a staging buffer on which device).

Round k holds the k-th bucket of every (src_rank, dst_rank) pair this rank is an end of, in the plan's
order; both ends of a bucket compute the same round from the same plan (server/rank/jobs/reshard.py tells
why this ordering cannot deadlock). Pure logic: no process group, no waits.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardserve.core.planner import Bucket, ReshardPlan
from shardserve.server.rank.jobs.groups import Verb


class Role(enum.Enum):
    """Which end of a bucket this rank is."""

    SOURCE = "source"
    DESTINATION = "destination"


@dataclass(frozen=True)
class BucketOp:
    """One bucket of a round, from this rank's end: sent (as its source) or received (as its destination)."""

    role: Role
    bucket: Bucket

    @property
    def verb(self) -> Verb:
        return Verb.SEND if self.role is Role.SOURCE else Verb.RECEIVE

    @property
    def peer(self) -> int:
        """The rank at the bucket's other end."""
        return self.bucket.dst_rank if self.role is Role.SOURCE else self.bucket.src_rank


def plan_rounds(
    rank: int, sends: tuple[Bucket, ...], recvs: tuple[Bucket, ...]
) -> list[list[BucketOp]]:
    """Round k holds the k-th bucket of every peer pair `rank` is an end of."""
    per_pair: dict[tuple[int, int], list[Bucket]] = {}
    for bucket in itertools.chain(sends, recvs):
        per_pair.setdefault((bucket.src_rank, bucket.dst_rank), []).append(bucket)
    rounds: list[list[BucketOp]] = []
    for _, buckets in sorted(per_pair.items()):
        for k, bucket in enumerate(buckets):
            while len(rounds) <= k:
                rounds.append([])
            role = Role.SOURCE if bucket.src_rank == rank else Role.DESTINATION
            rounds[k].append(BucketOp(role, bucket))
    return rounds


def wire_device(plan: ReshardPlan, bucket: Bucket) -> str:
    """ "cuda" when both ends of every transfer in the bucket are CUDA shards, else "cpu"."""
    src, dst = plan.src.shards_metadata, plan.dst.shards_metadata
    both_cuda = all(
        src[t.src_shard].device.type == "cuda" and dst[t.dst_shard].device.type == "cuda"
        for t in bucket.transfers
    )
    return "cuda" if both_cuda else "cpu"


def local_device(plan: ReshardPlan, op: BucketOp) -> torch.device:
    """The device this end of a bucket stages it on: its first shard's device, or the CPU."""
    if wire_device(plan, op.bucket) == "cpu":
        return torch.device("cpu")
    first = op.bucket.transfers[0]
    if op.role is Role.SOURCE:
        return plan.src.shards_metadata[first.src_shard].device
    return plan.dst.shards_metadata[first.dst_shard].device


def direct_view(
    plan: ReshardPlan, op: BucketOp, tensors: Mapping[int, torch.Tensor]
) -> torch.Tensor | None:
    """The bucket's bytes as a flat view of this end's shard (`tensors`: the source shards or the new ones):
    one box, contiguous, on the wire's device type; else None (it goes through a staging buffer)."""
    if len(op.bucket.transfers) != 1:
        return None
    t = op.bucket.transfers[0]
    source = op.role is Role.SOURCE
    tensor = tensors[t.src_shard if source else t.dst_shard]
    offsets = t.src_local_offsets() if source else t.dst_local_offsets()
    view = tensor
    for d, (o, s) in enumerate(zip(offsets, t.sizes)):
        view = view.narrow(d, o, s)
    if not view.is_contiguous() or view.device.type != wire_device(plan, op.bucket):
        return None
    return view.reshape(-1).view(torch.uint8)
