"""The writer's half of delta puts, shared by state-dict and single-tensor puts: hash what would be written,
compare it block by block with what the previous put wrote (shardserve.core.delta), and send only the changed
blocks into the new version's copies (ShardServer.WriteBytes, in batches, every rank at once).

Counted in the client's metrics: `delta_puts` (delta puts that sent only what changed) and `delta_bytes` (the
bytes of changed blocks they sent)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import torch

from shardserve.client import counters
from shardserve.client.errors import ShardServeError
from shardserve.client.session import Session
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
    """One server shard of the new version, its bytes as stored, and the block hashes of the new and the
    previous bytes (None: not known, every block is sent)."""

    rank: int
    name: str
    version: int
    index: int
    stored: torch.Tensor  # contiguous, on the CPU, in the stored dtype
    before: BlockHashes | None
    after: BlockHashes


def stored_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`data` as a rank stores it: cast to `dtype`, contiguous, on the CPU (itself when it already is)."""
    return data.detach().to(device="cpu", dtype=dtype).contiguous()


def hash_all(stored: Mapping[K, torch.Tensor]) -> dict[K, BlockHashes]:
    """The block hashes of every tensor of `stored`, in parallel on the hashing pool (xxhash releases the GIL)."""
    return start_hash_all(stored)()


def start_hash_all(stored: Mapping[K, torch.Tensor]) -> Callable[[], dict[K, BlockHashes]]:
    """Start hashing every tensor of `stored` on the hashing pool; returns what waits for the block hashes (the
    caller may do other work meanwhile)."""
    pool = hashing_pool()
    futures = {key: pool.submit(block_hashes, tensor) for key, tensor in stored.items()}
    return lambda: {key: future.result() for key, future in futures.items()}


def write_changed(session: Session, shards: Sequence[ChangedShard]) -> int:
    """Send the changed blocks of every shard, each shard's in one WriteBytes where it goes through memory (in
    requests of a few MiB each where it travels inline: Session.write_bytes), all shards at once; the bytes sent
    (counted in `delta_bytes`)."""
    jobs = []
    for shard in shards:
        nbytes = shard.stored.numel() * shard.stored.element_size()
        step = block_bytes(tuple(shard.stored.shape), shard.stored.element_size())
        ranges = changed_ranges(shard.before, shard.after, step=step, nbytes=nbytes)
        if ranges:
            jobs.append(partial(_write_bytes, session, shard, ranges))
    sent = sum(session.run_all(jobs))
    counters.count("delta_puts")
    counters.count("delta_bytes", sent)
    return sent


def _write_bytes(session: Session, shard: ChangedShard, ranges: list[tuple[int, int]]) -> int:
    flat = shard.stored.reshape(-1).view(torch.uint8)
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
