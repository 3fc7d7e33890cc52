"""Snapshots a commit reserved for this client's next put of a prefix (CommitSnapshotRequest.reserve_next).

A writer that puts the same layouts every step fills the reserved snapshot and commits it with no
CreateSnapshot. A reservation serves only a put that would have created the same layouts: its `basis` is
what decided them (this process's report of its pieces, its job, the put's options), compared with ==.
The process that commits a reservation owns it and aborts it when it is not used (client close included);
the other ranks of an SPMD job hold a copy to find their shards in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardserve.core.snapshots import JobTensor
from shardserve.protos import shardserve_pb2 as pb


@dataclass(frozen=True)
class Reservation:
    """The next snapshot of a prefix, pending on the coordinator, and what its layouts were made from."""

    basis: Any
    snapshot: pb.SnapshotInfo
    tensors: Mapping[
        str, JobTensor
    ]  # the job's tensors its layouts were made for (who writes which box)
    owned: bool  # this process commits it, and aborts it when it goes unused


class Reservations:
    """This client's reservations, one per prefix; a put takes its prefix's (so two puts never share one)."""

    def __init__(self) -> None:
        self._by_prefix: dict[str, Reservation] = {}
        self._lock = threading.Lock()

    def take(self, prefix: str) -> Reservation | None:
        """The prefix's reservation, no longer kept here."""
        with self._lock:
            return self._by_prefix.pop(prefix, None)

    def keep(self, prefix: str, reservation: Reservation) -> Reservation | None:
        """Keep `reservation` for the prefix's next put; returns the one it replaces (to abort), if any."""
        with self._lock:
            replaced = self._by_prefix.get(prefix)
            self._by_prefix[prefix] = reservation
            return replaced

    def release_all(self, abort: Callable[[str, int], None]) -> None:
        """Forget every reservation, `abort(prefix, number)` of each one owned here."""
        with self._lock:
            held, self._by_prefix = list(self._by_prefix.items()), {}
        for prefix, reservation in held:
            if reservation.owned:
                abort(prefix, reservation.snapshot.number)
