"""Every channel, the client's and a server's to its peers, tries to connect again within about a second of a
failed try, however long the peer has been down: a rank restarted after a long outage is read from as soon as
it listens, not at the end of gRPC's own backoff (1 s, then x1.6 each try, up to 2 minutes).

The peer's port is held by a listener that accepts each connection and closes it at once: every accepted
connection is one try of the channel, so the gaps between them are its backoff. A try is still given gRPC's own
20 s to finish connecting: a peer that accepts but answers its handshake late (a loaded host) is reached.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from shardserve.client.channel import Channel, Credentials
from shardserve.server.common.auth import make_channel

WATCH_S = 5.0  # gRPC's default backoff makes its third gap 2.0-3.1 s by then
CALL_EVERY_S = 0.05
MAX_GAP_S = 1.8  # the bounded backoff's longest gap is 1.2 s (1 s and 20% jitter), plus a busy machine's delay


class Listener:
    """A TCP listener on a free port, handing every connection it accepts to `on_connection` on its own thread."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._socket.settimeout(0.1)
        self.address = f"127.0.0.1:{self._socket.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def on_connection(self, connection: socket.socket) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            self.on_connection(connection)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()


class RefusingPeer(Listener):
    """Closes every connection it accepts, noting when each came."""

    def __init__(self) -> None:
        self.tries: list[float] = []
        super().__init__()

    def on_connection(self, connection: socket.socket) -> None:
        self.tries.append(time.monotonic())
        connection.close()


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


HANDSHAKE_DELAY_S = 1.5  # longer than the longest backoff between tries (1 s and its jitter)


class SlowPeer(Listener):
    """A gRPC server answering /shardserve.Test/Ping behind a listener that holds every connection
    HANDSHAKE_DELAY_S before relaying it, as a loaded host answers a new connection late."""

    def __init__(self) -> None:
        handler = grpc.method_handlers_generic_handler(
            "shardserve.Test", {"Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
        self._upstream = ("127.0.0.1", self._server.add_insecure_port("127.0.0.1:0"))
        self._server.start()
        super().__init__()

    def on_connection(self, connection: socket.socket) -> None:
        threading.Thread(target=self._relay, args=(connection,), daemon=True).start()

    def _relay(self, connection: socket.socket) -> None:
        if self._stop.wait(HANDSHAKE_DELAY_S):
            connection.close()
            return
        upstream = socket.create_connection(self._upstream)
        for source, sink in ((connection, upstream), (upstream, connection)):
            threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        super().close()
        self._server.stop(None)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        sink.close()


@pytest.mark.parametrize("make", CHANNELS.values(), ids=CHANNELS.keys())
def test_a_channel_waits_for_a_late_handshake(make: Callable[[str], grpc.Channel]) -> None:
    slow = SlowPeer()
    try:
        call = make(slow.address).unary_unary("/shardserve.Test/Ping")
        assert call(b"ping", timeout=10.0) == b"ping"
    finally:
        slow.close()
