"""The connections a client keeps open to ranks' bulk ports between calls (client.paths.bulk)."""

from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

IDLE_KEPT = 8  # idle connections kept per rank
IDLE_KEEP_S = 60.0  # an idle connection older than this is closed rather than reused (the rank's limit: 300 s)


class Connection:
    """One open connection to a rank's bulk port."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.kept = False  # taken from the idle ones (the rank may have closed it meanwhile)
        self.idle_since = time.monotonic()


class IdleConnections:
    """The open connections a client keeps between calls, by rank address: at most IDLE_KEPT per rank, none
    kept past IDLE_KEEP_S unused. `clock`: what idleness is timed by (tests pass a fake one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._idle: dict[str, deque[Connection]] = defaultdict(deque)
        self._lock = threading.Lock()
        self._closed = False

    def take(self, address: str) -> Connection | None:
        """The newest kept connection to `address` (the least likely to have been closed by the rank), marked
        kept; the expired ones are closed first, oldest first. None when none is kept."""
        with self._lock:
            connections = self._idle[address]
            while connections and self._clock() - connections[0].idle_since >= IDLE_KEEP_S:
                connections.popleft().sock.close()
            if not connections:
                return None
            connection = connections.pop()
            connection.kept = True
            return connection

    def give_back(self, address: str, connection: Connection) -> None:
        """Keep `connection` for the next call to `address`, or close it (IDLE_KEPT reached, or closed)."""
        connection.idle_since = self._clock()
        with self._lock:
            if not self._closed and len(self._idle[address]) < IDLE_KEPT:
                self._idle[address].append(connection)
                return
        connection.sock.close()

    def kept(self, address: str | None = None) -> list[Connection]:
        """The connections kept now (to `address`, or to every rank), oldest first."""
        with self._lock:
            return [
                connection
                for where, connections in self._idle.items()
                if address is None or where == address
                for connection in connections
            ]

    def close(self) -> None:
        """Close every kept connection; those given back later are closed at once."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, defaultdict(deque)
        for connections in idle.values():
            for connection in connections:
                connection.sock.close()
