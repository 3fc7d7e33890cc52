"""The reader's half of ShardServer.OpenShard(s): shards of same-host ranks opened, mapped and kept.

A shard is opened by OpenShard (a leased reference to the rank's memory) and mapped read-only; the mapping is
cached per (rank, tensor, version, shard) and its header page tells later reads whether the rank still serves
that version, so a cached shard is read with no call at all. A shard of a new version is usually in a segment
this process maps already (the rank recycles segments from one version to the next: steady puts alternate
between two sets): the rank labels each segment with the shard it serves when it promotes a version, and the
reader finds the shard there by that label, with no call either (protos/same_host.py). The rest of a reader's
shards of a new version (a state dict right after its put) are opened in one OpenShards call per rank
(open_all) instead of one OpenShard per shard.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
import torch

from shardserve.client import counters
from shardserve.client.channel import Channel
from shardserve.client.errors import ShardServeError, StaleVersionError, error_from_rpc
from shardserve.client.info import TensorSummary
from shardserve.client.paths import segments
from shardserve.client.paths.grpc import unary
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.mapping_cache import MappingCache
from shardserve.client.paths.registered import PAGES
from shardserve.core.dtypes import dtype_from_wire
from shardserve.core.lent_memory import release_cuda_count
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason

log = logging.getLogger(__name__)

MAX_OPEN_SHARDS = 4096  # shards one OpenShards call opens (the rank's limit)


class SharedMemoryError(ShardServeError):
    """The same-host path cannot serve this read (not the same host, shared memory off, mapping refused):
    PATH_UNAVAILABLE, so the fallback chain tries the next path."""

    reason = Reason.PATH_UNAVAILABLE


class _AskAgain(Exception):
    """Raised by _adopt when the rank kept no lease for a segment other than ours: open the shard again."""


class ShardOpener:
    """Opens and maps shards of same-host ranks for reading, one at a time or many at once, and keeps the
    mappings (bounded) with each rank's max_request_bytes."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.mappings = MappingCache()
        self._limits: dict[
            str, int
        ] = {}  # address -> the rank's max_request_bytes (from OpenShard)

    def limit(self, address: str) -> int:
        """The rank's max_request_bytes as its latest OpenShard said (0: no limit or not known yet)."""
        return self._limits.get(address, 0)

    def open(
        self, address: str, summary: TensorSummary, index: int, cancel: Cancellation | None = None
    ) -> tuple[segments.SegmentMapping | None, torch.Tensor | None]:
        """(the mapping, shard `index` at the summary's version as a read-only tensor over it; both None when the
        shard is empty): a cached mapping checked by its header, else one opened by OpenShard. The caller checks
        after reading that the mapping still serves (SharedMemoryPath confirms it)."""
        key = (address, summary.name, summary.version, index)
        cached = self.mappings.get(key)
        if self._serves(key, cached, summary, address):
            assert cached is not None
            return cached, _as_shard(cached.flat, summary, index)
        labelled = self._take_labelled(address, [(summary, index)]).get(key)
        if labelled is not None:
            return labelled, _as_shard(labelled.flat, summary, index)
        reply = self._open_shard(address, _request(summary, index, cached), cancel)
        try:  # the lease holds the version (and its segment's generation) until released below
            mapping = self._adopt(address, key, cached, reply, summary)
        except _AskAgain:
            return self.open(address, summary, index, cancel)
        finally:
            if reply.lease_id:
                self._release(address, [reply.lease_id])
        if mapping is None:
            return None, None
        return mapping, _as_shard(mapping.flat, summary, index)

    def open_all(self, address: str, shards: Sequence[tuple[TensorSummary, int]]) -> int:
        """Open the `shards` of the rank at `address` that no kept mapping serves, in OpenShards calls of up to
        MAX_OPEN_SHARDS, so that reading them calls the rank no more; returns how many were opened. Best effort:
        a shard it cannot open (or a call that fails) is left to open() at its read, which reports why."""
        unserved = []
        for summary, index in shards:
            key = (address, summary.name, summary.version, index)
            if not self._serves(key, self.mappings.get(key), summary, address, quiet=True):
                unserved.append((summary, index))
        labelled = self._take_labelled(address, unserved)
        unlabelled = [
            (summary, index)
            for summary, index in unserved
            if (address, summary.name, summary.version, index) not in labelled
        ]
        copies = self._take_copies(address, unlabelled)
        wanted = [
            (summary, index)
            for summary, index in unlabelled
            if (address, summary.name, summary.version, index) not in copies
        ]
        opened = 0
        for start in range(0, len(wanted), MAX_OPEN_SHARDS):
            opened += self._open_batch(address, wanted[start : start + MAX_OPEN_SHARDS])
        return opened

    def _take_labelled(
        self, address: str, shards: Sequence[tuple[TensorSummary, int]]
    ) -> dict[tuple[str, str, int, int], segments.SegmentMapping]:
        """The mappings of `shards` found in segments this process maps already, which the rank at `address`
        recycled for them and labelled so (MappingCache.take_labelled), by key: read with no call to the rank,
        checked by their header on every read as any kept mapping is."""
        if not shards:
            return {}
        asked = [
            (
                (address, summary.name, summary.version, index),
                summary.metadata.shard_nbytes(index),
            )
            for summary, index in shards
        ]
        found = self.mappings.take_labelled(address, asked)
        for earlier, mapping in found.values():
            PAGES.hand_over(earlier, mapping)  # the same pages: their CUDA registration goes on
        if found:
            counters.count("shm_labelled", len(found))
        return {key: mapping for key, (_, mapping) in found.items()}

    def _take_copies(
        self, address: str, shards: Sequence[tuple[TensorSummary, int]]
    ) -> dict[tuple[str, str, int, int], segments.SegmentMapping]:
        """The mappings of `shards` that are whole copies of versions this process maps already, as the rank at
        `address` announced in their headers (MappingCache.take_copies), each with its own header words from a
        header file kept mapped here: read with no call to the rank, checked by those words on every read. Not
        for a process that may register mapped pages with CUDA (a second owner of registered pages is refused
        by the driver): it opens them."""
        if not shards or torch.cuda.is_available():
            return {}
        found = self.mappings.take_copies(
            address,
            [
                (
                    (address, summary.name, summary.version, index),
                    summary.metadata.shard_nbytes(index),
                )
                for summary, index in shards
            ],
            lambda earlier, slot: segments.HEADER_FILES.kept_words(
                earlier.process.pid, slot[1], earlier.device_id, slot[0]
            ),
        )
        if found:
            counters.count("shm_copies", len(found))
        return found

    def _open_batch(self, address: str, shards: Sequence[tuple[TensorSummary, int]]) -> int:
        """One OpenShards call: each answer mapped and kept, every lease released in one ReleaseShard."""
        keys = [(address, summary.name, summary.version, index) for summary, index in shards]
        request = pb.OpenShardsRequest(
            shards=[
                _request(summary, index, self.mappings.get(key))
                for (summary, index), key in zip(shards, keys)
            ]
        )
        counters.count("shm_opens", len(shards))
        try:
            answer = self.channel.shard_server(address).OpenShards(
                request, timeout=self.channel.timeout, metadata=self.channel.metadata
            )
        except grpc.RpcError as err:  # each read opens its shard by itself, and says why it cannot
            log.debug("OpenShards of %d shards at %s: %s", len(shards), address, err.details())
            return 0
        opened = 0
        try:
            for (summary, _), key, reply in zip(shards, keys, answer.shards):
                try:
                    opened += (
                        self._adopt(address, key, self.mappings.get(key), reply, summary)
                        is not None
                    )
                except _AskAgain:
                    continue  # its read opens it again
                except ShardServeError as err:
                    log.debug("%s at %s: %s; its read opens it again", summary.name, address, err)
        finally:
            self._release(address, [reply.lease_id for reply in answer.shards if reply.lease_id])
        return opened

    def _serves(
        self,
        key: tuple[str, str, int, int],
        cached: segments.SegmentMapping | None,
        summary: TensorSummary,
        address: str,
        *,
        quiet: bool = False,
    ) -> bool:
        """Whether the kept mapping `cached` serves the shard now (its header says so and its rank lives); a
        mapping whose header says the version went is forgotten and StaleVersionError raised (unless `quiet`)."""
        if cached is None or cached.state is None:  # the rank keeps the header's words current
            return False
        if not cached.serves():
            self.mappings.forget(key)
            if quiet:
                return False
            raise stale(summary, address)
        return segments.still_held(cached)

    def _adopt(
        self,
        address: str,
        key: tuple[str, str, int, int],
        cached: segments.SegmentMapping | None,
        reply: pb.OpenShardResponse,
        summary: TensorSummary,
    ) -> segments.SegmentMapping | None:
        """The mapping of an OpenShard answer, kept (None for an empty shard; _AskAgain raised when the rank kept
        no lease for what is another segment than ours): the cached one when it is the same segment."""
        index = key[3]
        process = segments.RANK_PROCESSES.watch(
            reply.pid
        )  # now, while the rank that just answered surely owns the pid
        self._limits[address] = reply.max_request_bytes
        _check_reply(reply, summary, index)
        if reply.nbytes == 0:
            return None
        try:
            if reply.HasField("cuda"):
                return self._cuda_mapping(key, cached, reply, process)
            if cached is not None and (cached.process, cached.inode, cached.device_id) == (
                process,
                reply.inode,
                reply.device_id,
            ):
                if not cached.serves():  # the same segment: its header says the version went since
                    self.mappings.forget(key)
                    raise stale(summary, address)
                return cached
            if (
                not reply.lease_id
            ):  # the rank saw our inode and kept no lease, yet this is another segment
                self.mappings.forget(key)
                raise _AskAgain  # asked again without it: a mapping made under a lease
            earlier = self.mappings.take_segment(address, reply)
            flat, header = (earlier.flat, earlier.state) if earlier else segments.map_segment(reply)
            mapping = segments.SegmentMapping(
                process,
                reply.inode,
                reply.device_id,
                flat,
                header,
                reply.fd,
                generation=int(header[2]) if header is not None else 0,
                data_offset=-1 if reply.extents else reply.data_offset,
            )
            if earlier is not None:  # the same pages: their registration with CUDA goes on
                PAGES.hand_over(earlier, mapping)
        except segments.SegmentError as err:
            raise SharedMemoryError(str(err)) from None
        self.mappings.remember(key, mapping)
        return mapping

    def _cuda_mapping(
        self,
        key: tuple,
        cached: segments.SegmentMapping | None,
        reply: pb.OpenShardResponse,
        process: segments.RankProcess,
    ) -> segments.SegmentMapping:
        """The shard's CUDA memory: the cached mapping when the handle is the same one (opening a handle maps the
        whole allocation, milliseconds per call; closing one waits for the device), the memory opened for an
        earlier version when the rank reused it for this one, else a newly opened one."""
        h = reply.cuda
        if cached is not None and cached.cuda_handle == (h.handle, h.storage_offset_bytes):
            # the rank counted one more user of its memory for this reply; we already hold one
            release_cuda_count(h)
            return cached
        earlier = self.mappings.take_cuda(key[0], reply)
        if earlier is not None:
            release_cuda_count(h)  # as above: the earlier mapping holds the memory open
            flat, state = earlier.flat, earlier.state
        else:
            flat = segments.map_cuda(reply)
            state = (
                segments.map_state_header(reply) if reply.fd else None
            )  # later reads check it instead of calling OpenShard
        mapping = segments.SegmentMapping(
            process,
            reply.inode,
            reply.device_id,
            flat,
            state,
            reply.fd,
            cuda_handle=(h.handle, h.storage_offset_bytes),
            generation=int(state[2]) if state is not None else 0,
        )
        self.mappings.remember(key, mapping)
        return mapping

    def _open_shard(
        self, address: str, request: pb.OpenShardRequest, cancel: Cancellation | None = None
    ) -> pb.OpenShardResponse:
        counters.count("shm_opens")
        try:
            return unary(
                self.channel.shard_server(address).OpenShard,
                request,
                self.channel.timeout,
                self.channel.metadata,
                cancel,
            )
        except grpc.RpcError as err:
            error = error_from_rpc(err, f"rank at {address}")
            if error.reason in (Reason.PATH_UNAVAILABLE, Reason.INTERNAL):
                raise SharedMemoryError(f"rank at {address}: {err.details()}") from None
            raise error from None

    def _release(self, address: str, lease_ids: list[int]) -> None:
        """End leases at the rank at `address`, off the caller's thread (an unreleased lease expires)."""
        if not lease_ids:
            return
        stub = self.channel.shard_server(address)
        request = pb.ReleaseShardRequest(lease_ids=lease_ids)

        def release() -> None:
            try:
                stub.ReleaseShard(
                    request, timeout=self.channel.timeout, metadata=self.channel.metadata
                )
            except (
                grpc.RpcError
            ) as err:  # the lease then ends at its expiry, holding the version until then
                log.info(
                    "releasing leases %s at %s failed (%s); they expire on their own",
                    lease_ids,
                    address,
                    err.code().name,
                )

        self.channel.submit(release)


def _request(
    summary: TensorSummary, index: int, cached: segments.SegmentMapping | None
) -> pb.OpenShardRequest:
    """The OpenShard request of shard `index`, naming the segment this process maps for it (if any)."""
    return pb.OpenShardRequest(
        name=summary.name,
        version=summary.version,
        shard_index=index,
        cached_inode=cached.inode if cached else 0,
        cuda_ipc=torch.cuda.is_available(),
        header_slots=True,
    )


def _check_reply(reply: pb.OpenShardResponse, summary: TensorSummary, index: int) -> None:
    """SharedMemoryError unless the rank describes exactly the shard the client's metadata expects."""
    shard = summary.metadata.shards_metadata[index]
    expected = shard.box.numel() * summary.metadata.tensor_properties.itemsize
    if (
        reply.version != summary.version
        or tuple(reply.shard_sizes) != shard.shard_sizes
        or reply.nbytes != expected
        or dtype_from_wire(reply.dtype) != summary.metadata.dtype
    ):
        raise SharedMemoryError(
            f"rank described shard {index} of {summary.name!r} as version {reply.version}, "
            f"sizes {tuple(reply.shard_sizes)}, {reply.nbytes} bytes; expected version "
            f"{summary.version}, sizes {shard.shard_sizes}, {expected} bytes"
        )


def _as_shard(flat: torch.Tensor, summary: TensorSummary, index: int) -> torch.Tensor:
    """The shard's bytes `flat` as a tensor of its dtype and sizes."""
    return flat.view(summary.metadata.dtype).view(
        summary.metadata.shards_metadata[index].shard_sizes
    )


def stale(summary: TensorSummary, address: str) -> StaleVersionError:
    return StaleVersionError(
        f"tensor {summary.name!r} version {summary.version} is no longer served by the rank "
        f"at {address}",
        grpc.StatusCode.FAILED_PRECONDITION,
    )
