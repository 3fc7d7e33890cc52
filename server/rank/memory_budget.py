"""A rank's default memory limit: its share of the host's memory, so that ranks sharing a host refuse
allocations (RESOURCE_EXHAUSTED) instead of each admitting the whole host's RAM and being OOM-killed together."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HOST_MEMORY_FRACTION = (
    0.8  # of the host's (or cgroup's) memory, split evenly among the ranks on the host
)
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup v2 limit of this process's group when that is smaller."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


def ranks_on_host(env: Mapping[str, str]) -> int:
    """How many ranks share this host: torchrun's (and `shardserve up`'s) LOCAL_WORLD_SIZE, else 1."""
    value = env.get("LOCAL_WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a whole number >= 1, got {value!r}")
    return int(value)


def default_memory_limit(
    device: str, host_bytes: int, ranks: int, fraction: float = HOST_MEMORY_FRACTION
) -> int:
    """Bytes of shards a rank may hold when --memory-limit is not given (0 = unlimited).

    CPU ranks get `fraction` of the host's memory divided by the ranks on the host; CUDA ranks are unlimited
    here, since a full GPU fails the allocation itself instead of killing the process."""
    if not device.startswith("cpu"):
        return 0
    return max(1, int(host_bytes * fraction) // max(1, ranks))
