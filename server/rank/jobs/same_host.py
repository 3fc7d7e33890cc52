"""Ranks on one host exchange a reshard's buckets through each other's shard memory, not the network.

Before any bucket moves, every pair of ranks that exchange buckets swaps its `PeerExport`s (server/rank/jobs/
peer_memory.py) over the job's own group: two small gloo messages each way, only between the two ends of a
bucket, as the buckets themselves (no barrier, no all-ranks collective). From the two exports both ends compute
the same split (`split_part`): a bucket whose destination can map its source's memory (one host, the same user)
and whose every source shard is exported is *mapped*; the others travel over gloo or NCCL in rounds as before.
Both ends drop the mapped buckets from their rounds, so the rounds they walk still match.

A destination maps the source shards of its mapped buckets and copies the boxes straight into its new shards
(`copy_mapped`), beside its local copies; then it tells each such source the result (`settle`: one int64 each).
A source holds its lease on the source version until every destination mapping it has said so, and fails with
ReshardError naming one that failed, died or stayed silent past the deadline. So a source's memory is never
freed under a copy: a failed job commits nothing, and while mapped, a memfd's pages (and, through torch's IPC
reference count, a CUDA allocation) outlive even the process that lent them. gloo and NCCL carry only what
crosses hosts (or users), which is also why two ranks on one GPU, which NCCL refuses, can reshard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from shardserve.core.executor import copy_box
from shardserve.core.planner import Bucket, RankPlan, ReshardPlan
from shardserve.server.rank.jobs.groups import P2P, PeerGroup, Verb
from shardserve.server.rank.jobs.peer_memory import (
    CudaShard,
    PeerExport,
    PeerMemoryError,
    cuda_handles,
    decode_handles,
    encode_handles,
    open_shard,
    release_handle,
)
from shardserve.server.rank.jobs.reshard_exchange import ReshardError, ReshardStats

# Tags of the handshake and the notices: above any round's tag (a round is a bucket's position within its pair).
EXPORT_TAGS = (1 << 24, (1 << 24) + 1)  # (sizes, bytes)
HANDLE_TAGS = ((1 << 24) + 2, (1 << 24) + 3)
NOTICE_TAG = (1 << 24) + 4
_COPIED, _FAILED = 0, 1
FAILURE_WORD_S = 2.0  # how long a failed rank tries to tell its sources so

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PeerMemory:
    """What a rank brings to the same-host exchange of one job: its export, and a hook run once the peers'
    shards are mapped and before they are read (tests stall there to kill a source mid-copy)."""

    export: PeerExport
    after_mapping: Callable[[], None] = field(default=lambda: None)


@dataclass(frozen=True)
class SameHostPart:
    """One rank's part of a plan, split: `wire` keeps the buckets that cross the network; this rank copies
    `mapped_recvs` out of its sources' memory, and same-host destinations copy `mapped_sends` out of its own."""

    wire: RankPlan
    mapped_recvs: tuple[Bucket, ...] = ()
    mapped_sends: tuple[Bucket, ...] = ()
    # CUDA source shards lent by IPC: this rank's, by the destination that opens them; and the peers', by source
    lent_by_ipc: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    borrowed_by_ipc: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def sources(self) -> tuple[int, ...]:
        """The ranks this one copies from (and then tells how it went)."""
        return tuple(sorted({b.src_rank for b in self.mapped_recvs}))

    @property
    def destinations(self) -> tuple[int, ...]:
        """The ranks that copy from this one (and whose word it waits for)."""
        return tuple(sorted({b.dst_rank for b in self.mapped_sends}))


def split_part(part: RankPlan, mine: PeerExport, exports: Mapping[int, PeerExport]) -> SameHostPart:
    """Split `part` by what both ends of each bucket know: this rank's export and its peers' (`exports`)."""

    def export_of(rank: int) -> PeerExport:
        return mine if rank == part.rank else exports[rank]

    def mapped(bucket: Bucket) -> bool:
        src, dst = export_of(bucket.src_rank), export_of(bucket.dst_rank)
        return dst.maps(src) and all(t.src_shard in src.shards for t in bucket.transfers)

    def by_ipc(
        buckets: tuple[Bucket, ...], peer_of: Callable[[Bucket], int]
    ) -> dict[int, tuple[int, ...]]:
        shards: dict[int, set[int]] = {}
        for bucket in buckets:
            lender = export_of(bucket.src_rank)
            for t in bucket.transfers:
                if isinstance(lender.shards[t.src_shard], CudaShard):
                    shards.setdefault(peer_of(bucket), set()).add(t.src_shard)
        return {peer: tuple(sorted(indices)) for peer, indices in sorted(shards.items())}

    mapped_sends = tuple(b for b in part.sends if mapped(b))
    mapped_recvs = tuple(b for b in part.recvs if mapped(b))
    wire_sends = tuple(b for b in part.sends if not mapped(b))
    wire_recvs = tuple(b for b in part.recvs if not mapped(b))
    return SameHostPart(
        RankPlan(part.rank, part.local, wire_sends, wire_recvs),
        mapped_recvs=mapped_recvs,
        mapped_sends=mapped_sends,
        lent_by_ipc=by_ipc(mapped_sends, lambda b: b.dst_rank),
        borrowed_by_ipc=by_ipc(mapped_recvs, lambda b: b.src_rank),
    )


def swap_exports(
    group: PeerGroup, peers: tuple[int, ...], mine: PeerExport, deadline: float
) -> dict[int, PeerExport]:
    """Send this rank's export to each peer and take theirs."""
    encoded = mine.encode()
    received = _swap_bytes(
        group, {peer: encoded for peer in peers}, peers, EXPORT_TAGS, deadline, "swap exports with"
    )
    return {peer: _decoded(peer, PeerExport.decode, data) for peer, data in received.items()}


def swap_cuda_handles(
    group: PeerGroup, part: SameHostPart, src_shards: Mapping[int, torch.Tensor], deadline: float
) -> dict[int, dict[int, bytes]]:
    """Hand each destination a CUDA IPC handle of each CUDA shard it copies from (made for it alone) and take
    those of the sources this rank copies from: the handles by source rank and shard."""
    if not part.lent_by_ipc and not part.borrowed_by_ipc:
        return {}
    outgoing = {
        peer: encode_handles(cuda_handles(src_shards, indices))
        for peer, indices in part.lent_by_ipc.items()
    }
    received = _swap_bytes(
        group, outgoing, tuple(part.borrowed_by_ipc), HANDLE_TAGS, deadline, "swap handles with"
    )
    return {peer: _decoded(peer, decode_handles, data) for peer, data in received.items()}


def _decoded(peer: int, decode: Callable[[bytes], T], data: bytes) -> T:
    try:
        return decode(data)
    except PeerMemoryError as err:
        raise ReshardError(f"rank {peer}: {err}", (peer,)) from None


def _swap_bytes(  # noqa: PLR0913 - one exchange: what goes where, what comes from where, its tags
    group: PeerGroup,
    outgoing: Mapping[int, bytes],
    incoming: tuple[int, ...],
    tags: tuple[int, int],
    deadline: float,
    doing: str,
) -> dict[int, bytes]:
    """Send each peer of `outgoing` its bytes and take bytes from each peer of `incoming`: the sizes first (one
    int64 each), then the bytes."""
    payloads = {
        peer: torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for peer, data in outgoing.items()
    }
    sizes = {peer: torch.zeros(1, dtype=torch.int64) for peer in incoming}
    _run(
        group,
        [P2P(Verb.SEND, torch.tensor([p.numel()]), peer) for peer, p in payloads.items()]
        + [P2P(Verb.RECEIVE, size, peer) for peer, size in sizes.items()],
        tags[0],
        deadline,
        doing,
    )
    received = {peer: torch.empty(int(size), dtype=torch.uint8) for peer, size in sizes.items()}
    _run(
        group,
        [P2P(Verb.SEND, payload, peer) for peer, payload in payloads.items()]
        + [P2P(Verb.RECEIVE, data, peer) for peer, data in received.items()],
        tags[1],
        deadline,
        doing,
    )
    return {peer: data.numpy().tobytes() for peer, data in received.items()}


def copy_mapped(
    plan: ReshardPlan,
    part: SameHostPart,
    exports: Mapping[int, PeerExport],
    out: Mapping[int, torch.Tensor],
    *,
    handles: Mapping[int, Mapping[int, bytes]],
    stats: ReshardStats,
    after_mapping: Callable[[], None],
) -> None:
    """Map the source shards of this rank's mapped buckets (CUDA ones by their `handles`, by source rank and
    shard) and copy their boxes into `out` (new shards); CUDA copies are complete when this returns.
    ReshardError naming a source whose memory cannot be mapped."""
    src_meta, dst_meta = plan.src.shards_metadata, plan.dst.shards_metadata
    sources = _open_sources(plan, part, exports, handles)
    after_mapping()
    devices = set()
    for bucket in part.mapped_recvs:
        for t in bucket.transfers:
            target = out[t.dst_shard]
            copy_box(
                sources[(bucket.src_rank, t.src_shard)],
                src_meta[t.src_shard].box,
                target,
                dst_meta[t.dst_shard].box,
                t.box,
            )
            devices.add(target.device)
        stats.mapped_bytes += bucket.nbytes
        stats.mapped_buckets += 1
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _open_sources(
    plan: ReshardPlan,
    part: SameHostPart,
    exports: Mapping[int, PeerExport],
    handles: Mapping[int, Mapping[int, bytes]],
) -> dict[tuple[int, int], torch.Tensor]:
    """Every source shard this rank copies from, mapped, by (source rank, shard); on a failure the CUDA handles
    not opened yet are given back."""
    needed = sorted({(b.src_rank, t.src_shard) for b in part.mapped_recvs for t in b.transfers})
    sources: dict[tuple[int, int], torch.Tensor] = {}
    for rank, index in needed:
        try:
            sources[(rank, index)] = open_shard(
                exports[rank],
                index,
                sizes=plan.src.shards_metadata[index].shard_sizes,
                dtype=plan.src.dtype,
                cuda_handle=handles.get(rank, {}).get(index),
            )
        except PeerMemoryError as err:
            for later_rank, later in needed[len(sources) + 1 :]:
                handle = handles.get(later_rank, {}).get(later)
                if handle is not None:
                    release_handle(handle)
            raise ReshardError(f"cannot map the memory of rank {rank}: {err}", (rank,)) from None
    return sources


def settle(group: PeerGroup, part: SameHostPart, *, copied: bool, deadline: float) -> None:
    """Tell every source this rank copied from whether it `copied` its boxes; then, if it did, wait for the word
    of every destination that copies from this rank (ReshardError naming one that failed or did not answer)."""
    notice = torch.tensor([_COPIED if copied else _FAILED], dtype=torch.int64)
    sends = [P2P(Verb.SEND, notice, peer) for peer in part.sources]
    if not copied:
        # a failed job commits nothing: the sources need only not wait for this rank until their deadline.
        # The word is sent before the failure is reported, which ends the group (and what it has not sent).
        try:
            _run(group, sends, NOTICE_TAG, min(deadline, time.monotonic() + FAILURE_WORD_S), "tell")
        except ReshardError as err:
            log.info("a source will not hear of this failure: %s", err)
        return
    words = {peer: torch.full((1,), -1, dtype=torch.int64) for peer in part.destinations}
    told = _post(group, sends, NOTICE_TAG, "tell")
    _run(
        group,
        [P2P(Verb.RECEIVE, word, peer) for peer, word in words.items()],
        NOTICE_TAG,
        deadline,
        "hear from",
    )
    failed = [peer for peer, word in words.items() if int(word) != _COPIED]
    if failed:
        raise ReshardError(
            f"rank {failed[0]} failed to copy its boxes out of this rank's memory", tuple(failed)
        )
    _wait(
        told, deadline, "tell"
    )  # a source that failed takes no word: this rank fails before it waits


def _run(group: PeerGroup, ops: list[P2P], tag: int, deadline: float, doing: str) -> None:
    """Post `ops` and wait for them all within the deadline; ReshardError naming the first peer that fails."""
    _wait(_post(group, ops, tag, doing), deadline, doing)


def _post(group: PeerGroup, ops: list[P2P], tag: int, doing: str) -> list[tuple[dist.Work, int]]:
    """Post `ops`: each one's work and peer."""
    try:
        works = group.post(ops, tag)
    except Exception as exc:
        peers = tuple(sorted({op.peer for op in ops}))
        raise ReshardError(f"failed to {doing} ranks {list(peers)}: {exc}", peers) from exc
    return list(zip(works, [op.peer for op in ops]))


def _wait(posted: list[tuple[dist.Work, int]], deadline: float, doing: str) -> None:
    """Wait for every posted work within the deadline; ReshardError naming the first peer that fails."""
    for work, peer in posted:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0 or not work.wait(timedelta(seconds=remaining)):
                raise TimeoutError("the deadline passed")
        except (RuntimeError, TimeoutError) as exc:
            raise ReshardError(f"failed to {doing} rank {peer}: {exc}", (peer,)) from exc
