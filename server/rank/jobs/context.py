"""What a collective job kind gets when it runs on the rank: store, rank, deadline and progress."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from protos import shardserve_pb2 as pb
from server.rank.store import ShardStore


@dataclass
class JobContext:
    """What a job kind gets: the store, this rank, the deadline, and a place to report progress."""

    store: ShardStore
    rank: int
    job: pb.CollectiveJob
    deadline: float
    progress: pb.CollectiveProgress = field(default_factory=pb.CollectiveProgress)
    live_bytes_done: Callable[[], int] | None = None

    def time_left(self) -> float:
        return max(1e-3, self.deadline - time.monotonic())

    def snapshot(self) -> pb.CollectiveProgress:
        out = pb.CollectiveProgress()
        out.CopyFrom(self.progress)
        if self.live_bytes_done is not None:
            out.bytes_done = self.live_bytes_done()
        return out
