"""Batch requests to ranks sent as bytes: each entry encoded once, a rank's request its fields' bytes joined.

A fan-out's batch request (AllocateMany, PromoteMany, DropMany) repeats entries across ranks (every rank of a
tensor allocates and promotes it) and holds up to thousands of them. Each entry is serialized once (`Entries`);
a rank's request is the bytes of its scalar fields followed by its entries' bytes (protobuf's encoding of a
message is the concatenation of its fields' encodings, a repeated field's entries in order), and the batch
methods of `rank_stub` send such `Encoded` bytes as they are. Parsing the joined bytes into a message, only for
gRPC to serialize it again, took 153-269 ms per AllocateMany fan-out of 100,000 entries of 10-shard tensors
(28 MB; joining them: 4 ms), and steady commits of 100,000 shards at 1,000 simulated ranks went from 3.3-5.0 s
of coordinator CPU to 2.9-3.7 s (two runs each).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc

K = TypeVar("K")

_SERVICE = pb.DESCRIPTOR.services_by_name["ShardServer"]
SERVICE = _SERVICE.full_name


@dataclass(frozen=True)
class Encoded:
    """A request already in its wire encoding, sent as it is (gRPC takes exactly `bytes`, no subclass)."""

    data: bytes


def serialize(request: Message | Encoded) -> bytes:
    """A request's wire bytes: an Encoded request's own, a message's serialized."""
    return request.data if isinstance(request, Encoded) else request.SerializeToString()


_KINDS = {  # (client streaming, server streaming): the channel's factory of such calls
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}
# each method of the service: the channel's factory of its calls, and its answer's parser
_METHODS = {
    method.name: (
        _KINDS[(method.client_streaming, method.server_streaming)],
        GetMessageClass(method.output_type).FromString,
    )
    for method in _SERVICE.methods
}


class _LazyStub:
    """The ShardServer stub of one channel (blocking or grpc.aio), every method taking Encoded requests too; a
    method's callable is made when it is first used. The coordinator keeps a stub per rank (one at registration,
    one for its fan-outs) and calls a few of the service's methods: gRPC's generated stub makes a callable for
    each of them, 23 per rank, which was a tenth of the coordinator's CPU during the first fan-out to 1,000 ranks."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel

    def __getattr__(self, method: str) -> Any:
        found = _METHODS.get(method)
        if found is None:
            raise AttributeError(f"the ShardServer service has no method {method!r}")
        kind, parse = found
        made = getattr(self._channel, kind)(
            f"/{SERVICE}/{method}",
            request_serializer=serialize,
            response_deserializer=parse,
            _registered_method=True,
        )
        setattr(self, method, made)  # found as an attribute from now on
        return made


def rank_stub(channel: Any) -> pb_grpc.ShardServerStub:
    """The ShardServer stub of `channel` (blocking or grpc.aio), every method taking Encoded requests too, each
    method's callable made when first used (typed as the generated stub, whose methods it has)."""
    return cast(pb_grpc.ShardServerStub, _LazyStub(channel))


class Entries(Generic[K]):
    """The entries of one repeated message field of a fan-out's batch requests, each encoded once: building a
    request of thousands of entries from Python objects costs tens of microseconds an entry."""

    def __init__(
        self, request_type: type[Message], field: str, encode: Callable[[K], bytes]
    ) -> None:
        """`encode`: an item's entry message, serialized (`serialized(make)` for a function making the message)."""
        number = request_type.DESCRIPTOR.fields_by_name[field].number
        self._tag = _varint(number << 3 | 2)  # length-delimited
        self._encode = encode
        self._encoded: dict[Hashable, bytes] = {}

    def joined(self, items: Iterable[K], *, key: Callable[[K], Hashable] | None = None) -> bytes:
        """The field's entries for `items`, as bytes to append to a request's. `key`: what an item is known by
        across ranks (the item itself by default; `id` where the same objects recur in every rank's list and
        live as long as these entries)."""
        encoded, parts = self._encoded, []
        for item in items:
            k = item if key is None else key(item)
            entry = encoded.get(k)
            if entry is None:
                body = self._encode(item)
                entry = encoded[k] = self._tag + _varint(len(body)) + body
            parts.append(entry)
        return b"".join(parts)


def serialized(make: Callable[[K], Message]) -> Callable[[K], bytes]:
    """An `Entries` encoder from a function that makes an item's entry message."""
    return lambda item: make(item).SerializeToString()


def _varint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
