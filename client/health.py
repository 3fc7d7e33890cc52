"""The client's side of tensor health: refusing reads of lost boxes with an error that names them.

The coordinator says which copies cannot be read (server/coordinator/health.py);
shardcore.health turns that into lost boxes. A read or lookup touching one
raises ShardsLostError before any rank is asked; the rest of the tensor reads
as usual, from live copies.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from shardserve.client.errors import ShardsLostError
from shardserve.client.info import TensorSummary
from shardserve.core.health import lost_boxes_in, ranks_of_copies
from shardserve.core.metadata import Box

BOXES_NAMED = 8  # an error names this many lost boxes, then counts the rest


def check_readable(summary: TensorSummary, box: Box, unavailable: Set[int]) -> None:
    """ShardsLostError when part of `box` lies in a box of `summary` with no readable copy."""
    lost = lost_boxes_in(summary.metadata, box, unavailable)
    if lost:
        raise shards_lost(summary, lost)


def shards_lost(summary: TensorSummary, boxes: Sequence[Box]) -> ShardsLostError:
    """The error for a read that needs `boxes` of `summary`, which have no live copy."""
    ranks = ranks_of_copies(summary.metadata, boxes)
    named = ", ".join(f"(offsets={b.offsets}, sizes={b.sizes})" for b in boxes[:BOXES_NAMED])
    more = f" and {len(boxes) - BOXES_NAMED} more" if len(boxes) > BOXES_NAMED else ""
    noun = "rank" if len(ranks) == 1 else "ranks"
    return ShardsLostError(
        f"tensor {summary.name!r} version {summary.version}: {len(boxes)} box(es) {named}{more} have no live copy "
        f"({noun} {', '.join(map(str, ranks))} holding them died or lost them in a restart); the tensor's other "
        f"boxes stay readable, and a put with overwrite=True replaces the tensor",
        boxes=tuple((b.offsets, b.sizes) for b in boxes),
        ranks=tuple(ranks),
    )
