"""Versions of a tensor reserved for this client's next put of it (CreateTensorRequest.reserve).

A writer that puts one tensor every step (weights republished with `put(name, tensor, overwrite=True)`) paid a
CreateTensor on each put's path: a call to the coordinator and, from it, an allocation on every rank holding a
shard. From the second put of a name with the same layout and options on, the client creates the next version
right after the put returned, on a thread of its own, while the caller goes on; the next put fills that
reserved version and commits it. A reservation serves only a put that would have created the same version:
its `basis` (layout and options) is compared with ==.

The coordinator drops a reservation whenever anything else creates a version of the name (another writer's
put, a row update, a delta put), at its pending timeout and at a restart; a put whose reservation is gone is
made anew (what it copied in place landed in memory the ranks no longer use: they give a dropped pending
version's handed-out memory back to the system). The reservation's memory is held on the ranks until the next
put, the client's close, or the pending timeout.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from shardserve.client.kept import KeptForNextPut
from shardserve.protos import shardserve_pb2 as pb

REMEMBERED_NAMES = 4096
"""Names whose last put's basis is remembered (the newest): a name put again with the same basis is reserved."""


class Reserved(NamedTuple):
    """A pending version of a tensor made for this client's next put, and what it was made from."""

    basis: Any
    info: pb.TensorInfo


class TensorReservations:
    """This client's reservations, one per tensor name; a put takes its name's (two puts never share one)."""

    def __init__(self, remembered: int = REMEMBERED_NAMES) -> None:
        self._kept: KeptForNextPut[Reserved] = KeptForNextPut("shardserve-reserve-tensor")
        # each name's last put's basis, newest last
        self._last: OrderedDict[str, Any] = OrderedDict()
        self._remembered = remembered
        self._lock = threading.Lock()

    def take(self, name: str) -> Reserved | None:
        """The name's reservation, no longer kept here (waiting for one still being made); None if none."""
        return self._kept.take(name)

    def repeats(self, name: str, basis: Any) -> bool:
        """Note a put of `name` made from `basis`: whether the name's last put noted had the same one."""
        with self._lock:
            last = self._last.pop(name, None)
            self._last[name] = basis
            while len(self._last) > self._remembered:
                self._last.popitem(last=False)
        return last is not None and last == basis

    def keep_later(
        self, name: str, basis: Any, make: Callable[[], pb.TensorInfo | None]
    ) -> Reserved | None:
        """Keep the version `make()` answers (run on this client's reservation thread now; None: none was made)
        for the name's next put; returns the reservation it replaces (for the caller to abort), if any."""

        def made() -> Reserved | None:
            info = make()
            return None if info is None else Reserved(basis, info)

        return self._kept.keep_later(name, made)

    def release_all(self, abort: Callable[[str, int], None]) -> None:
        """Forget every reservation, `abort(name, version)` of each (once made, for those still being made), and
        stop the reservation thread."""
        self._kept.release_all(lambda name, reserved: abort(name, reserved.info.version))
