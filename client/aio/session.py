"""AioSession: what the asyncio client's objects share of one connection.

The blocking Cluster (its session, data paths, lookups and health leases: one connection's state, kept in one
place), the coordinator's calls on grpc.aio, and the pool that runs the blocking client's operations off the
event loop, each under the deadline the blocking client gives the same work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from shardserve.client import catalog_requests as catalog
from shardserve.client.aio.coordinator import AioCoordinator
from shardserve.client.aio.offload import Offload
from shardserve.client.cluster import Cluster
from shardserve.client.info import TensorSummary
from shardserve.client.tensor import RemoteShardedTensor

T = TypeVar("T")


class AioSession:
    """One asyncio client's connection: `blocking` (the Cluster whose data paths it uses), `coordinator`
    (grpc.aio) and `offload` (the pool)."""

    def __init__(self, blocking: Cluster, coordinator: AioCoordinator, offload: Offload) -> None:
        self.blocking = blocking
        self.coordinator = coordinator
        self.offload = offload

    @property
    def timeout(self) -> float:
        """The client's control deadline (connect's `timeout`)."""
        return self.blocking.session.channel.timeout

    def deadline(self, nbytes: int = 0, *, calls: int = 1) -> float:
        """The deadline of an operation of `calls` control calls moving `nbytes`, as the blocking client bounds
        its calls: the control timeout each, plus time for the bytes."""
        channel = self.blocking.session.channel
        return channel.data_timeout(nbytes) + (calls - 1) * channel.timeout

    async def run(self, job: Callable[[], T], what: str, *, nbytes: int = 0, calls: int = 1) -> T:
        """`job()` (blocking) off the loop under deadline(nbytes, calls=calls)."""
        self.blocking.session.check_open()
        return await self.offload.run(job, deadline=self.deadline(nbytes, calls=calls), what=what)

    async def summary(self, name: str) -> TensorSummary:
        """The catalog entry of the READY tensor `name`, asked on grpc.aio (as Session.summary asks it)."""
        self.blocking.session.check_open()
        info = await self.coordinator.call("GetTensor", catalog.get_tensor_request(name))
        self.blocking.session.saw_version(info.name, info.version)
        return TensorSummary.from_proto(info)

    def proxy(self, summary: TensorSummary) -> RemoteShardedTensor:
        """The blocking proxy of `summary` on this connection (its reads run off the loop)."""
        return RemoteShardedTensor(self.blocking.session, self.blocking.lookups, summary)

    async def close(self) -> None:
        """Close the blocking client (channels, mappings, bulk connections), the pool and the grpc.aio channel."""
        self.offload.close()
        self.blocking.close()
        await self.coordinator.close()


def nbytes_of(tensor: Any) -> int:
    """The bytes of `tensor` when it is one (0 otherwise: the operation's own checks name the problem)."""
    return tensor.nbytes if isinstance(tensor, torch.Tensor) else 0
