"""Reservations of a job of several processes (a 2-process gloo world putting DTensors sharded over it): job rank
0 alone holds the next snapshot its commit reserved (made after the commit answered with reserve_next="later",
and for every delta put) and sends it to the other rank at the next put; steady puts create nothing, read back
bit for bit, and a reservation aborted under the job, or lost with a coordinator killed while job rank 0 takes
it, makes its next put create one."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_world import World
from server_helpers import held_numbers
from waiting import wait_until

from shardserve import connect, spmd
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.launcher import LocalCluster

ROWS, COLUMNS = 64, 48


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


def full_state(step: int) -> dict[str, torch.Tensor]:
    """The job's global tensors at `step` (every element tells the step)."""
    base = torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS)
    return {"w": base + step * 1000, "b": torch.arange(ROWS, dtype=torch.float32) - step}


class Counted:
    """The client's CreateSnapshot and create_delta calls ("create" each) and TakeReservedSnapshot calls (the
    committed number each) in this process while it is entered; a job process runs several tests' jobs, so the
    module's functions are restored on exit."""

    NAMES = ("create_snapshot", "create_delta", "take_reserved_snapshot")

    def __init__(self) -> None:
        self.creates: list[str] = []
        self.taken: list[int] = []
        self._real: dict[str, Any] = {}

    def __enter__(self) -> Counted:
        from shardserve.client import spmd as spmd_module

        for name in self.NAMES:
            self._real[name] = real = getattr(spmd_module, name)
            if name == "take_reserved_snapshot":
                counted = _counting(real, self.taken, lambda args: args[2])
            else:
                counted = _counting(real, self.creates, lambda args: "create")
            setattr(spmd_module, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        from shardserve.client import spmd as spmd_module

        for name, real in self._real.items():
            setattr(spmd_module, name, real)


def _counting(real: Any, calls: list, label: Any) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(label(args))
        return real(*args, **kwargs)

    return counted


def job_steady_puts(rank: int, address: str, prefix: str, delta: Any) -> dict[str, Any]:
    """Four puts of DTensors sharded over the 2-process mesh (reserve_next="later"), each read back by the job;
    before the fourth, job rank 0 has its reservation aborted by another client."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    numbers, same, held = [], [], []
    with Counted() as counted, connect(address) as client, connect(address) as other:
        for step in (1, 2, 3, 4):
            if step == 4 and rank == 0:
                _abort_reserved(client, other, prefix)
            state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state(step).items()}
            numbers.append(
                spmd.put_state_dict(
                    client, state, prefix, keep=1, reserve_next="later", delta=delta
                )
            )
            into = {k: torch.zeros_like(v) for k, v in state.items()}
            spmd.get_state_dict(client, prefix, into=into)
            same.append(all(torch.equal(into[k].full_tensor(), full_state(step)[k]) for k in into))
            reservation = client.session.reservations.take(prefix)
            held.append(
                None
                if reservation is None or reservation.snapshot is None
                else reservation.snapshot.number
            )
            if reservation is not None:
                client.session.reservations.keep(prefix, reservation)
        return {
            "numbers": numbers,
            "same": same,
            "held": held,
            "creates": counted.creates,
            "taken": counted.taken,
        }


def _abort_reserved(client: Any, other: Any, prefix: str) -> None:
    """Abort the snapshot reserved for `client`'s next put of `prefix` through `other` (as the coordinator's
    pending timeout would), leaving the client's reservation as it was."""
    reservation = client.session.reservations.take(prefix)
    assert reservation is not None and reservation.snapshot is not None
    number = reservation.snapshot.number
    other.session.call("AbortSnapshot", pb.AbortSnapshotRequest(prefix=prefix, number=number))
    client.session.reservations.keep(prefix, reservation)


@pytest.mark.parametrize("delta", [False, "version_counters"])
def test_job_rank_0_takes_each_reservation_after_the_commit_and_sends_it_at_the_next_put(
    cluster: LocalCluster, world2: World, delta: Any
) -> None:
    """Job rank 0 creates once and takes one reservation per commit (the first delta put is in full and reserves
    nothing); the other rank creates and takes nothing and holds no snapshot; every put reads
    back bit for bit; the reservation aborted under the job makes the fourth put create again; the job's close
    gives the last reservation back."""
    prefix = f"job-later-{'delta' if delta else 'full'}"
    answers = world2.run(job_steady_puts, cluster.address, prefix, delta, timeout=180)
    first, second = answers[0], answers[1]
    numbers = first["numbers"]
    assert second["numbers"] == numbers == sorted(numbers)
    assert first["same"] == second["same"] == [True] * 4
    assert second["creates"] == [] and second["taken"] == [] and second["held"] == [None] * 4
    if (
        delta
    ):  # in full (reserving nothing), copies made, copies filled, copies made again after the abort
        assert first["creates"] == ["create", "create", "create"]
        assert first["taken"] == numbers[1:]
    else:  # created, two filled reservations, created after the abort
        assert first["creates"] == ["create", "create"]
        assert first["taken"] == numbers
    assert all(
        held is not None and held > number for held, number in zip(first["held"][1:], numbers[1:])
    )
    assert held_numbers(cluster.address, prefix) == {numbers[-1]}


def _ranks_alive(address: str, count: int) -> bool:
    with connect(address) as probe:
        return len([r for r in probe.ranks() if r.alive]) == count


def job_reservation_lost(
    rank: int, address: str, prefix: str, coordinator_pid: int
) -> dict[str, Any]:
    """Four durable puts with reserve_next="later"; job rank 0 SIGKILLs the coordinator (`coordinator_pid`) as
    its reservation thread takes the reservation the second commit made, so the take meets a dead coordinator
    or a restarted one that never heard of it. After the second put the job waits for the kill and for the
    ranks to be registered again with the restarted coordinator."""
    import threading

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardserve.client import spmd as spmd_module

    mesh = init_device_mesh("cpu", (2,))
    numbers, same, answers, killed = [], [], [], threading.Event()
    with Counted() as counted, connect(address) as client:
        counting = spmd_module.take_reserved_snapshot

        def take_after_kill(*args: Any) -> Any:
            if len(counted.taken) == 1:  # the take of the second commit's reservation
                os.kill(coordinator_pid, signal.SIGKILL)
                killed.set()
            answer = counting(*args)
            answers.append(None if answer is None else answer.number)
            return answer

        spmd_module.take_reserved_snapshot = take_after_kill  # Counted restores the real one
        for step in (1, 2, 3, 4):
            state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state(step).items()}
            numbers.append(spmd.put_state_dict(client, state, prefix, keep=1, reserve_next="later"))
            if step == 2:
                assert rank != 0 or killed.wait(60), "no take after the second commit"
                dist.barrier()
                wait_until(lambda: _ranks_alive(address, 2), 120, "the restarted coordinator")
            into = {k: torch.zeros_like(v) for k, v in state.items()}
            spmd.get_state_dict(client, prefix, into=into)
            same.append(all(torch.equal(into[k].full_tensor(), full_state(step)[k]) for k in into))
        return {
            "numbers": numbers,
            "same": same,
            "creates": counted.creates,
            "taken": counted.taken,
            "answers": answers,
        }


@pytest.mark.slow
def test_a_reservation_lost_with_the_coordinator_while_job_rank_0_takes_it_makes_the_job_create(
    tmp_path: Path, world2: World
) -> None:
    """The coordinator is SIGKILLed as job rank 0 takes the reservation of the job's second commit and started
    again on the same port and catalog: the take answers none, so at the third put job rank 0 sends no snapshot
    and the job creates one (no rank waits on or writes into the lost reservation); the fourth put fills the
    reservation the third commit made. Every put reads back bit for bit, and the restarted coordinator aborts
    the lost reservation at once (no commit can reach a snapshot pending before it started): the ranks hold
    only the last snapshot, not that memory for the pending timeout's ten minutes."""
    from server_processes import fork_server, rank_env, server_env, stop_all

    from shardserve.server.launcher import free_port

    port, env = free_port(), server_env()
    address = f"127.0.0.1:{port}"
    coordinator_args = ["coordinator", "--listen", address]
    coordinator_args += ["--state-dir", str(tmp_path / "state"), "--heartbeat-interval", "0.5"]
    procs = []
    with open(tmp_path / "log.txt", "w") as log, ThreadPoolExecutor(1) as pool:
        try:
            procs.append(fork_server(coordinator_args, env, log))
            for rank in range(2):
                procs.append(fork_server(["--coordinator", address], rank_env(env, rank, 2), log))
            wait_until(lambda: _ranks_alive(address, 2), 120, "two ranks")
            job = pool.submit(
                world2.run, job_reservation_lost, address, "lost", procs[0].pid, timeout=240
            )
            wait_until(lambda: procs[0].poll() is not None or job.done(), 120, "the kill")
            assert procs[0].poll() == -signal.SIGKILL, job.result()
            procs[0] = fork_server(coordinator_args, env, log)
            answers = job.result()
            first, second = answers[0], answers[1]
            numbers = first["numbers"]
            assert second["numbers"] == numbers == sorted(numbers)
            assert first["same"] == second["same"] == [True] * 4
            assert first["creates"] == ["create", "create"]  # the first put, and the third
            assert first["taken"] == numbers  # each commit's reservation, taken by job rank 0
            assert first["answers"][:3] == [numbers[1], None, numbers[3]]  # the second one lost
            assert second["creates"] == [] and second["taken"] == []
            # the lost reservation's pending versions, aborted by the restarted coordinator's first chores
            wait_until(lambda: held_numbers(address, "lost") == {numbers[-1]}, 60, "it dropped")
        finally:
            stop_all(procs)
