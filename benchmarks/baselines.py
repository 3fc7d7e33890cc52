"""Baselines for fetching bytes across processes: a raw TCP socket, torch.distributed.rpc, and memcpy.

Each remote baseline runs its server in a process of its own (forked from the preloaded forkserver) holding
`source_tensor(rows, cols)` (the same values the shardserve scenario serves),
and its client here, in the caller's process (rpc's excepted):

- `SocketServer`: the server `sendall`s the first N bytes of the tensor's
  memoryview; `SocketServer.fetch(out)` `recv_into`s a preallocated tensor.
- `RpcFetchBaseline`: torch.distributed.rpc (TensorPipe, 127.0.0.1) with the
  tensor held behind an RRef on the server, fetched as a slice the way torch's
  ShardedTensor.remote_shards users did: `rpc_sync(owner, slice of rref)`. Its
  client is a process of its own too, alive only while it is timed: TensorPipe's
  same-host transport keeps a core busy in every process of the rpc world.
- `memcpy`: `out.copy_(src)` of the same bytes in this process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from shardserve.server.rank_start import forkserver_context

REQUEST = struct.Struct("<q")  # bytes wanted; 0 ends the session
START_TIMEOUT_S = 120.0
IO_TIMEOUT_S = 120.0
SERVER_NAME = "server"
CLIENT_NAME = "client"


def source_tensor(rows: int, cols: int) -> torch.Tensor:
    """The benchmark tensor: float32 arange, cheap to make and the same in every process."""
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a C-contiguous CPU tensor as a writable memoryview (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("tensor must be C-contiguous")
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


def memcpy(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The in-process baseline: copy the same bytes."""
    return out.copy_(src)


def loopback_env() -> None:
    """Keep gloo and TensorPipe on the loopback interface."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["TP_SOCKET_IFNAME"] = "lo"


def _exit_with_parent() -> None:
    """In a server process: end it when the process it was forked from is gone (the forkserver, which ends
    with the benchmark, even a SIGKILLed one)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# ---------------------------------------------------------------- raw TCP socket


def _socket_server_main(rows: int, cols: int, ready: mp.connection.Connection) -> None:
    """Serve `source_tensor(rows, cols)`'s leading bytes to one client until it asks for 0 bytes."""
    _exit_with_parent()
    view = byte_view(source_tensor(rows, cols))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(START_TIMEOUT_S)
        ready.send(listener.getsockname()[1])
        conn, _ = listener.accept()
    with conn:
        conn.settimeout(IO_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            header = _recv_exactly(conn, REQUEST.size)
            (nbytes,) = REQUEST.unpack(header)
            if nbytes <= 0:
                return
            conn.sendall(view[:nbytes])


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    _recv_into_all(conn, memoryview(data))
    return bytes(data)


def _recv_into_all(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n


class SocketServer:
    """A raw-socket server process of `source_tensor(rows, cols)` and this process's connection to it."""

    def __init__(self, rows: int, cols: int) -> None:
        ctx = forkserver_context()
        parent, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_socket_server_main,
            args=(rows, cols, child),
            daemon=True,
            name="socket-baseline",
        )
        self.process.start()
        child.close()
        self._ready = parent
        self._conn: socket.socket | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def connect(self) -> None:
        """Wait for the server's port and connect (call after the server had time to start)."""
        if not self._ready.poll(START_TIMEOUT_S):
            raise TimeoutError(f"socket baseline server did not start within {START_TIMEOUT_S}s")
        port = self._ready.recv()
        self._conn = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fetch(self, out: torch.Tensor) -> torch.Tensor:
        """Receive the tensor's first out.nbytes bytes straight into `out`."""
        if self._conn is None:
            raise RuntimeError("connect() first")
        view = byte_view(out)
        self._conn.sendall(REQUEST.pack(len(view)))
        _recv_into_all(self._conn, view)
        return out

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.sendall(REQUEST.pack(0))
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


# ---------------------------------------------------------------- torch.distributed.rpc

# TensorPipe's transports between processes of one host. "shm" is the one it picks by default there; its reactor
# busy-polls a core in every process of the rpc world for as long as the agent lives. "uv" is plain TCP. Each is
# measured with both sides limited to it, in processes of their own that exist only while it is timed (nothing of
# rpc runs beside the other methods); the faster one is the baseline: which one wins depends on the case.
RPC_TRANSPORTS = ("shm", "uv")


def rpc_backend_options(
    port: int, transport: str, workers: int = 4
) -> torch.distributed.rpc.TensorPipeRpcBackendOptions:
    """TensorPipe options on 127.0.0.1:`port` limited to `transport` (one of RPC_TRANSPORTS)."""
    from torch.distributed import rpc

    if transport not in RPC_TRANSPORTS:
        raise ValueError(f"transport must be one of {RPC_TRANSPORTS}, got {transport!r}")
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=IO_TIMEOUT_S,
        num_worker_threads=workers,
        _transports=[transport],
    )


def fastest_transport(seconds_by_transport: dict[str, float]) -> str:
    """The transport whose figure is the baseline: the fastest (a stricter baseline than TensorPipe's default)."""
    return min(seconds_by_transport, key=seconds_by_transport.__getitem__)


def _hold_source(rows: int, cols: int) -> torch.Tensor:
    """Runs on the server: the tensor an RRef will own."""
    return source_tensor(rows, cols)


def _leading_rows(holder: torch.distributed.rpc.RRef, nrows: int) -> torch.Tensor:
    """Runs on the server: a copy of the first `nrows` rows of the RRef's tensor (a view would ship it all)."""
    return holder.local_value().narrow(0, 0, nrows).clone()


def _rpc_server_main(port: int, transport: str) -> None:
    """Join the RPC world as the server and serve until the client shuts it down."""
    from torch.distributed import rpc

    _exit_with_parent()
    loopback_env()
    rpc.init_rpc(
        SERVER_NAME, rank=1, world_size=2, rpc_backend_options=rpc_backend_options(port, transport)
    )
    rpc.shutdown(graceful=True, timeout=IO_TIMEOUT_S)


def median_seconds(run: Callable[[], object], repeat: int) -> float:
    """Median wall time of `repeat` calls of `run`, after one warm-up call."""
    run()
    spent = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent)


def _rpc_client_main(
    port: int,
    transport: str,
    rows: int,
    cols: int,
    plan: list[tuple[int, int]],
    conn: mp.connection.Connection,
) -> None:
    """Join as the client, hold the source behind an RRef on the server, then per (nrows, repeat) of `plan` send
    (median seconds of `rpc_sync` fetching the leading nrows, whether they equal the source)."""
    from torch.distributed import rpc

    _exit_with_parent()
    loopback_env()
    rpc.init_rpc(
        CLIENT_NAME, rank=0, world_size=2, rpc_backend_options=rpc_backend_options(port, transport)
    )
    try:
        holder = rpc.remote(SERVER_NAME, _hold_source, args=(rows, cols), timeout=IO_TIMEOUT_S)
        source = source_tensor(rows, cols)
        results = []
        for nrows, repeat in plan:
            fetch = partial(
                rpc.rpc_sync, SERVER_NAME, _leading_rows, args=(holder, nrows), timeout=IO_TIMEOUT_S
            )
            results.append(
                (median_seconds(fetch, repeat), bool(torch.equal(fetch(), source[:nrows])))
            )
        conn.send(results)
    finally:
        rpc.shutdown(graceful=True, timeout=IO_TIMEOUT_S)


class RpcFetchBaseline:
    """torch.distributed.rpc over one TensorPipe transport: a server process holding `source_tensor(rows, cols)`
    and a client process that times `rpc_sync` fetches of its leading rows (RPC cannot receive into a given
    tensor, so the client keeps what it fetched)."""

    def __init__(self, rows: int, cols: int, transport: str, port: int) -> None:
        rpc_backend_options(port, transport)  # validates `transport` before any process starts
        self.rows, self.cols, self.transport, self.port = rows, cols, transport, port
        self._context = forkserver_context()
        self.server = self._context.Process(
            target=_rpc_server_main, args=(port, transport), daemon=True, name="rpc-baseline-server"
        )
        self.server.start()
        self._client: mp.Process | None = None

    @property
    def pid(self) -> int:
        """The server's pid (whose RSS the report shows)."""
        return self.server.pid

    def measure(
        self, plan: list[tuple[int, int]], timeout: float = 1800.0
    ) -> list[tuple[float, bool]]:
        """(median seconds, matched the source) per (nrows, repeat) of `plan`; the rpc world ends afterwards."""
        parent, child = self._context.Pipe(duplex=False)
        self._client = self._context.Process(
            target=_rpc_client_main,
            daemon=True,
            name="rpc-baseline-client",
            args=(self.port, self.transport, self.rows, self.cols, plan, child),
        )
        self._client.start()
        child.close()
        if not parent.poll(timeout):
            raise TimeoutError(
                f"the rpc fetch baseline ({self.transport}) did not answer within {timeout:.0f}s"
            )
        return parent.recv()

    def close(self) -> None:
        for process in (self._client, self.server):
            if process is None:
                continue
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
