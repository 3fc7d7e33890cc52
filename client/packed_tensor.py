"""PackedTensor: one tensor of a snapshot stored in a pack (shardcore.packs), read through its pack's bytes.

A snapshot put with `pack=True` holds its small plain tensors in a few byte tensors; `Snapshot[key]` of such a
key answers this read-only proxy, which reads the tensor's byte range of its pack (one read, the pack's
proxy's paths, retries and verify) and views it as the tensor it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardserve.client.casts import check_read_cast
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.indexing import parse_index
from shardserve.client.tensor import RemoteShardedTensor
from shardserve.core.metadata import Box
from shardserve.core.packs import PackedItem
from shardserve.core.regions import check_box, local_view


class PackedTensor:
    """A packed tensor of one snapshot: its shape and dtype, read whole, by box or by index."""

    def __init__(self, pack: RemoteShardedTensor, pack_key: str, item: PackedItem) -> None:
        self.pack = (
            pack  # the proxy of the pack it lies in, stored under `pack_key` in the snapshot
        )
        self.pack_key = pack_key
        self.item = item

    @property
    def key(self) -> str:
        return self.item.key

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.item.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.item.dtype

    @property
    def nbytes(self) -> int:
        return self.item.nbytes

    def full_tensor(self, *, verify: bool = False) -> torch.Tensor:
        """The whole tensor, read as its byte range of the pack (checked against the pack's checksums with
        `verify`)."""
        item = self.item
        data = self.pack.fetch((item.offset,), (item.nbytes,), verify=verify)
        return data.view(item.dtype).view(item.shape)

    def fetch(
        self,
        offsets: Sequence[int],
        sizes: Sequence[int],
        out: torch.Tensor | None = None,
        *,
        verify: bool = False,
    ) -> torch.Tensor:
        """The box at `offsets` of `sizes`, into `out` (converted to its floating dtype) or a new tensor."""
        try:
            box = Box(tuple(offsets), tuple(sizes))
            check_box(self.item.shape, box)
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(
                f"offsets/sizes: {err} (tensor {self.key!r} has shape {self.item.shape})"
            ) from None
        whole = self.full_tensor(verify=verify)
        part = local_view(whole, Box((0,) * whole.dim(), self.item.shape), box)
        if out is None:
            return part.clone()
        if tuple(out.shape) != box.sizes:
            raise InvalidArgumentError(
                f"out has shape {tuple(out.shape)} but sizes are {box.sizes}"
            )
        check_read_cast(self.item.dtype, out.dtype, self.key)
        return out.copy_(part)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """`t[i, a:b, ...]` with ints and step-1 slices, as RemoteShardedTensor's."""
        box, dropped = parse_index(index, self.item.shape)
        result = self.fetch(box.offsets, box.sizes)
        if dropped:
            result = result.reshape([n for d, n in enumerate(box.sizes) if d not in dropped])
        return result

    def __repr__(self) -> str:
        return (
            f"PackedTensor(key={self.key!r}, shape={tuple(self.item.shape)}, dtype={self.dtype}, "
            f"pack={self.pack.name!r})"
        )
