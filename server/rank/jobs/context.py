"""What a collective job kind gets when it runs on the rank: store, rank, deadline, progress and its group."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch.distributed as dist

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.jobs.groups import PeerGroup, ProcessGroups
from shardserve.server.rank.store import ShardStore


@dataclass
class JobContext:
    """What a job kind gets: the store, this rank, the deadline, a place to report progress, and the groups."""

    store: ShardStore
    rank: int
    job: pb.CollectiveJob
    deadline: float
    progress: pb.CollectiveProgress = field(default_factory=pb.CollectiveProgress)
    live_bytes_done: Callable[[], int] | None = None
    groups: ProcessGroups | None = None

    def time_left(self) -> float:
        return max(1e-3, self.deadline - time.monotonic())

    def snapshot(self) -> pb.CollectiveProgress:
        out = pb.CollectiveProgress()
        out.CopyFrom(self.progress)
        if self.live_bytes_done is not None:
            out.bytes_done = self.live_bytes_done()
        return out

    def peer_group(self) -> PeerGroup:
        """The job's process group (epoch, ranks), formed with every other participant unless cached: every
        participant of a kind that calls this must call it, or the others wait for it until the deadline."""
        return self._groups().for_job(self.job.epoch, self.job.ranks, self.time_left())

    def default_world(self) -> AbstractContextManager[dist.ProcessGroup | None]:
        """The job's participants as c10d's default world while the block runs (DCP needs one); without
        groups (an in-process caller), the default world, if any, that the caller made."""
        if self.groups is None:
            return nullcontext()
        return self.groups.default_world(
            self.job.epoch, self.job.ranks, self.job.seq, self.time_left()
        )

    def _groups(self) -> ProcessGroups:
        """The rank's groups; a context made without them (in-process callers) has no job group."""
        if self.groups is None:
            raise RuntimeError("this job context has no process groups")
        return self.groups
