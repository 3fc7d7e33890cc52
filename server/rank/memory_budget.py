"""A rank's memory budget: the bytes of shards it holds against its limit and its device's capacity.

`MemoryBudget` does the accounting (reserve, release, room); the default limit is the rank's share of the
memory this process may use (the host's, or its cgroup's when smaller: server/common/memory_limits.py), less
room for the coordinator, the processes themselves and clients' staging, so that ranks sharing a host or a
container refuse allocations (RESOURCE_EXHAUSTED) instead of each admitting more than there is and being
OOM-killed together.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from shardserve.server.common.memory_limits import host_memory
from shardserve.server.rank.errors import MemoryLimit

# Of the memory left after the reserve, split evenly among the ranks on the host (or in the container).
HOST_MEMORY_FRACTION = 0.8
# Kept out of the ranks' shares, at most: the coordinator, the rank processes themselves (torch, gRPC) and
# the staging of clients on the same host; a quarter of the memory where that is less than 4 GiB.
RESERVED_BYTES = 1 << 30


def reserved_bytes(memory: int) -> int:
    """The bytes of `memory` no rank's default limit counts on."""
    return min(RESERVED_BYTES, memory // 4)


def ranks_on_host(env: Mapping[str, str]) -> int:
    """How many ranks share this host: torchrun's (and `shardserve up`'s) LOCAL_WORLD_SIZE, else 1."""
    value = env.get("LOCAL_WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a whole number >= 1, got {value!r}")
    return int(value)


def default_memory_limit(
    device: str, memory_bytes: int, ranks: int, fraction: float = HOST_MEMORY_FRACTION
) -> int:
    """Bytes of shards a rank may hold when --memory-limit is not given (0 = unlimited).

    CPU ranks get `fraction` of `memory_bytes` (what the process may use: host or cgroup) less the reserve,
    divided by the ranks on the host; CUDA ranks are unlimited here, since a full GPU fails the allocation
    itself instead of killing the process."""
    if not device.startswith("cpu"):
        return 0
    usable = memory_bytes - reserved_bytes(memory_bytes)
    return max(1, int(usable * fraction) // max(1, ranks))


def device_capacity(device: torch.device) -> int:
    """Total memory of the device (physical RAM for cpu): no allocation may exceed it, limit or not."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return host_memory().nbytes


class MemoryBudget:
    """The bytes of shards one rank holds, against its limit (0 = none) and its device's capacity.

    Thread-safe on its own: a reservation checks and takes its room in one step."""

    def __init__(self, limit: int, capacity: int, *, rank: int = 0, device: str = "cpu") -> None:
        if limit < 0:
            raise ValueError(f"memory_limit must be >= 0 (0 = unlimited), got {limit}")
        self.limit = limit
        self.capacity = capacity
        self.rank = rank
        self.device = device
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def room(self, nbytes: int) -> int:
        """Bytes left under the limit and the capacity once `nbytes` more are held (negative: over by that)."""
        room = self.capacity - self._used - nbytes
        if self.limit:
            room = min(room, self.limit - self._used - nbytes)
        return room

    def reserve(self, nbytes: int) -> None:
        """Hold `nbytes` more, or MemoryLimit naming the limit (or the device's capacity) that has no room."""
        with self._lock:
            if self.limit and self._used + nbytes > self.limit:
                raise MemoryLimit(
                    f"rank {self.rank} memory limit: {nbytes} bytes requested, "
                    f"{self.limit - self._used} of {self.limit} free",
                    metadata={"rank": self.rank},
                )
            if self._used + nbytes > self.capacity:
                raise MemoryLimit(
                    f"rank {self.rank} memory: {nbytes} bytes requested, more than the "
                    f"{self.capacity - self._used} bytes left of {self.device}'s {self.capacity}",
                    metadata={"rank": self.rank},
                )
            self._used += nbytes

    def add(self, nbytes: int) -> None:
        """Hold `nbytes` more whatever the limit: memory already taken (blocks an update copied)."""
        with self._lock:
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` held."""
        with self._lock:
            self._used -= nbytes
