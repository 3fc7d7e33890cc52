"""A CUDA shard of a same-host rank mapped through its IPC handle, as row readers use it (client.paths.shm
opens and caches it; client.embedding.cuda_rows gathers from it)."""

from __future__ import annotations

import torch

from shardserve.client.paths import segments


class DeviceMapping:
    """A CUDA shard mapped through its IPC handle (`tensor`, of the shard's dtype and sizes on its device) and
    the questions a reader asks of it: before a read (`serves`, `held`) and once the read has run (`readable`:
    the caller synchronizes its stream first, the gather being asynchronous)."""

    def __init__(self, mapping: segments.SegmentMapping, tensor: torch.Tensor) -> None:
        self._mapping = mapping
        self.tensor = tensor

    def serves(self) -> bool:
        """Whether the rank still serves this version (not replaced, not recycled)."""
        return self._mapping.serves()

    def readable(self) -> bool:
        """Whether the memory still holds this version (maybe replaced, in its grace)."""
        return self._mapping.readable()

    def held(self) -> bool:
        """Whether the rank process that serves it is still alive."""
        return segments.still_held(self._mapping)
