"""Which way a lookup whose ids live on a device goes, decided from where the table's shards are and what the
path of each shard's rank declares it maps (client.paths.kinds.Capabilities).

- CUDA_MAPPED: CUDA ids over a table whose every shard is a CUDA shard that the rank's first path maps on
  this host (CUDA IPC, a capability of the same-host path): rows gathered and bags pooled on the GPU against
  the mapped shards (client.embedding.cuda_rows), nothing through host memory.
- HOST_MAPPED: every shard a CPU shard that the rank's first path maps (shared memory): rows gathered on the
  CPU from the mapped rows (into pinned memory when the ids are on a GPU) and only the result copied to the
  ids' device.
- GENERAL: anything else; the lookup goes as a CPU lookup does (client.embedding.lookup) and its result is
  copied to the ids' device.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class Route(str, enum.Enum):
    """The way a lookup goes (module docstring)."""

    CUDA_MAPPED = "cuda-mapped"
    HOST_MAPPED = "host-mapped"
    GENERAL = "general"

    def __str__(self) -> str:
        return self.value


def choose_route(ids_device: str, shards: Sequence[tuple[str, frozenset[str]]]) -> Route:
    """The route of a lookup whose ids are on a device of type `ids_device` ("cpu", "cuda"), over a table whose
    routed shards are `shards`: for each, (the type of its device, the device types its rank's first path maps
    now: client.paths.policy.PathPolicy.mapped_devices)."""
    if not shards:
        return Route.GENERAL
    if ids_device == "cuda" and all(on == "cuda" and on in mapped for on, mapped in shards):
        return Route.CUDA_MAPPED
    if all(on == "cpu" and on in mapped for on, mapped in shards):
        return Route.HOST_MAPPED
    return Route.GENERAL
