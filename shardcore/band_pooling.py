"""Bags pooled straight from a table's row bands: one `F.embedding_bag` per shard, the partial sums added.

A band is the rows [start, end) of a table, held whole or cut in column pieces: tensors over the shards'
storage (a shared-memory mapping, say), so no row is copied out of them. `pool_from_bands` cuts a request's
bags by band (each band's ids translated to its own rows, the same bags' offsets over them, their weights),
pools every band piece with one `F.embedding_bag`, adds the bands' partial sums and puts column pieces side
by side. Precision as shardcore.embedding's partial pooling: a request whose ids all live in one band is
torch's own kernel over them (bit for bit `F.embedding_bag` on the whole table); a bag spread over several
bands is summed band by band, then the bands' sums added (within a few ulps of the dtype, so callers keep
float16/bfloat16 tables spread over bands off this path); "mean" divides by the bag's total count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RowBand:
    """Rows [start, end) of a table as (first column, tensor [end - start, width]) pieces tiling its columns."""

    start: int
    end: int
    pieces: tuple[tuple[int, torch.Tensor], ...]


@dataclass(frozen=True)
class BandBags:
    """The ids of a request that one band holds, as bags of their own: band rows, offsets, weights."""

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None


def split_by_band(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    starts: Sequence[int],
    weights: torch.Tensor | None = None,
) -> list[BandBags]:
    """Per band (first rows `starts`, ascending, starts[0] <= every id): its ids minus its start, in the
    caller's order, with offsets of the same bags over them (empty where a bag has none) and their weights.
    1-D int64 CPU ids and offsets; numpy does the cutting (a fraction of torch's per-call cost)."""
    if len(starts) == 1:
        return [BandBags(ids - starts[0] if starts[0] else ids, offsets, weights)]
    values, bag_starts = ids.numpy(), offsets.numpy()
    if len(starts) == 2:
        upper = values >= starts[1]
        masks = [~upper, upper]
    else:
        band = np.searchsorted(np.asarray(starts[1:], dtype=np.int64), values, side="right")
        masks = [band == number for number in range(len(starts))]
    before = np.empty(
        values.size + 1, dtype=np.int64
    )  # before[i]: the band's ids among the first i
    before[0] = 0
    rest, cut = bag_starts, []
    for number, (mask, start) in enumerate(zip(masks, starts)):
        local = values.compress(mask)
        if start:
            local -= start
        if number < len(masks) - 1:
            np.cumsum(mask, out=before[1:])
            band_starts = before.take(bag_starts)
            rest = rest - band_starts
        else:  # the last band's ids are those of no other band
            band_starts = rest
        chosen = None
        if weights is not None:
            chosen = weights.index_select(0, torch.from_numpy(np.flatnonzero(mask)))
        cut.append(BandBags(torch.from_numpy(local), torch.from_numpy(band_starts), chosen))
    return cut


def pool_from_bands(
    bands: Sequence[RowBand],
    ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.embedding_bag(ids, table, offsets, mode=mode, per_sample_weights=weights) over the table the `bands`
    tile (ascending, every id in one of them): 1-D int64 ids, nn.EmbeddingBag offsets
    (include_last_offset=False), "sum" or "mean"."""
    first = bands[0].pieces
    dim = sum(int(piece.shape[1]) for _, piece in first)
    if (
        ids.numel() == 0 or offsets.numel() == 0
    ):  # torch's kernel cannot pool nothing in every dtype
        return torch.zeros((offsets.numel(), dim), dtype=first[0][1].dtype)
    cut = split_by_band(ids, offsets, [band.start for band in bands], weights)
    if len(bands) == 1:
        return _pool_band(bands[0], cut[0], mode)
    total: torch.Tensor | None = None
    for band, bags in zip(bands, cut):
        if bags.ids.numel() == 0:
            continue
        partial = _pool_band(band, bags, "sum")
        total = partial if total is None else total.add_(partial)
    assert total is not None  # ids is not empty and every id is in a band
    if mode == "mean":
        counts = torch.diff(offsets, append=offsets.new_tensor([ids.numel()]))
        total.div_(counts.clamp_(min=1).to(total.dtype).unsqueeze(1))
    return total


def _pool_band(band: RowBand, bags: BandBags, mode: str) -> torch.Tensor:
    """One band's bags, its column pieces pooled one by one and put side by side."""
    pooled = [
        F.embedding_bag(bags.ids, piece, bags.offsets, mode=mode, per_sample_weights=bags.weights)
        for _, piece in band.pieces
    ]
    return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)
