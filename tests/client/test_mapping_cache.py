"""The same-host path's mapping cache finds the memory opened for an earlier version when the rank reuses it for
a later one: a memfd segment by its identity, a CUDA shard by its state header's identity and the very IPC
handle, offset and length the rank answers now. CPU tensors stand in for opened CUDA memory (the cache only
compares them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardserve.client.paths import segments
from shardserve.client.paths.mapping_cache import MappingCache
from shardserve.core.dtypes import dtype_to_wire
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import (
    HEADER_WORDS,
    STATE_PENDING,
    STATE_REPLACED,
    STATE_SERVED,
    WORD_GENERATION,
    WORD_STATE,
    write_label,
)

ADDRESS, INODE, DEVICE, HANDLE = "127.0.0.1:1", 41, 7, b"ipc-handle"


def _cuda_mapping(flat: torch.Tensor, handle: bytes = HANDLE) -> segments.SegmentMapping:
    return segments.SegmentMapping(
        segments.RANK_PROCESSES.watch(os.getpid()),
        INODE,
        DEVICE,
        flat,
        torch.tensor([1, 2, 0], dtype=torch.int64),
        fd=3,
        cuda_handle=(handle, 0),
    )


def _reply(**changes) -> pb.OpenShardResponse:
    fields = dict(pid=os.getpid(), fd=3, inode=INODE, device_id=DEVICE, nbytes=64)
    cuda = dict(handle=HANDLE, storage_size_bytes=64, storage_offset_bytes=0, tensor_offset=0)
    for key, value in changes.items():
        (cuda if key in cuda else fields)[key] = value
    return pb.OpenShardResponse(
        dtype=dtype_to_wire(torch.float32), cuda=pb.CudaIpcHandle(**cuda), **fields
    )


def test_the_memory_opened_for_an_earlier_version_is_taken_once():
    cache = MappingCache()
    earlier = _cuda_mapping(torch.zeros(64, dtype=torch.uint8))
    cache.remember((ADDRESS, "w", 1, 0), earlier)
    assert cache.take_cuda(ADDRESS, _reply()) is earlier
    assert cache.get((ADDRESS, "w", 1, 0)) is None  # its generation went stale: out of the cache
    assert cache.take_cuda(ADDRESS, _reply()) is None


@pytest.mark.parametrize(
    "changes",
    [
        {"handle": b"another-allocation"},
        {"storage_offset_bytes": 512},
        {"tensor_offset": 4},
        {"nbytes": 32},
        {"inode": INODE + 1},
        {"pid": 1},
    ],
    ids=["handle", "storage-offset", "tensor-offset", "length", "header", "process"],
)
def test_other_memory_is_not_taken_for_it(changes):
    cache = MappingCache()
    cache.remember((ADDRESS, "w", 1, 0), _cuda_mapping(torch.zeros(64, dtype=torch.uint8)))
    assert cache.take_cuda(ADDRESS, _reply(**changes)) is None
    assert cache.take_cuda("127.0.0.1:2", _reply()) is None
    assert cache.get((ADDRESS, "w", 1, 0)) is not None


def _host_mapping(
    nbytes: int = 64,
    *,
    inode: int = INODE,
    generation: int = 0,
    process: segments.RankProcess | None = None,
) -> segments.SegmentMapping:
    """A mapping of a host memfd segment (its header words in a CPU tensor the test writes as the rank would)."""
    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    header[WORD_GENERATION] = generation
    return segments.SegmentMapping(
        process or segments.RANK_PROCESSES.watch(os.getpid()),
        inode,
        DEVICE,
        torch.zeros(nbytes, dtype=torch.uint8),
        header,
        fd=3,
        generation=generation,
        data_offset=4096,
    )


def _relabel(mapping: segments.SegmentMapping, name: str, version: int, index: int) -> None:
    """The rank's side: recycle the segment (next generation), label it for a shard and mark it served."""
    assert mapping.state is not None
    words = mapping.state.numpy()
    words[WORD_STATE] = STATE_PENDING
    words[WORD_GENERATION] += 1
    write_label(words, name, version, index)
    words[WORD_STATE] = STATE_SERVED


def test_a_segment_recycled_and_labelled_for_a_new_version_is_taken_for_it_in_one_pass():
    cache = MappingCache()
    a, b = _host_mapping(inode=41), _host_mapping(inode=42)
    cache.remember((ADDRESS, "w", 1, 0), a)
    cache.remember((ADDRESS, "w", 1, 1), b)
    _relabel(a, "w", 3, 1)  # the rank put shard 1 of version 3 where shard 0 of version 1 was
    _relabel(b, "w", 3, 0)
    found = cache.take_labelled(ADDRESS, [((ADDRESS, "w", 3, 0), 64), ((ADDRESS, "w", 3, 1), 64)])
    assert {key: earlier for key, (earlier, _) in found.items()} == {
        (ADDRESS, "w", 3, 0): b,
        (ADDRESS, "w", 3, 1): a,
    }
    for key, (earlier, mapping) in found.items():
        assert mapping.flat is earlier.flat and mapping.generation == 1 and mapping.serves()
        assert cache.get(key) is mapping
    assert cache.get((ADDRESS, "w", 1, 0)) is None and cache.get((ADDRESS, "w", 1, 1)) is None


@pytest.mark.parametrize(
    "asked",
    [
        ((ADDRESS, "w", 3, 0), 32),  # another size
        (("127.0.0.1:2", "w", 3, 0), 64),  # another rank
        ((ADDRESS, "w", 4, 0), 64),  # another version
        ((ADDRESS, "v", 3, 0), 64),  # another tensor
        ((ADDRESS, "w", 3, 1), 64),  # another shard
    ],
    ids=["size", "rank", "version", "tensor", "shard"],
)
def test_a_label_of_another_shard_is_not_taken(asked):
    cache = MappingCache()
    mapping = _host_mapping()
    cache.remember((ADDRESS, "w", 1, 0), mapping)
    _relabel(mapping, "w", 3, 0)
    bystander = (
        (asked[0][0], "x", 9, 0),
        64,
    )  # a shard of the mapping's size asked in the same pass
    assert cache.take_labelled(asked[0][0], [asked, bystander]) == {}
    assert cache.get((ADDRESS, "w", 1, 0)) is mapping


def test_a_segment_not_served_or_labelled_for_an_older_generation_is_not_taken():
    cache = MappingCache()
    mapping = _host_mapping()
    cache.remember((ADDRESS, "w", 1, 0), mapping)
    _relabel(mapping, "w", 3, 0)
    assert mapping.state is not None
    words = mapping.state.numpy()
    words[WORD_STATE] = STATE_REPLACED  # served in its grace: new reads go to the newer version
    assert cache.take_labelled(ADDRESS, [((ADDRESS, "w", 3, 0), 64)]) == {}
    words[WORD_STATE], words[WORD_GENERATION] = STATE_SERVED, words[WORD_GENERATION] + 1
    assert cache.take_labelled(ADDRESS, [((ADDRESS, "w", 3, 0), 64)]) == {}  # recycled since


def test_a_segment_of_a_rank_process_that_died_is_not_taken():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    process = segments.RankProcess(child.pid)
    child.communicate(b"")  # it exits: its last header still says served
    cache = MappingCache()
    mapping = _host_mapping(process=process)
    cache.remember((ADDRESS, "w", 1, 0), mapping)
    _relabel(mapping, "w", 3, 0)
    assert cache.take_labelled(ADDRESS, [((ADDRESS, "w", 3, 0), 64)]) == {}


def test_shards_taken_one_at_a_time_are_found_as_the_rank_moves_them_between_segments():
    """A reader that opens a new version's shards one by one: each is found in the segment the rank put it in,
    version after version, as the rank hands the same-size segments to other shards each time (a label noted by
    an earlier pass that no longer holds is not trusted)."""
    cache = MappingCache()
    mappings = [_host_mapping(inode=100 + i) for i in range(8)]
    for i, mapping in enumerate(mappings):
        cache.remember((ADDRESS, f"t{i}", 1, 0), mapping)
    for version, shift in (
        (3, 0),
        (5, 3),
        (7, 5),
    ):  # tensor i's shard lands in segment (i + shift) % 8
        for i in range(8):
            _relabel(mappings[(i + shift) % 8], f"t{i}", version, 0)
        for i in (5, 0, 7, 2, 1, 6, 3, 4):
            key = (ADDRESS, f"t{i}", version, 0)
            found = cache.take_labelled(ADDRESS, [(key, 64)])
            assert list(found) == [key], (version, i)
            earlier, mapping = found[key]
            assert earlier.flat is mappings[(i + shift) % 8].flat and mapping.serves()
