"""validate_metadata: replicas reported, every error named with its shards, agreement with torch."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed._shard.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)

from shardserve.core import (
    Box,
    LayoutError,
    ShardedTensorMetadata,
    ShardMetadata,
    intersect,
    make_metadata,
    validate_metadata,
)
from shardserve.core.interop import metadata_to_torch


def rows(size, cuts, ranks=None):
    """Row shards of a (size[0], ...) tensor cut at `cuts`."""
    bounds = [0, *cuts, size[0]]
    rest = tuple(size[1:])
    return make_metadata(
        size,
        [
            ((lo,) + (0,) * len(rest), (hi - lo,) + rest, (ranks or range(99))[i])
            for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
        ],
    )


def test_valid_rows_report_no_replicas():
    report = validate_metadata(rows((10, 3), [4, 7]))
    assert report.replica_groups == ()
    assert not report.is_replicated
    assert report.covered_numel == 30
    assert report.distinct_boxes == 3


def test_replicas_are_reported_not_flagged():
    meta = make_metadata(
        (4, 2),
        [
            ((0, 0), (2, 2), 0),
            ((2, 0), (2, 2), 1),
            ((0, 0), (2, 2), 2),
            ((2, 0), (2, 2), 3),
            ((0, 0), (2, 2), 4),
        ],
    )
    report = validate_metadata(meta)
    assert report.replica_groups == ((0, 2, 4), (1, 3))
    assert report.is_replicated
    assert report.covered_numel == 8


def test_empty_shards_are_reported_and_may_sit_at_the_end():
    meta = make_metadata((3,), [((0,), (3,), 0), ((3,), (0,), 1), ((3,), (0,), 2)])
    report = validate_metadata(meta)
    assert report.empty_shards == (1, 2)
    assert report.replica_groups == ()


def test_fully_replicated_and_scalar_layouts():
    assert validate_metadata(make_metadata((), [((), (), 0), ((), (), 1)])).replica_groups == (
        (0, 1),
    )
    assert validate_metadata(make_metadata((0, 5), [((0, 0), (0, 5), 0)])).covered_numel == 0


def test_missing_placement_names_shard():
    meta = ShardedTensorMetadata(
        (ShardMetadata((0,), (2,), "rank:0/cpu"), ShardMetadata((2,), (2,), None)), (4,)
    )
    with pytest.raises(
        LayoutError,
        match=r"missing placement in shards \[1\]: shards_metadata\[1\]\.placement is None",
    ):
        validate_metadata(meta)


def test_dim_count_mismatch_names_shard():
    meta = make_metadata((4, 4), [((0, 0), (4, 4), 0), ((0,), (4,), 1)])
    with pytest.raises(
        LayoutError,
        match=r"dim count mismatch in shards \[1\]: shards_metadata\[1\] has 1 dims "
        r"but the tensor has 2",
    ):
        validate_metadata(meta)


def test_negative_offset_names_shard_and_field():
    meta = make_metadata((4,), [((0,), (2,), 0), ((-1,), (3,), 1)])
    with pytest.raises(
        LayoutError,
        match=r"negative offset or size in shards \[1\]: "
        r"shards_metadata\[1\] shard_offsets\[0\]=-1 is negative",
    ):
        validate_metadata(meta)


def test_negative_size_names_shard_and_field():
    meta = make_metadata((4, 4), [((0, 0), (4, 4), 0), ((0, 0), (2, -2), 1)])
    with pytest.raises(LayoutError, match=r"shards_metadata\[1\] shard_sizes\[1\]=-2 is negative"):
        validate_metadata(meta)


def test_negative_tensor_size():
    with pytest.raises(LayoutError, match=r"size\[1\]=-3 is negative"):
        validate_metadata(make_metadata((2, -3), []))


def test_out_of_bounds_lists_every_offender():
    meta = make_metadata((6,), [((0,), (2,), 0), ((2,), (5,), 1), ((4,), (2,), 2), ((9,), (0,), 3)])
    with pytest.raises(LayoutError) as err:
        validate_metadata(meta)
    assert str(err.value) == (
        "out of bounds in shards [1, 3]: shards_metadata[1] "
        "shard_offsets[0]+shard_sizes[0]=2+5=7 exceeds size[0]=6"
    )


def test_long_offender_lists_are_cut():
    meta = make_metadata(
        (4,), [((0,), (4,), r) for r in range(3)] + [((5,), (0,), r) for r in range(20)]
    )
    with pytest.raises(
        LayoutError,
        match=r"out of bounds in shards \[3, 4, 5, 6, 7, 8, 9, 10, \.\.\. \(20 in all\)\]",
    ):
        validate_metadata(meta)


def test_overlap_names_both_shards_and_common_region():
    meta = make_metadata((4, 4), [((0, 0), (4, 2), 0), ((0, 2), (4, 2), 1), ((1, 1), (2, 2), 2)])
    with pytest.raises(LayoutError) as err:
        validate_metadata(meta)
    message = str(err.value)
    assert message.startswith("overlap in shards [")
    pair = message[len("overlap in shards [") : message.index("]")]
    i, j = (int(x) for x in pair.split(", "))
    assert 2 in (i, j)
    a, b = meta.shards_metadata[i].box, meta.shards_metadata[j].box
    common = intersect(a, b)
    assert f"share the region offsets {common.offsets}, sizes {common.sizes}" in message


def test_gap_names_uncovered_region():
    meta = make_metadata((4, 4), [((0, 0), (2, 4), 0), ((2, 0), (2, 2), 1)])
    with pytest.raises(LayoutError) as err:
        validate_metadata(meta)
    assert str(err.value) == (
        "gap: the shards do not cover the tensor of size (4, 4); the region "
        "offsets (2, 2), sizes (2, 2) is held by no shard"
    )


def test_gap_without_any_shard_is_the_whole_tensor():
    with pytest.raises(
        LayoutError, match=r"region offsets \(0, 0\), sizes \(3, 2\) is held by no shard"
    ):
        validate_metadata(make_metadata((3, 2), []))


def test_partial_layout_allowed_when_coverage_not_required():
    report = validate_metadata(make_metadata((4,), [((0,), (2,), 0)]), require_coverage=False)
    assert report.covered_numel == 2


def test_wrong_type_is_type_error():
    with pytest.raises(TypeError, match="meta must be a ShardedTensorMetadata"):
        validate_metadata(metadata_to_torch(rows((4,), [2])))


def test_thousands_of_shards_validate():
    grid = 64
    shards = [((i * 2, j * 3), (2, 3), i * grid + j) for i in range(grid) for j in range(grid)]
    meta = make_metadata((2 * grid, 3 * grid), shards)
    assert validate_metadata(meta).distinct_boxes == grid * grid
    with pytest.raises(LayoutError, match=r"region offsets \(126, 189\), sizes \(2, 3\)"):
        validate_metadata(make_metadata(meta.size, shards[:-1]))


@st.composite
def grid_layouts(draw, replicas: bool = True):
    """A random grid of boxes over a random tensor, some boxes replicated (unless `replicas` is False)."""
    ndim = draw(st.integers(1, 4))
    size = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    cuts = [
        sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=3)))) if n > 1 else []
        for n in size
    ]
    spans = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, size)]
    boxes = [
        Box(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
        for cell in _product(spans)
    ]
    copies = draw(
        st.lists(st.integers(1, 3 if replicas else 1), min_size=len(boxes), max_size=len(boxes))
    )
    shards = [(b.offsets, b.sizes) for b, k in zip(boxes, copies) for _ in range(k)]
    random.Random(draw(st.integers(0, 10**6))).shuffle(shards)
    return size, shards


def _product(spans):
    out = [()]
    for options in spans:
        out = [prefix + (o,) for prefix in out for o in options]
    return out


@settings(max_examples=60, deadline=None)
@given(grid_layouts(), st.data())
def test_random_grids_validate_and_broken_ones_are_caught(layout, data):
    size, shards = layout
    meta = make_metadata(size, [(o, s, i) for i, (o, s) in enumerate(shards)])
    report = validate_metadata(meta)
    assert report.covered_numel == math.prod(size)
    for group in report.replica_groups:
        assert len({meta.shards_metadata[i].box for i in group}) == 1

    victim = meta.shards_metadata[data.draw(st.integers(0, len(shards) - 1))].box
    rest = [s for s in meta.shards_metadata if s.box != victim]
    with pytest.raises(LayoutError, match="gap") as err:
        validate_metadata(ShardedTensorMetadata(tuple(rest), size))
    region = _region_in(str(err.value))
    assert victim.contains(region) and not region.is_empty()
    assert all(intersect(s.box, region) is None for s in rest)

    grown = Box(
        victim.offsets,
        tuple(s + (1 if o + s < n else 0) for o, s, n in zip(victim.offsets, victim.sizes, size)),
    )
    if grown != victim:
        bad = ShardedTensorMetadata(
            tuple(rest) + (ShardMetadata(grown.offsets, grown.sizes, "rank:0/cpu"),), size
        )
        with pytest.raises(LayoutError, match="overlap in shards"):
            validate_metadata(bad)


def _region_in(message: str) -> Box:
    after = message.split("the region offsets ")[1]
    offsets, sizes = after.split(", sizes ")
    sizes = sizes.split(" is held")[0]
    return Box(eval(offsets), eval(sizes))  # noqa: S307 - parsing our own tuple repr in a test


def _torch_accepts(
    size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> bool:
    meta = make_metadata(size, [(o, s, i) for i, (o, s) in enumerate(boxes)])
    torch_shards = metadata_to_torch(meta).shards_metadata
    try:
        validate_non_overlapping_shards_metadata(torch_shards)
        check_tensor(torch_shards, torch.Size(size))
    except ValueError:
        return False
    return True


def _we_accept(size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    try:
        validate_metadata(make_metadata(size, [(o, s, i) for i, (o, s) in enumerate(boxes)]))
    except LayoutError:
        return False
    return True


@st.composite
def broken_grids(draw):
    """A valid grid of several distinct boxes, and the same grid with one box shifted, grown, shrunk or dropped (which
    may or may not still be a valid layout)."""
    size, boxes = draw(grid_layouts(replicas=False).filter(lambda layout: len(layout[1]) > 1))
    victim = draw(st.integers(0, len(boxes) - 1))
    offsets, sizes = map(list, boxes[victim])
    dim = draw(st.integers(0, len(size) - 1))
    change = draw(st.sampled_from(["shift", "grow", "shrink", "drop"]))
    if change == "shift":
        offsets[dim] += draw(st.sampled_from([-1, 1]))
    elif change == "grow":
        sizes[dim] += 1
    elif change == "shrink":
        sizes[dim] -= 1
    broken = [b for k, b in enumerate(boxes) if k != victim]
    if change != "drop":
        broken.append((tuple(offsets), tuple(sizes)))
    return size, boxes, broken


@settings(max_examples=80, deadline=None)
@given(broken_grids())
def test_agrees_with_torch_on_random_grids_and_broken_ones(case):
    """Both accept every valid multi-box grid, and both judge the grid with one box moved the same way."""
    size, boxes, broken = case
    assert _torch_accepts(size, boxes) and _we_accept(size, boxes)
    if any(o < 0 or s < 0 for offsets, sizes in broken for o, s in zip(offsets, sizes)):
        return  # torch's ShardMetadata refuses negative offsets and sizes in its constructor
    assert _we_accept(size, broken) == _torch_accepts(size, broken)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 3).flatmap(
        lambda nd: st.lists(
            st.tuples(
                st.lists(st.integers(0, 5), min_size=nd, max_size=nd),
                st.lists(st.integers(0, 4), min_size=nd, max_size=nd),
            ),
            min_size=1,
            max_size=12,
        )
    )
)
def test_overlap_found_exactly_when_some_pair_overlaps(boxes):
    ndim = len(boxes[0][0])
    meta = make_metadata((9,) * ndim, [(o, s, i) for i, (o, s) in enumerate(boxes)])
    counts = torch.zeros(
        (9,) * ndim, dtype=torch.int64
    )  # how many distinct boxes cover each element
    for offsets, sizes in dict.fromkeys((tuple(o), tuple(s)) for o, s in boxes):
        counts[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
    expected = bool((counts > 1).any())
    try:
        validate_metadata(meta, require_coverage=False)
        found = False
    except LayoutError as err:
        assert str(err).startswith("overlap in shards")
        found = True
    assert found == expected


boxes_2d = st.tuples(
    st.tuples(st.integers(0, 6), st.integers(0, 6)), st.tuples(st.integers(0, 6), st.integers(0, 6))
)


@given(boxes_2d, boxes_2d)
def test_intersect_is_the_common_elements_and_a_whole_box_is_that_box(a_fields, b_fields) -> None:
    """Against the elements each box covers: the common ones form the answer's box (None: none, or an empty
    box); an answer equal to one of the boxes is that box itself."""
    a, b = Box(*a_fields), Box(*b_fields)

    def elements(box: Box) -> set[tuple[int, int]]:
        (o0, o1), (s0, s1) = box.offsets, box.sizes
        return {(i, j) for i in range(o0, o0 + s0) for j in range(o1, o1 + s1)}

    common = intersect(a, b)
    if not elements(a) & elements(b):
        assert common is None
        return
    assert common is not None and elements(common) == elements(a) & elements(b)
    if common == a:
        assert common is a
    elif common == b:
        assert common is b


def test_a_valid_layout_is_checked_once_and_a_bad_one_every_time():
    """The report of a layout that passed is kept with the layout object (the same report object answers
    again); an equal layout object is checked on its own, a check without coverage (a partial layout) is made
    every time, and a failure is never kept."""
    from shardserve.core.validation import VALID

    good = rows((8, 4), [4])
    first = validate_metadata(good)
    assert good.knows(VALID) and validate_metadata(good) is first
    other = validate_metadata(rows((8, 4), [4]))  # another object
    assert other == first and other is not first
    partial = validate_metadata(good, require_coverage=False)
    assert partial == first and partial is not first
    assert validate_metadata(good, require_coverage=False) is not partial
    gap = make_metadata((8, 4), [((0, 0), (4, 4), 0)])
    for _ in range(2):
        with pytest.raises(LayoutError):
            validate_metadata(gap)
    assert not gap.knows(VALID)


def test_bounds_past_int64_are_checked_shard_by_shard():
    """Offsets and sizes too large for the vectorised check (int64) are checked by the loop that names them."""
    half = 2**63
    assert validate_metadata(
        make_metadata((2 * half,), [((0,), (half,), 0), ((half,), (half,), 1)])
    )
    meta = make_metadata((2 * half,), [((0,), (half,), 0), ((half,), (half + 1,), 1)])
    with pytest.raises(LayoutError, match=r"out of bounds in shards \[1\]"):
        validate_metadata(meta)
