"""AsyncRemoteTensor: RemoteShardedTensor with awaitable reads, lookups, refreshes and reshards.

It answers shape, dtype, version and layout from its cached summary like the blocking proxy
(client.description), and reads through the blocking proxy it wraps (`blocking`: the same refresh-and-retry,
copy choice and data paths), each read run off the event loop. Refreshes ask the coordinator on grpc.aio; a
reshard computes its layout off the loop and follows the coordinator's progress stream on grpc.aio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardserve.client import arguments
from shardserve.client.aio.session import AioSession
from shardserve.client.description import TensorDescription
from shardserve.client.info import TensorSummary
from shardserve.client.ops.reshard import (
    DEFAULT_TIMEOUT_S,
    ReshardProgress,
    refused,
    reporter,
    reshard_request,
    reshard_result,
)


class AsyncRemoteTensor(TensorDescription):
    """A sharded tensor held by the cluster at `summary`, read with awaitable methods; `blocking` is the blocking
    proxy they read through."""

    def __init__(self, session: AioSession, summary: TensorSummary) -> None:
        super().__init__(summary)
        self._session = session
        self.blocking = session.proxy(summary)

    @property
    def last_transport(self) -> str | None:
        """ "shm", "bulk" or "grpc": the path of the latest part read (None before any read)."""
        return self.blocking.last_transport

    async def refresh(self) -> AsyncRemoteTensor:
        """Reload the metadata on grpc.aio (a newer version if the tensor was overwritten); returns self."""
        summary = await self._session.summary(self.name)
        self.blocking = self._session.proxy(summary)
        self._summary = summary
        return self

    # ------------------------------------------------------------ reads

    async def fetch(
        self, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The global box at `offsets` of `sizes`, into `out` or a new tensor (RemoteShardedTensor.fetch)."""
        return await self._session.run(
            lambda: self.blocking.fetch(offsets, sizes, out),
            f"fetch of {self.name!r}",
            nbytes=_box_bytes(sizes, self.dtype),
        )

    async def full_tensor(self) -> torch.Tensor:
        """The whole tensor as one local CPU tensor."""
        return await self._session.run(
            self.blocking.full_tensor, f"read of {self.name!r}", nbytes=self.nbytes
        )

    async def lookup(self, ids: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows of this 2-D table for `ids` (1-D ints), like F.embedding: Tensor[len(ids), dim]."""
        return await self._session.run(
            lambda: self.blocking.lookup(ids, dtype), f"lookup in {self.name!r}"
        )

    async def lookup_bag(
        self,
        ids: Any,
        offsets: Any,
        mode: str = "mean",
        per_sample_weights: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        pooling: str = "auto",
    ) -> torch.Tensor:
        """Pooled bags like F.embedding_bag(ids, table, offsets, mode=..., per_sample_weights=...)."""
        return await self._session.run(
            lambda: self.blocking.lookup_bag(
                ids, offsets, mode, per_sample_weights, dtype=dtype, pooling=pooling
            ),
            f"bag lookup in {self.name!r}",
        )

    # ------------------------------------------------------------ resharding (client.ops.reshard)

    async def reshard(
        self,
        spec: Any,
        *,
        bucket_bytes: int | None = None,
        timeout: float | None = None,
        progress: Callable[[ReshardProgress], None] | None = None,
        replicas: int = 1,
    ) -> AsyncRemoteTensor:
        """Move the tensor into layout `spec`, as RemoteShardedTensor.reshard: a proxy of the new version.

        `progress(ReshardProgress)` is called on the event loop with each report: keep it quick."""
        arguments.callback(progress, "progress")
        session = self._session.blocking.session
        request = await self._session.run(
            lambda: reshard_request(
                session,
                self.name,
                tuple(self.shape),
                self.dtype,
                spec,
                bucket_bytes=bucket_bytes,
                timeout=timeout,
                replicas=replicas,
            ),
            f"layout of the reshard of {self.name!r}",
        )
        messages = await self._session.coordinator.follow(
            "Reshard", request, timeout or DEFAULT_TIMEOUT_S, reporter(progress), refused
        )
        summary = reshard_result(self.name, messages)
        return AsyncRemoteTensor(self._session, summary)


def _box_bytes(sizes: Any, dtype: torch.dtype) -> int:
    """The bytes of a box of `sizes` (0 when `sizes` is malformed: the read's own checks name it)."""
    try:
        return max(0, math.prod(int(n) for n in sizes)) * dtype.itemsize
    except (TypeError, ValueError):
        return 0
