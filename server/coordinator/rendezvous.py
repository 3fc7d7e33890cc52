"""The coordinator's rendezvous store and epoch counter for collective jobs.

The coordinator owns a torch.distributed TCPStore (is_master=True) on its own
host; ranks learn its port in their RegisterRank answer and form each job's
process group over it (a PrefixStore per (epoch, participants), see
shardcore/epochs.py and server/rank/jobs/groups.py). Epochs come from the
catalog's growing counter, so they only grow, also across coordinator restarts.
A failed job ends its epoch, and so does a rank (re)registering: a new rank
process holds none of the groups its peers may have cached.
"""
from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)


class RendezvousStore:
    """A TCPStore this process hosts; `port` is the port it listens on (all interfaces)."""

    def __init__(self, port: int = 0, host: str = "0.0.0.0", timeout_s: float = 300.0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"store port must be 0..65535, got {port}")
        self.store: dist.TCPStore | None = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        self.port = self.store.port
        log.info("rendezvous store listening on port %d", self.port)

    def close(self) -> None:
        """Stop listening (the server ends with its last master handle, this one)."""
        self.store = None


class Epochs:
    """The current epoch of collective jobs; `end(epoch)` starts the next one unless it already began."""

    def __init__(self, next_number: Callable[[], int]) -> None:
        self._next_number = next_number
        self._lock = threading.Lock()
        self._current = next_number()

    @property
    def current(self) -> int:
        with self._lock:
            return self._current

    def end(self, epoch: int, why: str) -> int:
        """End `epoch` if it is still the current one; return the current epoch after that."""
        with self._lock:
            if epoch == self._current:
                self._current = self._next_number()
                log.info("epoch %d ended (%s); collective jobs now run in epoch %d", epoch, why, self._current)
            return self._current
