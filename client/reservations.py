"""Snapshots a commit reserved for this client's next put of a prefix (CommitSnapshotRequest.reserve_next).

A writer that puts the same layouts every step fills the reserved snapshot and commits it with no
CreateSnapshot. A reservation serves only a put that would have created the same layouts: its `basis` is
what decided them (this process's report of its pieces, its job, the put's options), compared with ==.
The process that commits a reservation (job rank 0) owns it and aborts it when it is not used (client close
included); the other ranks of an SPMD job keep what it is for, with no snapshot: the next put sends them rank
0's (one broadcast, which the commit's answer no longer carries).

With reserve_next="later" (and for every delta put) the coordinator reserves after the commit answered
(CommitSnapshotRequest.reserve_later): the process that committed takes the reservation on a thread of its own
(TakeReservedSnapshot) while it goes on, and its next put waits for it only if it is not there yet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardserve.client import arguments
from shardserve.client.kept import KeptForNextPut
from shardserve.core.snapshots import JobTensor
from shardserve.protos import shardserve_pb2 as pb

LATER = "later"  # put_state_dict(..., reserve_next=LATER): reserve after the commit answered


def reserve_mode(value: Any) -> tuple[bool, bool]:
    """(whether the commit reserves the next snapshot, whether after it answered) of put_state_dict's
    reserve_next: True, False or "later"; INVALID_ARGUMENT for any other value."""
    mode = arguments.flag_or_word(value, "reserve_next", LATER)
    return mode is not False, mode == LATER


@dataclass(frozen=True)
class Reservation:
    """The next snapshot of a prefix, pending on the coordinator, and what its layouts were made from."""

    basis: Any
    snapshot: pb.SnapshotInfo | None  # None on the ranks of a job but rank 0 (it sends its own)
    tensors: Mapping[
        str, JobTensor
    ]  # the job's tensors its layouts were made for (who writes which box)
    owned: bool  # this process commits it, and aborts it when it goes unused


class Reservations:
    """This client's reservations, one per prefix; a put takes its prefix's (so two puts never share one)."""

    def __init__(self) -> None:
        self._kept: KeptForNextPut[Reservation] = KeptForNextPut("shardserve-reserve")

    def take(self, prefix: str) -> Reservation | None:
        """The prefix's reservation, no longer kept here (waiting for one still being made)."""
        return self._kept.take(prefix)

    def keep(self, prefix: str, reservation: Reservation) -> Reservation | None:
        """Keep `reservation` for the prefix's next put; returns the one it replaces (to abort), if any."""
        return self._kept.keep(prefix, reservation)

    def keep_later(
        self,
        prefix: str,
        basis: Any,
        tensors: Mapping[str, JobTensor],
        take: Callable[[], pb.SnapshotInfo | None],
    ) -> Reservation | None:
        """Keep the reservation `take()` answers (run on this client's reservation thread now; None: none was
        made), owned by this process, for the prefix's next put; returns the one it replaces (to abort), if
        any."""

        def taken() -> Reservation | None:
            snapshot = take()
            return None if snapshot is None else Reservation(basis, snapshot, tensors, owned=True)

        return self._kept.keep_later(prefix, taken)

    def release_all(self, abort: Callable[[str, int], None]) -> None:
        """Forget every reservation, `abort(prefix, number)` of each one owned here (once taken, for those still
        being made), and stop the reservation thread."""

        def release(prefix: str, reservation: Reservation) -> None:
            if reservation.owned and reservation.snapshot is not None:
                abort(prefix, reservation.snapshot.number)

        self._kept.release_all(release)
