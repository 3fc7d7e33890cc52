"""Embedding-serving math with `nn.Embedding` / `nn.EmbeddingBag` semantics, split across shards.

Pure torch, no I/O. The pieces a lookup goes through:

- `validate_ids` / `lookup_rows`: ids as int64, out-of-range policy ("error",
  "zero", "default"), rows gathered exactly as `F.embedding` does.
- `dedup_ids` / `restore_order`: fetch each distinct id once, give the
  caller its order back.
- `pool_bags`: pool looked-up rows into bags. It runs torch's own
  `F.embedding_bag` kernel over the rows (indices `0..n-1`), so the result is
  bit for bit `F.embedding_bag(ids, table, offsets, ...)` in every dtype: same
  kernel, same values, same reduction order.
- `bag_subset` / `partial_pool` / `combine_partials`: pooling on the shards.
  A shard holding whole rows (of its column range) pools the ids it owns into
  per-bag partial sums and counts, so only pooled rows travel; the client adds
  the partials per column range, divides by the total count for "mean" and
  concatenates the column ranges.

Precision of partial pooling, held against `F.embedding_bag` on the full
table by tests/shardcore/test_embedding_math.py: each shard's partial sums are what
torch's CPU kernel sums (in float32 for float16 rows, in bfloat16 for bfloat16
rows), kept in float32 for both, and the combined result is cast to the table
dtype before the "mean" division, as torch does. A bag whose ids all live on
one shard is therefore bit for bit torch's in every dtype. A bag spread over
several shards is summed in another order (shard partials, then their sum),
so it matches within a few ulps of the dtype, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardserve.core.routing import unique_ids

OOV_POLICIES: tuple[str, ...] = ("error", "zero", "default")
POOLING_MODES: tuple[str, ...] = ("sum", "mean")
_REDUCED_FLOATS = (torch.float16, torch.bfloat16)


def validate_ids(
    ids: torch.Tensor | Sequence[int], num_rows: int, oov: str = "error"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` as a 1-D int64 tensor and a mask of the out-of-range ones; raise for them if oov="error"."""
    if oov not in OOV_POLICIES:
        raise ValueError(f"oov must be one of {OOV_POLICIES}, got {oov!r}")
    num_rows = _non_negative_int(num_rows, "num_rows")
    ids = _as_index_tensor(ids, "ids")
    out_of_range = (ids < 0) | (ids >= num_rows)
    if oov == "error" and bool(out_of_range.any()):
        position = int(out_of_range.nonzero()[0, 0])
        raise ValueError(
            f"ids[{position}]={int(ids[position])} is out of range for a table of {num_rows} rows "
            f"(valid ids are 0..{num_rows - 1}; {int(out_of_range.sum())} bad id(s) in all)"
        )
    return ids, out_of_range


def lookup_rows(
    table: torch.Tensor,
    ids: torch.Tensor | Sequence[int],
    oov: str = "error",
    default_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of a 2-D `table` for `ids`, like `F.embedding`, with zeros or `default_row` for bad ids."""
    _check_table(table, "table")
    ids, out_of_range = validate_ids(ids, table.shape[0], oov)
    default = _default_row(table, oov, default_row)
    if not bool(out_of_range.any()):
        return table.index_select(0, ids)
    rows = (
        table.index_select(0, ids.masked_fill(out_of_range, 0))
        if table.shape[0]
        else table.new_empty((ids.numel(), table.shape[1]))
    )
    rows[out_of_range] = default
    return rows


def dedup_ids(ids: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct ids and, per id, its index in them (`ids == unique[inverse]`)."""
    return unique_ids(_as_index_tensor(ids, "ids"))


def restore_order(unique_rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows in the caller's order from the rows of the distinct ids (`dedup_ids`'s `inverse`)."""
    if not isinstance(unique_rows, torch.Tensor) or unique_rows.dim() < 1:
        raise ValueError("unique_rows must be a tensor with one row per distinct id")
    inverse = _as_index_tensor(inverse, "inverse")
    if inverse.numel() and (int(inverse.min()) < 0 or int(inverse.max()) >= unique_rows.shape[0]):
        raise ValueError(f"inverse holds indices outside 0..{unique_rows.shape[0] - 1}")
    return unique_rows.index_select(0, inverse)


def pool_bags(
    rows: torch.Tensor,
    offsets: torch.Tensor | Sequence[int] | None,
    mode: str = "mean",
    per_sample_weights: torch.Tensor | None = None,
    num_bags: int | None = None,
) -> torch.Tensor:
    """Pool looked-up `rows` (one per id, in id order) into bags, bit for bit `F.embedding_bag`.

    `offsets` are `nn.EmbeddingBag`'s (include_last_offset=False): bag b holds
    rows offsets[b]..offsets[b+1]-1, the last bag runs to the end, empty bags
    pool to zeros. With `offsets=None`, `num_bags` equal bags are cut, as
    `nn.EmbeddingBag` does for 2-D input.
    """
    _check_table(rows, "rows")
    offsets = _bag_offsets(offsets, rows.shape[0], num_bags)
    _check_mode(mode, per_sample_weights)
    weights = _check_weights(per_sample_weights, rows)
    if (
        rows.shape[0] == 0 or offsets.numel() == 0 or rows.shape[1] == 0
    ):  # torch's kernel segfaults (float64,
        return rows.new_zeros((offsets.numel(), rows.shape[1]))  # no bags) or raises (no columns)
    positions = torch.arange(rows.shape[0], dtype=torch.int64, device=rows.device)
    return F.embedding_bag(positions, rows, offsets, mode=mode, per_sample_weights=weights)


def bag_of_ids(offsets: torch.Tensor | Sequence[int], num_ids: int) -> torch.Tensor:
    """Index of the bag each of `num_ids` ids belongs to, for `nn.EmbeddingBag` offsets."""
    num_ids = _non_negative_int(num_ids, "num_ids")
    offsets = _bag_offsets(offsets, num_ids, None)
    positions = torch.arange(num_ids, dtype=torch.int64, device=offsets.device)
    return torch.searchsorted(offsets, positions, right=True) - 1


def bag_subset(
    offsets: torch.Tensor | Sequence[int], positions: torch.Tensor, num_ids: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids at `positions` (e.g. a shard's route) as bags of their own.

    Returns `(order, sub_offsets)`: `positions[order]` are the positions in id
    order (so each bag keeps the caller's order), and `sub_offsets` are
    `nn.EmbeddingBag` offsets of those ids, with the same number of bags as
    `offsets` (bags with none of them are empty).
    """
    bags = bag_of_ids(offsets, num_ids)
    positions = _as_index_tensor(positions, "positions")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= num_ids):
        raise ValueError(f"positions hold values outside 0..{num_ids - 1}")
    order = torch.sort(positions, stable=True).indices
    subset_bags = bags[positions[order]]
    wanted = torch.arange(_as_index_tensor(offsets, "offsets").numel(), dtype=torch.int64)
    return order, torch.searchsorted(subset_bags, wanted)


@dataclass(frozen=True, eq=False)
class PartialBags:
    """One shard's share of pooled bags: per-bag sums of its rows and how many ids it pooled.

    `col_offset` is the first global column the sums cover (0 unless the table
    is split by columns); `sums` has one row per bag.
    """

    sums: torch.Tensor
    counts: torch.Tensor
    col_offset: int = 0

    @property
    def width(self) -> int:
        return int(self.sums.shape[1])


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial sums are kept in: float32 for float16/bfloat16 rows, else the rows' own."""
    return torch.float32 if dtype in _REDUCED_FLOATS else dtype


def partial_pool(
    rows: torch.Tensor,
    offsets: torch.Tensor | Sequence[int],
    per_sample_weights: torch.Tensor | None = None,
    col_offset: int = 0,
) -> PartialBags:
    """Per-bag sums (in `accumulation_dtype`) and counts of the rows one shard holds.

    `rows` and `offsets` describe only this shard's ids (see `bag_subset`);
    `per_sample_weights`, if any, are those ids' weights. Works for "sum" and
    "mean" alike: the division by the total count happens in `combine_partials`.
    """
    _check_table(rows, "rows")
    offsets = _bag_offsets(offsets, rows.shape[0], None)
    weights = _check_weights(per_sample_weights, rows)
    col_offset = _non_negative_int(col_offset, "col_offset")
    wide = accumulation_dtype(rows.dtype)
    if (
        rows.dtype == torch.bfloat16
    ):  # torch's kernel sums bfloat16 rows in bfloat16: the same sums, then widened
        sums = pool_bags(rows, offsets, "sum", weights).to(wide)
    else:
        sums = pool_bags(
            rows.to(wide), offsets, "sum", None if weights is None else weights.to(wide)
        )
    counts = torch.diff(offsets, append=offsets.new_tensor([rows.shape[0]]))
    return PartialBags(sums, counts, col_offset)


def combine_partials(
    partials: Sequence[PartialBags],
    mode: str = "mean",
    dtype: torch.dtype | None = None,
    expected_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pooled bags from the shards' partials: sums added per column range, ranges concatenated.

    Every column range must be covered by partials whose counts add up to the
    same per-bag totals (each id pooled exactly once per column range), and
    to `expected_counts` (the request's bag sizes) when given, which catches
    a missing shard answer; "mean" divides by that total, empty bags give
    zeros. `dtype` is the table's dtype (default: the partials').
    """
    _check_mode(mode, None)
    if not partials:
        raise ValueError("partials is empty: at least one shard's partial is needed")
    for i, part in enumerate(partials):
        if not isinstance(part, PartialBags):
            raise TypeError(f"partials[{i}] is a {type(part).__name__}, not PartialBags")
    dtype = partials[0].sums.dtype if dtype is None else dtype
    blocks, counts = [], None
    for col_offset, group in _column_groups(partials):
        total = group[0].sums.clone()
        group_counts = group[0].counts.clone()
        for part in group[1:]:
            total += part.sums
            group_counts += part.counts
        if counts is not None and not torch.equal(counts, group_counts):
            raise ValueError(
                f"partials for columns starting at {col_offset} pooled other per-bag "
                f"counts than the first column range: each id must be pooled once per range"
            )
        counts = group_counts
        blocks.append(total)
    assert counts is not None  # partials is not empty, so there is at least one column group
    if expected_counts is not None:
        _check_counts(counts, _as_index_tensor(expected_counts, "expected_counts"))
    pooled = (blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)).to(dtype)
    if mode == "mean":
        pooled = pooled / counts.clamp(min=1).to(dtype).unsqueeze(1)
    return pooled


def _check_counts(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Raise unless the partials pooled exactly the request's number of ids into every bag."""
    if expected.shape != counts.shape:
        raise ValueError(
            f"expected_counts has {expected.numel()} bags but the partials have {counts.numel()}"
        )
    wrong = (counts != expected).nonzero()
    if wrong.numel():
        bag = int(wrong[0, 0])
        raise ValueError(
            f"partials pooled {int(counts[bag])} ids into bag {bag} but expected_counts says "
            f"{int(expected[bag])}: a shard's partial is missing or repeated"
        )


def _column_groups(partials: Sequence[PartialBags]) -> list[tuple[int, list[PartialBags]]]:
    """Partials grouped by column range, in column order, checked to tile the columns."""
    groups: dict[int, list[PartialBags]] = {}
    for part in partials:
        groups.setdefault(part.col_offset, []).append(part)
    ordered = sorted(groups.items())
    num_bags = partials[0].sums.shape[0]
    expected_start = 0
    for col_offset, group in ordered:
        if col_offset != expected_start:
            raise ValueError(
                f"partials leave columns {expected_start}..{col_offset - 1} uncovered "
                f"or overlap them (col_offset={col_offset})"
            )
        for part in group:
            if part.sums.dim() != 2 or part.sums.shape[0] != num_bags:
                raise ValueError(
                    f"partial sums have shape {tuple(part.sums.shape)}; "
                    f"expected ({num_bags}, width)"
                )
            if part.width != group[0].width:
                raise ValueError(
                    f"partials at col_offset={col_offset} have widths "
                    f"{part.width} and {group[0].width}"
                )
            if part.counts.shape != (num_bags,):
                raise ValueError(
                    f"partial counts have shape {tuple(part.counts.shape)}; expected ({num_bags},)"
                )
        expected_start = col_offset + group[0].width
    return ordered


def _non_negative_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _as_index_tensor(values: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    """A 1-D int64 tensor from an integer tensor or a sequence of ints."""
    if not isinstance(values, torch.Tensor):
        try:
            values = (
                torch.as_tensor(values, dtype=torch.int64)
                if len(values)
                else torch.empty(0, dtype=torch.int64)
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name} must be a tensor or a sequence of ints: {exc}") from None
    if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
    if values.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
    return values.to(torch.int64).contiguous()


def _check_table(table: torch.Tensor, name: str) -> None:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
    if table.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D (rows x embedding dim), got shape {tuple(table.shape)}"
        )
    if not table.is_floating_point():
        raise TypeError(f"{name} must hold floating point rows, got dtype {table.dtype}")


def _check_mode(mode: str, per_sample_weights: torch.Tensor | None) -> None:
    if mode not in POOLING_MODES:
        raise ValueError(f"mode must be one of {POOLING_MODES}, got {mode!r}")
    if per_sample_weights is not None and mode != "sum":
        raise ValueError(
            f"per_sample_weights is only supported for mode='sum' (got mode={mode!r}), "
            f"as in torch's embedding_bag"
        )


def _check_weights(
    per_sample_weights: torch.Tensor | None, rows: torch.Tensor
) -> torch.Tensor | None:
    if per_sample_weights is None:
        return None
    if not isinstance(per_sample_weights, torch.Tensor):
        raise TypeError(
            f"per_sample_weights must be a tensor, got {type(per_sample_weights).__name__}"
        )
    if per_sample_weights.shape != (rows.shape[0],):
        raise ValueError(
            f"per_sample_weights has shape {tuple(per_sample_weights.shape)}; it must have "
            f"one weight per id, shape ({rows.shape[0]},)"
        )
    if per_sample_weights.dtype != rows.dtype:
        raise ValueError(
            f"per_sample_weights has dtype {per_sample_weights.dtype} but the rows are "
            f"{rows.dtype}; torch's embedding_bag needs the same dtype"
        )
    return per_sample_weights


def _bag_offsets(
    offsets: torch.Tensor | Sequence[int] | None, num_ids: int, num_bags: int | None
) -> torch.Tensor:
    """Validated `nn.EmbeddingBag` offsets (include_last_offset=False) for `num_ids` ids."""
    if offsets is None:
        if num_bags is None:
            raise ValueError("offsets is None: give offsets, or num_bags to cut equal bags")
        num_bags = _non_negative_int(num_bags, "num_bags")
        if num_bags == 0 or num_ids % num_bags:
            raise ValueError(
                f"num_bags={num_bags} does not divide the {num_ids} ids into equal bags"
            )
        return torch.arange(num_bags, dtype=torch.int64) * (num_ids // num_bags)
    offsets = _as_index_tensor(offsets, "offsets")
    if num_bags is not None and num_bags != offsets.numel():
        raise ValueError(f"num_bags={num_bags} but offsets describe {offsets.numel()} bags")
    if offsets.numel():
        if int(offsets[0]) != 0:
            raise ValueError(
                f"offsets[0] has to be 0 (the first bag starts at the first id), "
                f"got {int(offsets[0])}"
            )
        steps = torch.diff(offsets)
        if bool((steps < 0).any()):
            position = int((steps < 0).nonzero()[0, 0]) + 1
            raise ValueError(
                f"offsets must be non-decreasing, but offsets[{position}]="
                f"{int(offsets[position])} < offsets[{position - 1}]={int(offsets[position - 1])}"
            )
        if int(offsets[-1]) > num_ids:
            raise ValueError(f"offsets[-1]={int(offsets[-1])} is past the end of the {num_ids} ids")
    return offsets


def _default_row(table: torch.Tensor, oov: str, default_row: torch.Tensor | None) -> torch.Tensor:
    """What an out-of-range id looks up: zeros, or `default_row` (required for oov="default")."""
    if oov != "default":
        if default_row is not None:
            raise ValueError(f"default_row is only used with oov='default', got oov={oov!r}")
        return table.new_zeros(table.shape[1])
    if default_row is None:
        raise ValueError("default_row is required with oov='default'")
    if not isinstance(default_row, torch.Tensor) or default_row.shape != (table.shape[1],):
        shape = (
            tuple(default_row.shape)
            if isinstance(default_row, torch.Tensor)
            else type(default_row).__name__
        )
        raise ValueError(f"default_row must be a tensor of shape ({table.shape[1]},), got {shape}")
    return default_row.to(table.dtype)
