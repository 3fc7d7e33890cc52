"""The coordinators a client or rank may call, and which of them it calls now.

Several coordinators may share one catalog; one leads, the others answer NOT_LEADER naming it. A client or
rank is given them all ("A,B") and calls one at a time: the one it calls now, until an answer names another
leader (`follow`) or it cannot reach it (`next`). The leader an answer names need not be in the list (a
coordinator known by another name): it is called all the same.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


def parse_addresses(text: str | Sequence[str], field: str = "coordinator") -> tuple[str, ...]:
    """The HOST:PORT addresses of "A,B" (or a sequence of them), in order, repeats left out; ValueError naming
    `field` when one is not HOST:PORT or none is given."""
    if isinstance(text, str):
        words = text.split(",")
    elif isinstance(text, (list, tuple)):
        words = list(text)
    else:
        raise TypeError(
            f"{field} must be a 'HOST:PORT[,HOST:PORT...]' string, got {type(text).__name__}"
        )
    addresses: list[str] = []
    for word in words:
        if not isinstance(word, str):
            raise TypeError(f"{field} must be 'HOST:PORT' strings, got {type(word).__name__}")
        address = word.strip()
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{field} {address!r} is not of the form HOST:PORT")
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ValueError(f"{field} names no coordinator (expected HOST:PORT[,HOST:PORT...])")
    return tuple(addresses)


class CoordinatorAddresses:
    """The coordinators' addresses (the first is called first) and the one called now; thread-safe."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("at least one coordinator address is needed")
        self.addresses = tuple(addresses)
        self._current = self.addresses[0]
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        """The address called now: the leader as last known, else the next one to try."""
        return self._current

    @property
    def several(self) -> bool:
        """Whether there is more than one coordinator to try."""
        return len(self.addresses) > 1

    def follow(self, leader: str, *, after: str) -> str:
        """The leader `leader` an answer from `after` named becomes the one called (unless another call moved on
        from `after` already); returns the one called now."""
        with self._lock:
            if leader and self._current == after:
                self._current = leader
            return self._current

    def next(self, *, after: str) -> str:
        """`after` could not be reached or knows no leader: call the address listed after it (the first one
        after the last; the first for a leader not in the list), unless another call moved on already."""
        with self._lock:
            if self._current == after:
                if after in self.addresses:
                    index = self.addresses.index(after)
                    self._current = self.addresses[(index + 1) % len(self.addresses)]
                else:
                    self._current = self.addresses[0]
            return self._current

    def after_failure(self, address: str, *, leader: str | None, unreachable: bool) -> str | None:
        """Where to call after a call to `address` failed: `leader` is the leader its NOT_LEADER answer named
        ("" when it knows none; None when the answer was not NOT_LEADER), `unreachable` whether it could not be
        reached (or did not answer in time). The named leader; the next address when none is named or
        `address` is unreachable and there are others; None when the failure is the coordinator's answer, or
        when the one given cannot be reached (a named leader that cannot be reached leaves the address given
        to be called next)."""
        if leader:
            return (
                self.follow(leader, after=address)
                if leader != address
                else self.next(after=address)
            )
        if leader is not None or (unreachable and self.several):
            return self.next(after=address)
        if (
            unreachable and address not in self.addresses
        ):  # a leader named, gone: back to the one given
            self.next(after=address)
        return None
