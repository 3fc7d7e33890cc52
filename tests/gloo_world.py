"""A gloo world of persistent rank processes that run module-level functions on request, forked from this test
process's forkserver (server.rank_start.forkserver_context), which imported torch once, as the test clusters'
ranks are (each process fresh, but without 2-3 s of CPU importing torch)."""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.forkserver
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from shardserve.server.common.ports import free_port
from shardserve.server.rank_start import forkserver_context

PG_TIMEOUT_S = 120
RUN_TIMEOUT_S = (
    90  # shorter than the process group's: a hang shows up as a timeout here, not as an error
)


JOB_MODULES = (
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
)
"""What the tests' job processes import once forked and the ranks never do: DTensor (whose first
distribute_tensor imports torch._dynamo), DCP and FSDP2, 1-1.5 s of CPU in every job process (a profile of the
suite: a twentieth of its CPU). This test process's forkserver imports them once, beside the ranks' PRELOAD."""


def start_forkserver() -> multiprocessing.context.ForkServerContext:
    """This test process's forkserver context, its server running: started here, if nothing started it yet,
    with the ranks' PRELOAD and JOB_MODULES (a forkserver started earlier, by a cluster made outside the
    fixtures, keeps PRELOAD alone: its job processes import the rest themselves, as they would anyway)."""
    context = forkserver_context(also_preload=JOB_MODULES)
    multiprocessing.forkserver.ensure_running()
    return context


def _serve(rank: int, world_size: int, port: int, commands: Any, results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        while True:
            command = commands.get()
            if command is None:
                return
            command_id, function, args = command
            try:
                results.put((command_id, rank, "ok", function(rank, *args)))
            except BaseException:  # noqa: BLE001 - report every failure to the test process
                results.put((command_id, rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()
        results.close()
        results.join_thread()
        os._exit(0)  # skip the interpreter's slow teardown of torch; every answer is flushed above


class World:
    """`size` ranks in one gloo process group, running module-level functions on request."""

    def __init__(self, size: int) -> None:
        ctx = start_forkserver()
        self.size = size
        self.results = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(size)]
        port = free_port()
        self.processes = [
            ctx.Process(
                target=_serve,
                args=(rank, size, port, self.inboxes[rank], self.results),
                daemon=True,
            )
            for rank in range(size)
        ]
        for process in self.processes:
            process.start()
        self._commands = 0

    def start(self, function: Callable[..., Any], *args: Any) -> None:
        """`function(rank, *args)` sent to every rank without waiting for the answers (a job a test kills)."""
        self._commands += 1
        for inbox in self.inboxes:
            inbox.put((self._commands, function, args))

    def run(
        self, function: Callable[..., Any], *args: Any, timeout: float = RUN_TIMEOUT_S
    ) -> dict[int, Any]:
        """`function(rank, *args)` on every rank; the answers by rank, or a failure naming the rank. Late answers
        to an earlier command (one that failed a test) are dropped, never taken for this one's."""
        self.start(function, *args)
        answers: dict[int, Any] = {}
        while len(answers) < self.size:
            try:
                command_id, rank, status, value = self.results.get(timeout=timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.processes) if not p.is_alive()]
                pytest.fail(
                    f"{function.__name__}: no answer from ranks {sorted(set(range(self.size)) - set(answers))}"
                    f" within {timeout}s (dead ranks: {dead})"
                )
            if command_id != self._commands:
                continue
            if status == "error":
                pytest.fail(f"{function.__name__} failed on rank {rank}:\n{value}")
            answers[rank] = value
        return answers

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for process in self.processes:
            process.join(timeout=15)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
