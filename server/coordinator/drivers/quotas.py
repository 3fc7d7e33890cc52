"""Per-principal byte quotas: what the tensors a principal made may hold, over all ranks, at once.

A principal's `max_bytes` (tokens file) bounds the bytes of the tensors whose
owner it is (TensorRecord.owner: the principal whose CreateTensor or
LoadCheckpoint made them), every shard counted, replicas each, pending
versions included. A put, create or load that would go over it is refused
with RESOURCE_EXHAUSTED naming the quota, before anything is allocated. A new
version of a name replaces the old one, so a tensor being overwritten or
updated is counted once, at its new size. Checks and catalog records are made
under one lock, so concurrent puts of one principal cannot pass together.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from shardserve.server.common.errors import QuotaExceeded
from shardserve.server.common.principals import Principal
from shardserve.server.coordinator.catalog.interface import Catalog


class ByteQuotas:
    """Checks principals' max_bytes against the catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._lock = threading.Lock()

    def held_by(self, owner: str, excluding: frozenset[str] = frozenset()) -> int:
        """Bytes of every version (pending ones too) that `owner` owns, of tensors not named in `excluding`."""
        return sum(
            record.held_bytes
            for record in self.catalog.list(include_pending=True)
            if record.owner == owner and record.name not in excluding
        )

    @contextmanager
    def admit(self, principal: Principal | None, adding: Mapping[str, int]) -> Iterator[None]:
        """Hold the quota lock while the new versions `adding` ({name: bytes}) are recorded; RESOURCE_EXHAUSTED
        first when they would take `principal` over its max_bytes."""
        with self._lock:
            if principal is not None and principal.max_bytes is not None:
                held = self.held_by(principal.name, frozenset(adding))
                wanted = sum(adding.values())
                if held + wanted > principal.max_bytes:
                    raise QuotaExceeded(
                        f"principal {principal.name!r} would hold {held + wanted} bytes, over its quota max_bytes = "
                        f"{principal.max_bytes} (it holds {held} in other tensors; these need {wanted}): delete "
                        f"some of its tensors or raise max_bytes in the tokens file",
                        metadata={"principal": principal.name},
                    )
            yield
