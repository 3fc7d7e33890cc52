"""Ids and rows of a 2-D table as requests carry them: raw int64 ids, raw row values, and the rows of one
shard that global ids name (lookups read them, WriteRows writes them)."""

from __future__ import annotations

import numpy as np
import torch

from shardserve.server.rank.errors import InvalidArgument
from shardserve.server.rank.version_table import StoredVersion

ID_BYTES = 8


def parse_ids(raw: bytes, field: str) -> np.ndarray:
    """Raw little-endian int64 bytes as a read-only 1-D int64 array over the request's bytes (no copy).

    Ids are handled with numpy: a lookup's few small steps cost ~1 us each that way, against ~5-10 us per
    torch call, which for one-id lookups was most of the rank's time."""
    if len(raw) % ID_BYTES:
        raise InvalidArgument(
            f"{field} has {len(raw)} bytes, not a multiple of 8 (ids are raw int64)"
        )
    return np.frombuffer(raw, dtype="<i8")


def parse_rows(raw: bytes, dtype: torch.dtype, shape: tuple[int, int], field: str) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = shape[0] * shape[1] * itemsize
    if len(raw) != expected:
        raise InvalidArgument(
            f"{field} has {len(raw)} bytes; {shape[0]} x {shape[1]} {dtype} values are "
            f"{expected} bytes"
        )
    if not expected:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)


def local_rows(entry: StoredVersion, shard_index: int, ids: np.ndarray, field: str) -> np.ndarray:
    """Shard-local row numbers of global `ids`; InvalidArgument naming the first id the shard does not hold."""
    meta = entry.metadata
    if meta.ndim != 2:
        raise InvalidArgument(f"tensor {entry.name!r} is {meta.ndim}-D; lookups need a 2-D table")
    shard = meta.shards_metadata[shard_index]
    start, rows = shard.shard_offsets[0], shard.shard_sizes[0]
    if not ids.size:
        return ids
    if start <= int(ids.min()) and int(ids.max()) < start + rows:
        return ids - start
    position = int(np.flatnonzero((ids < start) | (ids >= start + rows))[0])
    value = int(ids[position])
    where = (
        f"out of range for a table of {meta.size[0]} rows"
        if not 0 <= value < meta.size[0]
        else f"not held by shard {shard_index} (rows {start}..{start + rows - 1})"
    )
    raise InvalidArgument(f"{field}[{position}]={value} is {where}")
