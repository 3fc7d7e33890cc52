"""Ports for processes started on this host: free now, and out of the way of the ports the kernel hands out.

A port found free is bound later, by a process that may take seconds to start (importing torch); meanwhile the
kernel may give the same port to anyone who asks for "any port": an outgoing connection's source port, or a
server bound to port 0 (gRPC's, torch's TCPStore). Both come from the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), so a port picked below it, at random, meets
only another picker's choice. Where the range cannot be read the kernel picks (port 0), as before.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below: well-known and registered services' ports
TRIES = 50


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of `host` that was free a moment ago, below the kernel's ephemeral range where there is room."""
    low = _ephemeral_low()
    if low is not None and low - LOWEST_PORT >= TRIES:
        chooser = random.SystemRandom()
        for _ in range(TRIES):
            port = chooser.randrange(LOWEST_PORT, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int | None:
    """The lowest port of the kernel's ephemeral range, or None where it cannot be read."""
    try:
        return int(PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
