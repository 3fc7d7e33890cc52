"""RemoteShardedTensor: a ShardedTensor-like proxy of a tensor held by the cluster's ranks.

It caches the tensor's metadata at one version (TensorDescription answers shape, dtype and layout from it) and
reads through a TensorReader (client.reads): every shard a read touches in parallel, refreshed and retried
whole when the version is gone, each box from a live copy. Lookups go through client.embedding, reshards and
row updates through client.ops.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardserve.client import arguments
from shardserve.client.description import TensorDescription
from shardserve.client.embedding.lookup import Lookups
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.indexing import parse_index
from shardserve.client.info import RepairProgress, TensorSummary
from shardserve.client.ops.reshard import reshard as reshard_tensor
from shardserve.client.ops.row_updates import update_rows
from shardserve.client.reads import TensorReader
from shardserve.client.session import Session
from shardserve.client.verify import expected_checksum
from shardserve.core.metadata import Box, ShardMetadata


@dataclass(frozen=True)
class RemoteShard:
    """One shard of a remote tensor at one version: its metadata and a way to fetch it."""

    tensor: RemoteShardedTensor = field(repr=False)
    index: int
    summary: TensorSummary = field(repr=False)

    @property
    def metadata(self) -> ShardMetadata:
        return self.summary.metadata.shards_metadata[self.index]

    @property
    def version(self) -> int:
        return self.summary.version

    @property
    def rank(self) -> int:
        return self.metadata.rank

    @property
    def checksum(self) -> int:
        """The xxh3-64 of the shard's bytes as the catalog keeps it (shardserve.core.checksums; 0: not known)."""
        return expected_checksum(self.summary, self.index)

    def __repr__(self) -> str:
        return (
            f"RemoteShard(name={self.summary.name!r}, version={self.version}, index={self.index}, "
            f"offsets={self.metadata.shard_offsets}, sizes={self.metadata.shard_sizes}, "
            f"placement='{self.metadata.placement}')"
        )

    def fetch(self) -> torch.Tensor:
        """The whole shard, read from its own rank (raises StaleVersionError once the version is gone)."""
        box = self.metadata.box
        out = torch.empty(box.sizes, dtype=self.summary.metadata.dtype)
        self.tensor.reader.read_parts(self.summary, [(self.index, box)], box, out)
        return out


class RemoteShardedTensor(TensorDescription):
    """A sharded tensor held by the cluster, read by offset, slice or whole."""

    def __init__(self, session: Session, lookups: Lookups, summary: TensorSummary) -> None:
        super().__init__(summary)
        self._session = session
        self._lookups = lookups
        self.reader = TensorReader(session, *_summaries_of(self))

    @property
    def last_transport(self) -> str | None:
        """ "shm", "bulk" or "grpc": the path of the latest part read (None before any read)."""
        return self.reader.last_transport

    # ------------------------------------------------------------ health (shardcore.health)

    @property
    def health(self) -> str:
        """ "healthy", "degraded" (some box has fewer live copies than replicas), "unavailable" (some box has no
        copy on a live rank now: reads of it wait for one) or "lost" (some box's every copy is known gone), as the
        coordinator says now (asks it: the proxy then follows the latest version)."""
        return self.refresh()._summary.health

    @property
    def lost_boxes(self) -> list[Box]:
        """The boxes with no copy on a live rank (reads touching them raise RankUnavailableError, or
        ShardsLostError once every copy is known gone), as the coordinator says now."""
        return list(self.refresh()._summary.layout_health.lost_boxes)

    @property
    def repair(self) -> RepairProgress | None:
        """The coordinator's repair of this tensor in flight (version made, bytes copied, ranks receiving), or
        None, as the coordinator says now."""
        return self.refresh()._summary.repair

    def remote_shards(self) -> dict[int, list[RemoteShard]]:
        """{rank: [RemoteShard]} of the cached version, like ShardedTensor.remote_shards without RRefs."""
        summary = self._summary
        shards: dict[int, list[RemoteShard]] = {}
        for index, shard in enumerate(summary.metadata.shards_metadata):
            shards.setdefault(shard.rank, []).append(RemoteShard(self, index, summary))
        return shards

    def refresh(self) -> RemoteShardedTensor:
        """Reload the metadata (a newer version if the tensor was overwritten); returns self."""
        self._summary = self._session.summary(self.name)
        return self

    def reshard(
        self,
        spec: Any,
        bucket_bytes: int | None = None,
        timeout: float | None = None,
        progress: Any = None,
        replicas: int = 1,
    ) -> RemoteShardedTensor:
        """Move the tensor into layout `spec` (any spec `put` takes, over any ranks): a proxy of the new version.

        Two-phase on the cluster (see client.ops.reshard): reads keep the old version until the new one is
        committed; `timeout` bounds the data movement, `progress(ReshardProgress)` sees bytes moved;
        `replicas` > 1 holds every box of `spec` on that many live ranks (shardcore.replicas).
        """
        summary = reshard_tensor(
            self._session,
            self.name,
            tuple(self.shape),
            self.dtype,
            spec,
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            progress=progress,
            replicas=replicas,
        )
        return RemoteShardedTensor(self._session, self._lookups, summary)

    # ------------------------------------------------------------ embedding lookups (client.embedding.lookup)

    def lookup(self, ids: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows of this 2-D table for `ids` (1-D ints), like F.embedding: Tensor[len(ids), dim]."""
        return self._lookups.lookup({self.name: ids}, dtype)[self.name]

    def lookup_bag(
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
        return self._lookups.lookup_bag(
            self.name, ids, offsets, mode, per_sample_weights, dtype=dtype, pooling=pooling
        )

    def update_rows(self, ids: Any, values: torch.Tensor) -> int:
        """Replace rows in a new version, atomically; the proxy then follows it. Returns the new version."""
        version = update_rows(self._session, self._lookups.views, self.name, ids, values)
        self.refresh()
        return version

    # ------------------------------------------------------------ reads (client.reads)

    def fetch(
        self,
        offsets: Sequence[int],
        sizes: Sequence[int],
        out: torch.Tensor | None = None,
        *,
        verify: bool = False,
    ) -> torch.Tensor:
        """The global box at `offsets` of `sizes`, into `out` (any strides, any device) or a new tensor. With
        `verify`, the bytes read are checked against the shards' checksums, another copy read where one does not
        match (ChecksumMismatchError when none does; client.verify)."""
        try:
            box = Box(tuple(offsets), tuple(sizes))
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(f"offsets/sizes: {err}") from None
        return self.reader.read(lambda shape: box, out, verify=arguments.flag(verify, "verify"))

    def read_plan(self, box: Box, out: torch.Tensor) -> tuple[TensorSummary, list[tuple[int, Box]]]:
        """The summary and the (shard index, global part) of each shard that a fetch of `box` into `out` would read,
        a live copy chosen as fetch chooses it; raises as fetch does for a bad box or `out` (callers that read
        the parts themselves, like batched small reads)."""
        return self.reader.plan(box, out)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """`t[i, a:b, ...]` with ints and step-1 slices (negative ones too); ints drop their dim like torch."""
        parsed: list[tuple[Box, tuple[int, ...]]] = []

        def resolve(shape: tuple[int, ...]) -> Box:  # re-resolved if a refresh changed the shape
            parsed.append(parse_index(index, shape))
            return parsed[-1][0]

        result = self.reader.read(resolve, None)
        box, dropped = parsed[-1]
        if dropped:
            result = result.reshape([n for d, n in enumerate(box.sizes) if d not in dropped])
        return result

    def full_tensor(self, *, verify: bool = False) -> torch.Tensor:
        """The whole tensor as one local CPU tensor (checked against its checksums with `verify`)."""
        return self.reader.read(
            lambda shape: Box((0,) * len(shape), shape),
            None,
            verify=arguments.flag(verify, "verify"),
        )


def _summaries_of(
    tensor: RemoteShardedTensor,
) -> tuple[Callable[[], TensorSummary], Callable[[], TensorSummary]]:
    """`tensor`'s summary as its reader sees it, cached and refreshed, through a weak reference: the proxy holds
    its reader, and a reader holding its proxy would be a reference cycle that only the cyclic collector frees
    (a state-dict get makes one proxy per tensor, hundreds every step)."""
    proxy = weakref.proxy(tensor)
    return (lambda: proxy._summary, lambda: proxy.refresh()._summary)
