"""The same-host path's cache of mapped shards: by (rank, tensor, version, shard), and by the memfd they live in.

A served version never changes, so its mapping is kept (bounded in bytes and entries) and later reads of it
skip OpenShard. A rank also reuses a segment for a later version (steady puts alternate between two sets of
segments, a tensor put every step too): the cache knows each memfd mapping by (rank, pid, inode, device), so the
later version is read through the mapping already made instead of mapping the same memory again. A CUDA shard's
buffer is reused with its state header, so its opened IPC handle is found the same way (by the header's
identity) and used again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from shardserve.client.paths import segments
from shardserve.core.dtypes import dtype_from_wire
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import name_hash

CACHE_BYTES = (
    4 << 30
)  # mapped bytes kept for reuse (pages of dropped versions stay alive meanwhile)
# mappings kept: each is one or two of the process's memory areas (vm.max_map_count is 65530 by default) and
# holds no open file; a state dict of thousands of small tensors read every step stays mapped
CACHE_ENTRIES = 8192

# (rank address, tensor name, version, shard index)
Key = tuple[str, str, int, int]


class MappingCache:
    """Mappings of shards, least recently used first out, at most CACHE_BYTES and CACHE_ENTRIES."""

    def __init__(self) -> None:
        self._cache: OrderedDict[Key, segments.SegmentMapping] = OrderedDict()
        # the key of each cached memfd mapping by (address, pid, inode, device)
        self._by_segment: dict[tuple, Key] = {}
        # the segment each label was read in by the last pass over a rank's mappings, by (address, name hash,
        # version, shard): a hint, checked against the segment's header before it is taken (take_labelled)
        self._labels: dict[tuple[str, int, int, int], tuple] = {}
        self._nbytes = 0
        self._lock = threading.Lock()

    def get(self, key: Key) -> segments.SegmentMapping | None:
        """The cached mapping of `key` (made the most recently used), or None."""
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
            return cached

    def remember(self, key: Key, mapping: segments.SegmentMapping) -> None:
        """Keep `mapping` under `key` (replacing any), the least recently used let go past the bounds."""
        with self._lock:
            self._keep(key, mapping)

    def of_tensor(self, name: str) -> dict[Key, segments.SegmentMapping]:
        """The cached mappings of tensor `name`'s shards, by key."""
        with self._lock:
            return {key: mapping for key, mapping in self._cache.items() if key[1] == name}

    def forget(self, key: Key) -> None:
        with self._lock:
            self._drop(key)

    def take_segment(
        self, address: str, reply: pb.OpenShardResponse
    ) -> segments.SegmentMapping | None:
        """The mapping made for an earlier version of the memfd `reply` names, when it maps exactly the bytes
        the reply describes (the rank reuses the segment), taken out of the cache: the rank's newer generation
        made the earlier entry stale. None when there is none."""
        return self._take_earlier(
            address,
            reply,
            lambda earlier: (
                not reply.extents
                and (earlier.fd, earlier.data_offset) == (reply.fd, reply.data_offset)
            ),
        )

    def take_labelled(
        self, address: str, shards: Sequence[tuple[Key, int]]
    ) -> dict[Key, tuple[segments.SegmentMapping, segments.SegmentMapping]]:
        """For each (key, nbytes) of `shards` not cached, a mapping of the rank at `address`, of `nbytes`, whose
        segment the rank recycled for that key's shard and labelled so (SegmentMapping.label): that mapping
        (taken out of the cache: its version is gone) and a new one of the same pages at the key's version, kept
        under the key. By key, as (earlier, mapping); the rest are opened by OpenShard. A shard is looked for
        first where the last pass over the rank's mappings read its label, then by one pass over the rank's
        mappings of the sizes still asked for (which notes every label it reads): shards opened one at a time
        cost one pass per new version between them, not one each."""
        found: dict[Key, tuple[segments.SegmentMapping, segments.SegmentMapping]] = {}
        alive: dict[int, bool] = {}  # by rank process: asked once

        def take(earlier_key: Key) -> tuple[int, int, int] | None:
            """Take the mapping cached under `earlier_key` for the shard its label names, when that one is
            asked for, of its size, not taken yet, and its rank process lives; the label read (None: none)."""
            earlier = self._cache.get(earlier_key)
            label = earlier.label() if earlier is not None else None
            if earlier is None or label is None:
                return None
            key, nbytes = wanted.get(label[:3], (None, 0))
            if key is None or nbytes != earlier.flat.numel() or key in found:
                return label[:3]
            process = id(earlier.process)
            if process not in alive:
                alive[process] = segments.still_held(earlier)
            if alive[process]:
                mapping = earlier.at_generation(label[3])
                self._drop(earlier_key)
                self._keep(key, mapping)
                found[key] = (earlier, mapping)
            return label[:3]

        with self._lock:
            wanted = {  # by the label the rank gives the shard's segment
                (name_hash(key[1]), key[2], key[3]): (key, nbytes)
                for key, nbytes in shards
                if key not in self._cache
            }
            for asked in wanted:  # first where the last pass read its label
                earlier_key = self._by_segment.get(self._labels.get((address, *asked), ()))
                if earlier_key is not None:
                    take(earlier_key)
            sizes = {nbytes for key, nbytes in wanted.values() if key not in found}
            # the rest: one pass over the rank's mappings of their sizes, noting every label it reads
            if sizes:
                self._labels = {k: v for k, v in self._labels.items() if k[0] != address}
                held = [
                    (segment, key)
                    for segment, key in self._by_segment.items()
                    if segment[0] == address and self._cache[key].flat.numel() in sizes
                ]
                for segment, earlier_key in held:
                    read = take(earlier_key)
                    if read is not None:
                        self._labels[(address, *read)] = segment
        return found

    def take_copies(
        self,
        address: str,
        shards: Sequence[tuple[Key, int]],
        header_words: Callable[[segments.SegmentMapping, tuple[int, int, int]], Any],
    ) -> dict[Key, segments.SegmentMapping]:
        """For each (key, nbytes) of `shards` not cached, a mapping of the same pages as a mapping of the rank at
        `address` whose version the key's version is a whole copy of (the rank announced it in that mapping's
        header: SegmentMapping.copy), kept under the key with the copy's own header words (`header_words(earlier,
        (slot offset, file inode, generation))`, None when they are not mapped here) and generation. The earlier
        mapping stays: its version is still read. One pass over the rank's mappings."""
        found: dict[Key, segments.SegmentMapping] = {}
        with self._lock:
            wanted = {
                (name_hash(key[1]), key[2], key[3]): (key, nbytes)
                for key, nbytes in shards
                if key not in self._cache
            }
            if not wanted:
                return found
            held = [(k, m) for k, m in self._cache.items() if k[0] == address]
        for _, earlier in held:
            announced = earlier.copy()
            if announced is None or announced[0] not in wanted:
                continue
            key, nbytes = wanted[announced[0]]
            words = header_words(earlier, announced[1]) if earlier.flat.numel() == nbytes else None
            mapping = earlier.copied_as(announced[1], words) if words is not None else None
            if mapping is not None and earlier.copy() == announced and mapping.serves():
                found[key] = mapping
                del wanted[announced[0]]
        with self._lock:
            for key, mapping in found.items():
                self._keep(key, mapping)
        return found

    def take_cuda(
        self, address: str, reply: pb.OpenShardResponse
    ) -> segments.SegmentMapping | None:
        """The mapping of a CUDA shard's memory made for an earlier version whose state header is the one `reply`
        names, when it maps exactly the memory the reply's IPC handle describes (the rank reuses a freed CUDA
        buffer with its header), taken out of the cache; None when there is none."""
        h = reply.cuda
        return self._take_earlier(
            address,
            reply,
            lambda earlier: (
                earlier.cuda_handle == (h.handle, h.storage_offset_bytes)
                and earlier.flat.storage_offset() == h.tensor_offset * _itemsize(reply)
            ),
        )

    def _take_earlier(
        self,
        address: str,
        reply: pb.OpenShardResponse,
        same_memory: Callable[[segments.SegmentMapping], bool],
    ) -> segments.SegmentMapping | None:
        """The cached mapping of the segment (or CUDA state header) `reply` names, of the reply's length and with
        a header, taken out of the cache when `same_memory` says it maps what the reply describes."""
        segment = (address, reply.pid, reply.inode, reply.device_id)
        with self._lock:
            key = self._by_segment.get(segment)
            earlier = self._cache.get(key) if key is not None else None
            if (
                key is None
                or earlier is None
                or earlier.state is None
                or earlier.flat.numel() != reply.nbytes
                or not same_memory(earlier)
            ):
                return None
            self._drop(key)
            return earlier

    def clear(self) -> None:
        """Forget every mapping (each unmapped once no tensor uses it)."""
        with self._lock:
            self._cache.clear()
            self._by_segment.clear()
            self._labels.clear()
            self._nbytes = 0

    def _keep(self, key: Key, mapping: segments.SegmentMapping) -> None:
        """Keep `mapping` under `key` (lock held), as remember() says."""
        self._drop(key)
        self._cache[key] = mapping
        self._nbytes += mapping.flat.numel()
        if mapping.state is not None and (
            mapping.data_offset >= 0 or mapping.cuda_handle is not None
        ):
            self._by_segment[_segment_key(key[0], mapping)] = key
        while self._cache and (self._nbytes > CACHE_BYTES or len(self._cache) > CACHE_ENTRIES):
            self._drop(next(iter(self._cache)))

    def _drop(self, key: Key) -> None:
        """Take `key` out of the cache and the segment index (lock held)."""
        old = self._cache.pop(key, None)
        if old is None:
            return
        self._nbytes -= old.flat.numel()
        segment = _segment_key(key[0], old)
        if self._by_segment.get(segment) == key:
            del self._by_segment[segment]


def _itemsize(reply: pb.OpenShardResponse) -> int:
    return dtype_from_wire(reply.dtype).itemsize


def _segment_key(address: str, mapping: segments.SegmentMapping) -> tuple:
    return (address, mapping.process.pid, mapping.inode, mapping.device_id)
