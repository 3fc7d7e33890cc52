"""The writer's half of delta puts, shared by state-dict and single-tensor puts: hash what would be written,
compare it block by block with what the previous put wrote (shardserve.core.delta), and send only the changed
blocks into the new version's copies (ShardServer.WriteBytes, in batches, every rank at once). A delta put
that trusts version counters takes a source torch saw no write to since the previous put as unchanged without
reading it (client/stamps.py).

Counted in the client's metrics: `delta_puts` (delta puts that sent only what changed), `delta_bytes` (the
bytes of changed blocks they sent) and `delta_hashed_bytes` (the bytes delta puts read to hash them)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from shardserve.client import counters
from shardserve.client.errors import ShardServeError
from shardserve.client.session import Session
from shardserve.client.stamps import Stamp
from shardserve.core.checksums import hashing_pool
from shardserve.core.delta import block_bytes, block_hashes, changed_ranges
from shardserve.protos import shardserve_pb2 as pb

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
BlockHashes = tuple[int, ...]


class PreviousPuts(Generic[V]):
    """What one client's last delta put of each key (a state dict's prefix, a tensor's name) wrote; a put takes
    its key's record (so two puts of one key never share one) and keeps a new one when it is done."""

    def __init__(self) -> None:
        self._by_key: dict[str, V] = {}
        self._lock = threading.Lock()

    def take(self, key: str) -> V | None:
        with self._lock:
            return self._by_key.pop(key, None)

    def keep(self, key: str, previous: V) -> None:
        with self._lock:
            self._by_key[key] = previous


_memories: weakref.WeakKeyDictionary[Session, dict[str, PreviousPuts[Any]]] = (
    weakref.WeakKeyDictionary()
)
_memories_guard = threading.Lock()


def previous_puts_of(session: Session, kind: str) -> PreviousPuts[Any]:
    """The delta puts' memory of `session` for one `kind` of put ("prefix", "tensor"), gone with the session."""
    with _memories_guard:
        return _memories.setdefault(session, {}).setdefault(kind, PreviousPuts())


@dataclass(frozen=True)
class ChangedShard:
    """One server shard of the new version, the writer's `data` for it and the dtype it is stored in, and the
    block hashes of the new and the previous bytes (None: not known, every block is sent)."""

    rank: int
    name: str
    version: int
    index: int
    data: torch.Tensor  # the writer's view of the shard's box, in the writer's dtype
    dtype: torch.dtype  # the stored dtype
    before: BlockHashes | None
    after: BlockHashes


class Source(NamedTuple):
    """What a delta put writes for one shard: the writer's `data` (its view of the shard's box), the dtype it is
    stored in, and the tensor whose version counter counts writes to it besides its own (the state dict's DTensor
    `data` is a local piece of; None for a plain tensor)."""

    data: torch.Tensor
    dtype: torch.dtype
    counter: torch.Tensor | None = None


@dataclass(frozen=True)
class Hashes(Generic[K]):
    """The block hashes of the stored bytes a delta put wrote, by key, and the stamp each source had when it was
    read (client/stamps.py)."""

    blocks: Mapping[K, BlockHashes]
    stamps: Mapping[K, Stamp | None]

    def unchanged(self, key: K, stamp: Stamp | None) -> BlockHashes | None:
        """The hashes of `key` when its source's `stamp` shows no write since they were made, else None."""
        kept = self.stamps.get(key)
        return self.blocks.get(key) if kept is not None and kept.matches(stamp) else None


def stored_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`data` as a rank stores it: cast to `dtype`, contiguous, on the CPU (itself when it already is)."""
    return data.detach().to(device="cpu", dtype=dtype).contiguous()


def hash_all(sources: Mapping[K, Source], *, trusted: Hashes[K] | None = None) -> Hashes[K]:
    """The block hashes of every source's stored bytes (start_hash_all), once made."""
    return start_hash_all(sources, trusted=trusted)()


def start_hash_all(
    sources: Mapping[K, Source], *, trusted: Hashes[K] | None = None
) -> Callable[[], Hashes[K]]:
    """Start hashing the stored bytes of every source in parallel on the hashing pool
    (xxhash releases the GIL), each source's stamp taken before it is read; a source whose stamp matches the one
    `trusted` kept takes its hashes unread. Returns what waits for the hashes (the caller may do other work
    meanwhile); the bytes read are counted in `delta_hashed_bytes`."""
    pool = hashing_pool()
    stamps = {key: Stamp.of(source.data, source.counter) for key, source in sources.items()}
    known: dict[K, BlockHashes] = {}
    futures = {}
    read = 0
    for key, (data, dtype, _) in sources.items():
        unchanged = trusted.unchanged(key, stamps[key]) if trusted is not None else None
        if unchanged is not None:
            known[key] = unchanged
        else:
            futures[key] = pool.submit(_stored_hashes, data, dtype)
            read += data.numel() * dtype.itemsize
    counters.count("delta_hashed_bytes", read)
    return lambda: Hashes({**known, **{key: f.result() for key, f in futures.items()}}, stamps)


def _stored_hashes(data: torch.Tensor, dtype: torch.dtype) -> BlockHashes:
    return block_hashes(stored_bytes(data, dtype))


def write_changed(session: Session, shards: Sequence[ChangedShard]) -> int:
    """Send the changed blocks of every shard, each shard's in one WriteBytes where it goes through memory (in
    requests of a few MiB each where it travels inline: Session.write_bytes), all shards at once; the bytes sent
    (counted in `delta_bytes`)."""
    jobs = []
    for shard in shards:
        nbytes = shard.data.numel() * shard.dtype.itemsize
        step = block_bytes(tuple(shard.data.shape), shard.dtype.itemsize)
        ranges = changed_ranges(shard.before, shard.after, step=step, nbytes=nbytes)
        if ranges:
            jobs.append(partial(_write_bytes, session, shard, ranges))
    sent = sum(session.run_all(jobs))
    counters.count("delta_puts")
    counters.count("delta_bytes", sent)
    return sent


def _write_bytes(session: Session, shard: ChangedShard, ranges: list[tuple[int, int]]) -> int:
    flat = stored_bytes(shard.data, shard.dtype).reshape(-1).view(torch.uint8)
    request = pb.WriteBytesRequest(
        name=shard.name,
        version=shard.version,
        shard_index=shard.index,
        starts=[start for start, _ in ranges],
        lengths=[stop - start for start, stop in ranges],
    )
    nbytes = sum(stop - start for start, stop in ranges)
    written = session.write_bytes(shard.rank, request, [flat[start:stop] for start, stop in ranges])
    if written != nbytes:
        raise ShardServeError(
            f"rank {shard.rank} wrote {written} of {nbytes} bytes of {shard.name!r}"
        )
    return nbytes
