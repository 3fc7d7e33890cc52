"""The coordinator's rendezvous store and epoch counter for collective jobs.

The coordinator owns a torch.distributed TCPStore (is_master=True) on its own
host, listening on the coordinator's --listen host only (TCPStore alone would
listen on every interface, whatever host it is given; a socket bound here is
handed to it instead); ranks learn its port in their RegisterRank answer and form each job's
process group over it (a PrefixStore per (epoch, participants), see
shardcore/epochs.py and server/rank/jobs/groups.py). Epochs come from the
catalog's growing counter, so they only grow, also across coordinator restarts.
A failed job ends its epoch, and so does a rank (re)registering: a new rank
process holds none of the groups its peers may have cached.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)


class RendezvousStore:
    """A TCPStore this process hosts; `port` is the port it listens on, on `host` ("0.0.0.0" or "::": every
    interface)."""

    def __init__(self, port: int = 0, host: str = "0.0.0.0", timeout_s: float = 300.0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"store port must be 0..65535, got {port}")
        host = host.strip("[]")
        listener = _listen(host, port)
        bound = listener.getsockname()[1]
        self.store: dist.TCPStore | None = dist.TCPStore(
            host,
            bound,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=listener.detach(),
        )  # the store owns the socket from here
        self.port = self.store.port
        log.info("rendezvous store listening on %s port %d", host, self.port)

    def close(self) -> None:
        """Stop listening (the server ends with its last master handle, this one)."""
        self.store = None


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host` (every interface, IPv4 and IPv6 where the host has both, for 0.0.0.0/::)."""
    if host in ("0.0.0.0", "::") and socket.has_dualstack_ipv6():
        return socket.create_server(
            ("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=4096
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=4096)


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
                log.info(
                    "epoch %d ended (%s); collective jobs now run in epoch %d",
                    epoch,
                    why,
                    self._current,
                )
            return self._current
