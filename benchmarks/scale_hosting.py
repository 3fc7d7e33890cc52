"""One event loop serving every simulated rank instance of a process, each on a grpc.aio server of its own.

A gRPC server per instance on threads woke, for every call, its polling thread and a worker, each taking the GIL:
a fan-out to the 62 instances of one process woke over a hundred threads at once, and half the process's CPU
went to handing the GIL around (perf: futex waits and context switches). Here the instances' servers share one
loop thread and their servicers (the real rank servicers, unchanged) run on it, one call after another, which is
what the GIL allowed anyway; a call that may wait for another (a collective job waiting for its predecessor, a
streamed read or write) runs on a small thread pool instead, so it never holds up the loop.

The servicers are the ones server/rank/service.py registers (add_shard_server), called with a context that
answers `abort_with_status` by raising (the aio context's abort is a coroutine, awaited here) and passes the
rest through. What the simulation leaves out is the rank's server interceptors (access checks, stream limits,
tracing): the coordinator's side of every call, which the harness measures, is unchanged.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

INLINE_METHODS = frozenset(
    {
        "AllocateShards",
        "AllocateMany",
        "PromoteVersion",
        "PromoteMany",
        "DropVersion",
        "DropMany",
        "GetStats",
        "WriteShards",
        "ReadRegions",
        "ReadRegionSmall",
    }
)
"""Calls answered on the loop thread: each is a few table updates on its instance, never a wait for another call."""

POOL_THREADS = 8  # the other calls (collective jobs, streams), which may wait


class _Aborted(Exception):
    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.details)
        self.status = status


class _SyncContext:
    """What a servicer written for grpc's threaded server calls of its context, over an aio context."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def abort_with_status(self, status: grpc.Status) -> None:
        raise _Aborted(status)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class AioHosting:
    """The loop thread, its thread pool, and the instances' servers started on it."""

    def __init__(self, *, pool_threads: int = POOL_THREADS) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = futures.ThreadPoolExecutor(pool_threads, thread_name_prefix="sim-calls")
        self._thread = threading.Thread(target=self.loop.run_forever, name="sim-loop", daemon=True)
        self._thread.start()

    def serve(
        self, add_servicers: Callable[[Any], object], host: str = "127.0.0.1"
    ) -> tuple[Any, int]:
        """A started grpc.aio server on a free port of `host` with the handlers `add_servicers` registers on a
        threaded server; (the server, its port)."""
        captured = _Captured()
        add_servicers(captured)
        return self._run(self._start(captured.handlers, host))

    def stop(self, server: Any) -> None:
        """Stop one instance's server at once (calls in flight cancelled), as a crash would."""
        self._run(server.stop(0))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _start(self, handlers: list[grpc.GenericRpcHandler], host: str) -> tuple[Any, int]:
        server = grpc.aio.server(handlers=[_AioHandlers(handlers, self.pool)])
        port = server.add_insecure_port(f"{host}:0")
        await server.start()
        return server, port


class _Captured:
    """Stands in for grpc.Server while add_shard_server registers its handlers."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.handlers.extend(handlers)


class _AioHandlers(grpc.GenericRpcHandler):
    """The threaded server's handlers of a service, each wrapped once to run on the loop or the pool."""

    def __init__(self, handlers: list[grpc.GenericRpcHandler], pool: futures.Executor) -> None:
        self._handlers, self._pool = handlers, pool
        self._wrapped: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        if method not in self._wrapped:
            found = next((h for h in (g.service(details) for g in self._handlers) if h), None)
            self._wrapped[method] = None if found is None else self._wrap(method, found)
        return self._wrapped[method]

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inline = method.rsplit("/", 1)[-1] in INLINE_METHODS
        pool = self._pool
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }

        async def call(run: Callable[[], Any], context: grpc.aio.ServicerContext) -> Any:
            try:
                if inline:
                    return run()
                return await asyncio.get_running_loop().run_in_executor(pool, run)
            except _Aborted as aborted:
                await context.abort_with_status(aborted.status)

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                return await call(lambda: unary(request, _SyncContext(context)), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **codec)
        if handler.unary_stream is not None:
            streaming = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                answers = await call(
                    lambda: list(streaming(request, _SyncContext(context))), context
                )
                for answer in answers:
                    yield answer

            return grpc.unary_stream_rpc_method_handler(unary_stream, **codec)
        receiving = handler.stream_unary
        if receiving is None:
            raise ValueError(f"{method}: no ShardServer method streams both ways")

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            received = [request async for request in requests]
            return await call(lambda: receiving(iter(received), _SyncContext(context)), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **codec)
