"""The calls of one lookup to the ranks: mapped shards answered here, one Lookup call per other rank.

Same-host ranks answer row items from their mapped shards in the calling
thread; the ranks left over get one call each, over their bulk port (every
request sent from the calling thread before any answer is awaited) or over
gRPC, both through client.paths. Answers are collected by a Receiver per rank.
A call that has not answered within the hedge delay is asked of one other rank
holding a copy of every shard it names (client.paths.hedging), into a Receiver
of its own that the call's Receiver adopts if it answers first.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import grpc
import torch

from shardserve.client.embedding.plan import ItemPlan, answer_bytes, reply_bytes
from shardserve.client.errors import RankUnavailableError, ShardServeError, StaleVersionError
from shardserve.client.paths.grpc import answers_in_one_message
from shardserve.client.paths.hedging import Cancellation, Landing
from shardserve.client.paths.kinds import PathKind, PipelinedCalls, StreamedCalls
from shardserve.client.paths.pipeline import NetworkCall, SentCalls
from shardserve.client.session import Session
from shardserve.core.dtypes import dtype_from_wire
from shardserve.core.embedding import PartialBags
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.chunk_codec import RawLookupChunk, decode_lookup_reply

# A lookup's own CPU work (a mapped lookup's gather, client-side pooling; a routed one's planning, answer decoding
# and assembly, but never a wait for an answer: the turn is not held while gRPC calls on the client's pool,
# which take it too, are awaited; sends hold it, and so does opening a bulk connection where a rank has none
# kept) runs under the GIL: threads doing it at once only hand the GIL back and forth
# at every call into torch, numpy or protobuf (8 threads were 3.5x slower per mapped lookup than one; 8 routed
# 512-id lookups over gRPC took 2.1 ms each, 1.6 ms with turns), so they take turns on this process-wide lock.
CPU_TURN = threading.RLock()


@dataclass
class Exchange:
    """One lookup's calls to the ranks once sent: wait() outside the CPU turn, then finish() inside it."""

    last_paths: dict[int, str]
    ranks: list[tuple[int, bool]] = field(
        default_factory=list
    )  # per call: rank, and whether shm answered some
    receivers: list[Receiver] = field(default_factory=list)
    calls: list[NetworkCall] = field(default_factory=list)
    sent: SentCalls | None = None
    paths: list[PathKind | None] = field(default_factory=list)

    def wait(self) -> None:
        """Every answer received (raises the first failure once all calls ended)."""
        if self.sent is not None:
            self.paths = self.sent.wait()

    def finish(self) -> None:
        """Every item answered; the path of each rank recorded in last_paths."""
        for receiver in self.receivers:
            receiver.finish()
        for (rank, mapped), path in zip(self.ranks, self.paths):
            self.last_paths[rank] = f"shm+{path}" if mapped else str(path)


def call_ranks(session: Session, items: list[ItemPlan], last_paths: dict[int, str]) -> None:
    """Give every item its answer: the calls sent and the answers decoded under the process-wide CPU turn,
    the waits outside it."""
    with CPU_TURN:
        exchange = send_calls(session, items, last_paths)
    exchange.wait()
    with CPU_TURN:
        exchange.finish()


def send_calls(session: Session, items: list[ItemPlan], last_paths: dict[int, str]) -> Exchange:
    """Answer what mapped shards can in this thread, then start one Lookup call per remaining rank (the
    bulk port's requests all sent here, gRPC calls on the channel's threads)."""
    by_rank: dict[int, list[ItemPlan]] = defaultdict(list)
    for item in items:
        by_rank[item.rank].append(item)
    exchange = Exchange(last_paths)
    for rank, group in sorted(by_rank.items()):
        rest = answer_through_shared_memory(session, rank, group)
        if not rest:
            last_paths[rank] = "shm"
            continue
        receiver = Receiver(rest, f"rank {rank} at {session.address_of(rank)}")
        exchange.ranks.append((rank, len(rest) < len(group)))
        exchange.receivers.append(receiver)
        exchange.calls.append(network_call(session, rank, receiver))
    if exchange.calls:
        exchange.sent = session.paths.send_all(exchange.calls, session.channel.submit)
    return exchange


def network_call(session: Session, rank: int, receiver: Receiver) -> NetworkCall:
    """One lookup call to `rank` for the receiver's items, pipelined (the bulk port) or streamed (gRPC). Either
    way an answer up to SMALL_ANSWER_BYTES (client.paths.grpc) comes in one message; a larger one streams (and
    so is not pipelined). A pipelined answer is kept whole and decoded in finish()."""
    status = session.rank_status(rank)
    request = pb.LookupRequest(items=[item.wire_message() for item in receiver.items])
    expected = sum(answer_bytes(item) for item in receiver.items)

    def send(path: PipelinedCalls, cancel: Cancellation) -> Callable[[], None]:
        answer = path.send_lookup(status.address, request, reply_bytes(receiver.items), cancel)

        def take_answer() -> None:
            receiver.reply = answer()

        return take_answer

    def call(path: StreamedCalls, cancel: Cancellation) -> None:
        path.lookup(status.address, request, expected, receiver.add_in_turn, receiver.where, cancel)

    return NetworkCall(
        status,
        send if answers_in_one_message(expected) else None,
        call,
        partial(hedge_call, session, receiver),
        expected,
    )


def hedge_call(session: Session, receiver: Receiver, cancel: Cancellation) -> tuple[str, Landing]:
    """The receiver's items asked of other copies of their shards (the hedge of a silent lookup call): one call
    per rank holding them, sent together; returns the path of the last and the landing that makes `receiver`
    take these answers."""
    by_rank: dict[int, list[tuple[int, ItemPlan]]] = defaultdict(list)
    for position, item in enumerate(receiver.items):
        others = session.health.other_copies(item.view.summary, item.message.shard_index)
        if not others:
            raise RankUnavailableError(
                f"{receiver.where}: shard {item.message.shard_index} of "
                f"{item.view.name!r} has no other copy to ask"
            )
        index = others[0]
        rank = item.view.summary.metadata.shards_metadata[index].rank
        message = pb.LookupItem()
        message.CopyFrom(item.wire_message())
        message.shard_index = index
        by_rank[rank].append((position, replace(item, rank=rank, message=message, answer=None)))
    hedges = [
        (
            positions,
            Receiver([item for _, item in group], f"rank {rank} at {session.address_of(rank)}"),
        )
        for rank, group in sorted(by_rank.items())
        for positions in [[p for p, _ in group]]
    ]
    calls = [
        replace(network_call(session, hedge.items[0].rank, hedge), hedge=None)
        for _, hedge in hedges
    ]
    sent = session.paths.send_all(calls, session.channel.submit)
    cancel.on_cancel(sent.cancel)
    paths = sent.wait()
    for _, hedge in hedges:
        hedge.take_reply()

    def land() -> None:
        for positions, hedge in hedges:
            receiver.adopt(hedge, positions)

    return str(paths[-1]), land


def answer_through_shared_memory(
    session: Session, rank: int, items: list[ItemPlan]
) -> list[ItemPlan]:
    """Answer row items of a rank whose first path reads rows (same host: client.paths.shm); return the rest.

    Any size: a mapped read skips the round trip, 3-4x faster than gRPC even for one id."""
    if all(item.message.pooled for item in items):
        return items
    status, rest = session.rank_status(rank), []
    for item in items:
        rows = None
        if not item.message.pooled:
            rows = session.paths.lookup_rows(
                status, item.view.summary, item.message.shard_index, item.ids
            )
        if rows is None:
            rest.append(item)
        else:
            item.answer = rows
    return rest


class Receiver:
    """Collects the streamed chunks of every item into preallocated tensors and checks versions."""

    def __init__(self, items: list[ItemPlan], where: str) -> None:
        self.items = items
        self.where = where
        self.buffers: list[bytearray | memoryview | None] = [None] * len(items)
        self.received = [0] * len(items)
        self.headers: list[RawLookupChunk | None] = [None] * len(items)
        self.reply: bytearray | None = (
            None  # a whole LookupReply taken off the bulk port, decoded by finish()
        )

    def add(self, chunk: RawLookupChunk) -> None:
        index = chunk.item
        if not 0 <= index < len(self.items):
            raise ShardServeError(
                f"{self.where} answered item {index} of a {len(self.items)}-item lookup"
            )
        if chunk.offset == 0 and self.headers[index] is None:
            item = self.items[index]
            if chunk.version != item.message.version:
                raise StaleVersionError(
                    f"{self.where} served {item.message.name!r} at version {chunk.version}, "
                    f"not {item.message.version}",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
            self.headers[index] = chunk
            if len(chunk.data) == chunk.nbytes and not chunk.data.readonly:
                self.buffers[index] = (
                    chunk.data
                )  # the whole item in one writable message: used where it is
                self.received[index] = chunk.nbytes
                return
            self.buffers[index] = bytearray(chunk.nbytes)
        buffer = self.buffers[index]
        end = chunk.offset + len(chunk.data)
        if buffer is None or chunk.offset != self.received[index] or end > len(buffer):
            raise ShardServeError(f"{self.where} sent a misplaced chunk for item {index}")
        buffer[chunk.offset : end] = chunk.data
        self.received[index] = end

    def adopt(self, other: Receiver, positions: list[int]) -> None:
        """Take what `other` received for its items (these items at `positions`, asked of other copies) in place
        of this receiver's answer."""
        self.reply = None
        for own, position in enumerate(positions):
            self.buffers[position] = other.buffers[own]
            self.received[position] = other.received[own]
            self.headers[position] = other.headers[own]

    def add_in_turn(self, chunk: RawLookupChunk) -> None:
        """add(chunk) under the process-wide CPU turn (a streamed answer waits for its next chunk outside it)."""
        with CPU_TURN:
            self.add(chunk)

    def take_reply(self) -> None:
        """Add the chunks of a whole reply taken off the bulk port, if there is one."""
        if self.reply is not None:
            for chunk in decode_lookup_reply(self.reply):  # type: ignore[arg-type]
                self.add(chunk)
            self.reply = None

    def finish(self) -> None:
        """Give every item its answer (the chunks added, or the bulk reply), checked whole."""
        self.take_reply()
        for index, item in enumerate(self.items):
            header, buffer = self.headers[index], self.buffers[index]
            if header is None or buffer is None or self.received[index] != len(buffer):
                raise ShardServeError(
                    f"{self.where} did not answer item {index} ({item.message.name!r}) whole"
                )
            dtype = dtype_from_wire(header.dtype)
            data = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
            data = data.view(-1, item.width)
            if item.message.pooled:
                counts = (
                    torch.frombuffer(bytearray(header.counts), dtype=torch.int64)
                    if header.counts
                    else torch.empty(0, dtype=torch.int64)
                )
                start = item.columns.start or 0
                item.answer = PartialBags(data, counts, start)
            else:
                item.answer = data
