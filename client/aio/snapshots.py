"""AsyncSnapshot: one committed snapshot of a prefix, every tensor an AsyncRemoteTensor pinned to it, read
whole with an awaitable `read()` (the blocking Snapshot's reads, run off the event loop)."""

from __future__ import annotations

import torch

from shardserve.client.aio.session import AioSession
from shardserve.client.aio.tensor import AsyncRemoteTensor
from shardserve.client.ops.snapshots import SnapshotSummary
from shardserve.client.snapshots import Snapshot


class AsyncSnapshot:
    """One committed snapshot of a prefix: its tensors, every one at that snapshot."""

    def __init__(self, session: AioSession, summary: SnapshotSummary) -> None:
        self._session = session
        self.summary = summary
        self.tensors = {key: AsyncRemoteTensor(session, s) for key, s in summary.tensors.items()}

    @property
    def number(self) -> int:
        return self.summary.number

    def __getitem__(self, key: str) -> AsyncRemoteTensor:
        return self.tensors[key]

    def keys(self) -> list[str]:
        return list(self.tensors)

    async def read(self) -> dict[str, torch.Tensor]:
        """Every tensor of the snapshot, whole, as plain tensors (Snapshot.read: several read at once)."""
        blocking = Snapshot(
            self._session.blocking.session, self._session.blocking.lookups, self.summary
        )
        nbytes = sum(tensor.nbytes for tensor in self.tensors.values())
        return await self._session.run(
            blocking.read,
            f"read of snapshot {self.number} of {self.summary.prefix!r}",
            nbytes=nbytes,
        )

    def __repr__(self) -> str:
        return (
            f"AsyncSnapshot(prefix={self.summary.prefix!r}, number={self.number}, "
            f"tensors={len(self.tensors)})"
        )
