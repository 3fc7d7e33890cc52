"""RowCache: a client-side LRU cache of embedding rows keyed by (table, version, row), bounded in bytes.

Keys carry the version, so a row of an old version is never answered for a
new one; when a lookup sees a newer version of a table, the rows of the older
versions are dropped at once (`invalidate_older`). Thread-safe: lookups from
several threads share one cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shardserve.client import counters


@dataclass(frozen=True)
class CacheStats:
    """Counters of one cache: hits and misses (per row), rows held, bytes held and the byte bound."""

    hits: int
    misses: int
    rows: int
    bytes: int
    capacity_bytes: int


class RowCache:
    """LRU of rows of 2-D tables; `capacity_bytes` bounds the bytes of the rows held."""

    def __init__(self, capacity_bytes: int) -> None:
        if (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes < 0
        ):
            raise ValueError(f"row_cache_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._rows: OrderedDict[tuple[str, int, int], torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits, self._misses, len(self._rows), self._bytes, self.capacity_bytes
            )

    def get_many(self, name: str, version: int, ids: list[int]) -> dict[int, torch.Tensor]:
        """The cached rows among `ids` (each a 1-D tensor), marked recently used; counts hits and misses."""
        found = {}
        with self._lock:
            for row in ids:
                key = (name, version, row)
                value = self._rows.get(key)
                if value is not None:
                    self._rows.move_to_end(key)
                    found[row] = value
            self._hits += len(found)
            self._misses += len(ids) - len(found)
        counters.count("row_cache_hits", len(found))
        counters.count("row_cache_misses", len(ids) - len(found))
        return found

    def put_many(self, name: str, version: int, ids: list[int], rows: torch.Tensor) -> None:
        """Cache rows[i] as row ids[i]; evicts the least recently used rows past the byte bound."""
        if not ids:
            return
        row_bytes = rows.shape[1] * rows.element_size() if rows.dim() == 2 else 0
        if row_bytes == 0 or row_bytes > self.capacity_bytes:
            return
        with self._lock:
            for i, row in enumerate(ids):
                key = (name, version, row)
                if key in self._rows:
                    self._rows.move_to_end(key)
                    continue
                self._rows[key] = rows[i].clone()
                self._bytes += row_bytes
            while self._bytes > self.capacity_bytes:
                _, evicted = self._rows.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()

    def invalidate_older(self, name: str, version: int) -> int:
        """Drop every row of `name` cached at a version other than `version`; returns how many."""
        with self._lock:
            stale = [k for k in self._rows if k[0] == name and k[1] != version]
            for key in stale:
                evicted = self._rows.pop(key)
                self._bytes -= evicted.numel() * evicted.element_size()
        return len(stale)

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._bytes = 0
