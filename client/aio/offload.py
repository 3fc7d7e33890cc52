"""The asyncio client's blocking work, run off the event loop: a bounded pool of threads, each job awaited under
a deadline.

The data paths (shared-memory copies, the bulk port's sockets, gRPC streams of shard bytes, torch copies) are
the blocking client's own; the asyncio client hands each whole operation to this pool, so the loop only awaits
a future. A caller's deadline ends its await with DeadlineExceededError (a job still queued is dropped; one
already running ends at the blocking client's own deadline, which is the same). A cancelled await drops a
queued job the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from shardserve.client.errors import DeadlineExceededError, ShardServeError

T = TypeVar("T")
OFFLOAD_THREADS = (
    4  # operations of one asyncio client running at once (each fans out on the client's pool)
)


class Offload:
    """A bounded pool for the blocking client's operations; `run` awaits one without blocking the loop."""

    def __init__(self, threads: int = OFFLOAD_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardserve-aio")

    async def run(self, job: Callable[[], T], *, deadline: float, what: str) -> T:
        """`job()` on the pool; DeadlineExceededError naming `what` once `deadline` seconds have passed first."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, job)
        try:
            return await asyncio.wait_for(
                future, deadline
            )  # cancels a queued job at the deadline too
        except TimeoutError as err:
            if isinstance(err, ShardServeError):  # the job's own DeadlineExceededError
                raise
            raise DeadlineExceededError(
                f"{what} did not finish within its deadline of {deadline:.1f} s",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None

    def close(self) -> None:
        """Drop the queued jobs; running ones end at their own deadlines."""
        self._pool.shutdown(wait=False, cancel_futures=True)
