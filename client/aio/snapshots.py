"""AsyncSnapshot: one committed snapshot of a prefix, every tensor an AsyncRemoteTensor pinned to it (a packed
one an AsyncPackedTensor), read whole with an awaitable `read()` (the blocking Snapshot's reads, run off the
event loop)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardserve.client.aio.session import AioSession
from shardserve.client.aio.tensor import AsyncRemoteTensor
from shardserve.client.ops.snapshots import SnapshotSummary
from shardserve.client.packed_tensor import PackedTensor
from shardserve.client.snapshots import Snapshot


class AsyncSnapshot:
    """One committed snapshot of a prefix: its tensors, every one at that snapshot."""

    def __init__(self, session: AioSession, summary: SnapshotSummary) -> None:
        self._session = session
        self.summary = summary
        self._blocking = Snapshot(session.blocking.session, session.blocking.lookups, summary)
        self.tensors: dict[str, AsyncRemoteTensor | AsyncPackedTensor] = {
            key: AsyncPackedTensor(session, proxy)
            if isinstance(proxy, PackedTensor)
            else AsyncRemoteTensor(session, proxy.summary)
            for key, proxy in self._blocking.tensors.items()
        }

    @property
    def number(self) -> int:
        return self.summary.number

    def __getitem__(self, key: str) -> AsyncRemoteTensor | AsyncPackedTensor:
        return self.tensors[key]

    def keys(self) -> list[str]:
        return list(self.tensors)

    async def read(self) -> dict[str, torch.Tensor]:
        """Every tensor of the snapshot, whole, as plain tensors (Snapshot.read: several read at once)."""
        nbytes = sum(tensor.nbytes for tensor in self.tensors.values())
        return await self._session.run(
            self._blocking.read,
            f"read of snapshot {self.number} of {self.summary.prefix!r}",
            nbytes=nbytes,
        )

    def __repr__(self) -> str:
        return (
            f"AsyncSnapshot(prefix={self.summary.prefix!r}, number={self.number}, "
            f"tensors={len(self.tensors)})"
        )


class AsyncPackedTensor:
    """A packed tensor of a snapshot (client.packed_tensor) with awaitable reads, run off the event loop."""

    def __init__(self, session: AioSession, blocking: PackedTensor) -> None:
        self._session = session
        self.blocking = blocking

    @property
    def key(self) -> str:
        return self.blocking.key

    @property
    def shape(self) -> torch.Size:
        return self.blocking.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.blocking.dtype

    @property
    def nbytes(self) -> int:
        return self.blocking.nbytes

    async def full_tensor(self) -> torch.Tensor:
        """The whole tensor (PackedTensor.full_tensor)."""
        return await self._session.run(
            self.blocking.full_tensor, f"read of {self.key!r}", nbytes=self.nbytes
        )

    async def fetch(
        self, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The box at `offsets` of `sizes`, into `out` or a new tensor (PackedTensor.fetch)."""
        return await self._session.run(
            lambda: self.blocking.fetch(offsets, sizes, out),
            f"fetch of {self.key!r}",
            nbytes=self.nbytes,
        )

    def __repr__(self) -> str:
        return f"Async{self.blocking!r}"
