"""server.rank.jobs.checkpoint_reader: DCP loads that read only each shard's region, checked bit for bit
in one process."""

from __future__ import annotations

import itertools
import os
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import shards_of
from torch.distributed.checkpoint import FileSystemReader

from shardserve.core.metadata import ShardedTensorMetadata, make_metadata
from shardserve.server.rank.jobs.checkpoint_io import CheckpointError, load_tensors, save_tensors
from shardserve.server.rank.jobs.checkpoint_reader import element_span, stored_chunk

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


def plain_save(path: str, tensors: dict[str, torch.Tensor]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(tensors, checkpoint_id=path, no_dist=True)


def source(size: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    values = torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 50
    return values > 0 if dtype is torch.bool else values.to(dtype)


def grid(size: tuple[int, ...], cuts: list[list[int]], dtype: torch.dtype) -> ShardedTensorMetadata:
    """The layout cutting each dim at `cuts[dim]` (sorted inner cut points), every box on rank 0."""
    bounds = [[0, *cut, n] for cut, n in zip(cuts, size)]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]] = [((), (), 0)]
    for edges in bounds:
        boxes = [
            ((*o, lo), (*s, hi - lo), 0)
            for o, s, _ in boxes
            for lo, hi in itertools.pairwise(edges)
        ]
    return make_metadata(size, boxes, dtype)


def assert_loaded(path: str, key: str, full: torch.Tensor, meta: ShardedTensorMetadata) -> None:
    got = load_tensors(path, {key: meta}, 0)[key]
    expected = shards_of(full.to(meta.dtype), meta)
    assert sorted(got) == sorted(meta.shards_on(0))
    for index, tensor in got.items():
        assert tensor.dtype == meta.dtype and torch.equal(tensor, expected[index]), (
            f"shard {index} differs"
        )


@pytest.fixture
def no_general_path(monkeypatch):
    """Make FileSystemReader's own read path fail, so a test proves RegionReader read every item itself."""

    def refuse(self, plan, planner):
        raise AssertionError(f"FileSystemReader.read_data was asked for {len(plan.items)} items")

    monkeypatch.setattr(FileSystemReader, "read_data", refuse)


@st.composite
def cases(draw):
    size = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))

    def cuts():
        return [
            sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else [] for n in size
        ]

    return size, dtype, cuts(), cuts(), draw(st.booleans())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cases())
def test_any_saved_layout_loads_into_any_layout_bit_for_bit(
    tmp_path_factory, no_general_path, case
):
    size, dtype, saved_cuts, loaded_cuts, transposed = case
    path = str(tmp_path_factory.mktemp("ckpt"))
    full = source(size, dtype)
    if (
        transposed and len(size) >= 2
    ):  # a saved chunk with other strides: read through a span buffer
        plain_save(path, {"t": full.transpose(0, 1).contiguous().transpose(0, 1)})
    else:
        saved = grid(size, saved_cuts, dtype)
        save_tensors(path, {"t": (saved, dict(enumerate(shards_of(full, saved))))})
    assert_loaded(path, "t", full, grid(size, loaded_cuts, dtype))


def test_row_band_reads_only_its_own_bytes(tmp_path):
    """Damage the stored rows outside a band: a load of the band is still exact, a full load is not."""
    path = str(tmp_path / "table")
    full = source((64, 16), torch.float32)
    plain_save(path, {"t": full})
    reader = FileSystemReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    (info,) = reader.storage_data.values()
    file_path = os.path.join(path, info.relative_path)
    with open(file_path, "rb") as file:
        chunk = stored_chunk(file, info.offset, info.length)
    row_bytes = 16 * 4
    with open(file_path, "r+b") as file:
        file.seek(chunk.data_start)
        file.write(b"\xff" * (16 * row_bytes))  # rows 0..15
    band = make_metadata((64, 16), [((16, 0), (48, 16), 0), ((0, 0), (16, 16), 1)], torch.float32)
    assert torch.equal(load_tensors(path, {"t": band}, 0)["t"][0], full[16:])
    whole = make_metadata((64, 16), [((0, 0), (64, 16), 0)], torch.float32)
    assert not torch.equal(load_tensors(path, {"t": whole}, 0)["t"][0], full)


def test_dtype_casts_go_through_dcp_own_reader(tmp_path, monkeypatch):
    """A load into another dtype is DCP's own read (FileSystemReader.read_data, which casts); a load into the
    saved dtype is not."""
    path = str(tmp_path / "table")
    full = source((13, 21), torch.float32)
    plain_save(path, {"t": full, "n": torch.arange(10)})
    general_reads: list[int] = []
    read_data = FileSystemReader.read_data

    def counting(self, plan, planner):  # type: ignore[no-untyped-def]
        general_reads.append(len(plan.items))
        return read_data(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", counting)
    assert_loaded(path, "t", full, grid((13, 21), [[5], [7, 8]], torch.bfloat16))
    assert general_reads and sum(general_reads) >= 6  # the cast shards, all through DCP's reader
    general_reads.clear()
    assert_loaded(path, "n", torch.arange(10), grid((10,), [[3]], torch.int64))
    assert sum(general_reads) == 0


def test_truncated_checkpoint_fails_with_a_clear_error(tmp_path):
    path = str(tmp_path / "table")
    full = source((256, 64), torch.float32)
    plain_save(path, {"t": full})
    (data_file,) = [f for f in os.listdir(path) if f.endswith(".distcp")]
    with open(os.path.join(path, data_file), "r+b") as file:
        file.truncate(1000)
    with pytest.raises(
        CheckpointError, match=r"checkpoint chunk 't' at \(0, 0\) in __0_0.distcp is damaged"
    ):
        load_tensors(path, {"t": grid((256, 64), [[100], []], torch.float32)}, 0)


def test_element_span_of_strided_regions():
    base = torch.empty((6, 8), device="meta")
    assert element_span(base) == (0, 48)
    assert element_span(base[2:4]) == (16, 16)
    assert element_span(base[:, 3:5]) == (3, 5 * 8 + 2)
    assert element_span(base[1:1]) == (8, 0)
    assert element_span(base.t()[2:3]) == (2, 5 * 8 + 1)


def _malformed_metadata(kind: str) -> bytes:
    """Pickles of allow-listed DCP classes holding the wrong contents."""
    import pickle

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    def tensor(size, chunks=None, properties=TensorProperties(dtype=torch.float32)):  # type: ignore[no-untyped-def]
        return TensorStorageMetadata(
            properties=properties, size=size, chunks=chunks if chunks is not None else []
        )

    entries = {
        "list": [],
        "none": None,
        "no dtype": {"t": tensor(torch.Size([4]), properties=None)},
        "huge size": {"t": tensor(torch.Size([2**70]))},
        "negative size": {"t": tensor(torch.Size([-5]))},
        "string size": {"t": tensor("abc")},
        "int key": {5: tensor(torch.Size([4]))},
        "empty key": {"": tensor(torch.Size([4]))},
        "chunk dims": {
            "t": tensor(
                torch.Size([4, 4]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))]
            )
        },
    }[kind]
    return pickle.dumps(Metadata(state_dict_metadata=entries))


@pytest.mark.parametrize(
    "kind,message",
    [
        ("list", "state_dict_metadata is a list, not a dict"),
        ("none", "state_dict_metadata is a NoneType"),
        ("no dtype", "entry 't': properties hold no dtype"),
        ("huge size", "entry 't': size is not a tuple"),
        ("negative size", "entry 't': size is not"),
        ("string size", "entry 't': size is not"),
        ("int key", "key 5 is not a non-empty printable string"),
        ("empty key", "key '' is not"),
        ("chunk dims", "chunks[0] is not offsets and sizes of the tensor's 2 dims"),
    ],
)
def test_metadata_of_the_right_classes_but_wrong_contents_is_refused(kind, message):
    """The allow-list admits DCP's classes; their contents are checked too (they reached code that failed with
    AttributeError or OverflowError, an INTERNAL answer)."""
    import io

    from shardserve.server.common.dcp_metadata import CheckpointMetadataError, load_metadata

    with pytest.raises(CheckpointMetadataError, match=re.escape(message)):
        load_metadata(io.BytesIO(_malformed_metadata(kind)), "ck")
