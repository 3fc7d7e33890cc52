"""Every channel, the client's and a server's to its peers, tries to connect again within about a second of a
failed try, however long the peer has been down: a rank restarted after a long outage is read from as soon as
it listens, not at the end of gRPC's own backoff (1 s, then x1.6 each try, up to 2 minutes).

The peer's port is held by a listener that accepts each connection and closes it at once: every accepted
connection is one try of the channel, so the gaps between them are its backoff.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from shardserve.client.channel import Channel, Credentials
from shardserve.server.common.auth import make_channel

WATCH_S = 5.0  # gRPC's default backoff makes its third gap 2.0-3.1 s by then
CALL_EVERY_S = 0.05
MAX_GAP_S = 1.8  # the bounded backoff's longest gap is 1.2 s (1 s and 20% jitter), plus a busy machine's delay


class RefusingPeer:
    """A TCP listener on a free port that closes every connection it accepts, noting when each came."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._socket.settimeout(0.1)
        self.address = f"127.0.0.1:{self._socket.getsockname()[1]}"
        self.tries: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            self.tries.append(time.monotonic())
            connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()


@pytest.fixture
def peer() -> Iterator[RefusingPeer]:
    refusing = RefusingPeer()
    yield refusing
    refusing.close()


def _client_channel(address: str) -> grpc.Channel:
    return Channel(Credentials(), timeout=1.0).channel(address)


CHANNELS: dict[str, Callable[[str], grpc.Channel]] = {
    "client": _client_channel,
    "server peer": make_channel,
}


@pytest.mark.parametrize("make", CHANNELS.values(), ids=CHANNELS.keys())
def test_a_channel_tries_again_within_about_a_second_however_long_its_peer_was_down(
    peer: RefusingPeer, make: Callable[[str], grpc.Channel]
) -> None:
    call = make(peer.address).unary_unary("/shardserve.Test/Ping")
    start = time.monotonic()
    while time.monotonic() - start < WATCH_S:  # calls fail at once while the channel backs off
        with pytest.raises(grpc.RpcError) as failed:
            call(b"", timeout=1.0)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        time.sleep(CALL_EVERY_S)
    tries = list(peer.tries)
    gaps = [later - earlier for earlier, later in zip(tries, tries[1:])]
    assert len(tries) >= 5, tries
    assert max(gaps) < MAX_GAP_S, gaps
