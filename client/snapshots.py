"""Snapshot: one committed snapshot of a prefix read as a whole, every tensor a proxy pinned to it.

A reader of a snapshot sees every tensor of that snapshot and never a mix: the
tensors of a snapshot have names of their own (PREFIX@NUMBER/KEY) that no later
put replaces; they are dropped only once `keep` newer snapshots are committed.
A snapshot put with `pack=True` holds its small tensors in packs: each such key
is a PackedTensor, read through its pack, and `read()` reads each pack once.
"""

from __future__ import annotations

from concurrent import futures

import torch

from shardserve.client.embedding.lookup import Lookups
from shardserve.client.ops.snapshots import SnapshotSummary
from shardserve.client.packed_tensor import PackedTensor
from shardserve.client.session import Session
from shardserve.client.spmd_packs import item_view, stored_packs
from shardserve.client.tensor import RemoteShardedTensor


class Snapshot:
    """One committed snapshot of a prefix, read as a whole: every tensor is a proxy pinned to this snapshot."""

    def __init__(self, session: Session, lookups: Lookups, summary: SnapshotSummary) -> None:
        self._session = session
        self.summary = summary
        packs = stored_packs(summary.skeleton)
        stored = {
            key: RemoteShardedTensor(session, lookups, s) for key, s in summary.tensors.items()
        }
        self._packs = {pack.key: stored.pop(pack.key) for pack in packs}
        self.tensors: dict[str, RemoteShardedTensor | PackedTensor] = dict(stored)
        self.tensors.update(
            {
                item.key: PackedTensor(self._packs[pack.key], pack.key, item)
                for pack in packs
                for item in pack.items
            }
        )

    @property
    def number(self) -> int:
        return self.summary.number

    def __getitem__(self, key: str) -> RemoteShardedTensor | PackedTensor:
        return self.tensors[key]

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self) -> dict[str, torch.Tensor]:
        """Every tensor of the snapshot, whole, as plain tensors (several read at once)."""
        pool = self._session.read_pool
        reads = {
            key: pool.submit(proxy.full_tensor)
            for key, proxy in {**self.tensors, **self._packs}.items()
            if not isinstance(proxy, PackedTensor)
        }
        futures.wait(reads.values())
        read = {key: future.result() for key, future in reads.items()}
        return {
            key: read[key]
            if not isinstance(proxy, PackedTensor)
            else item_view(read[proxy.pack_key], proxy.item).clone()
            for key, proxy in self.tensors.items()
        }

    def __repr__(self) -> str:
        return f"Snapshot(prefix={self.summary.prefix!r}, number={self.number}, tensors={len(self.tensors)})"
