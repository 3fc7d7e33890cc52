"""Steady puts of a prefix fill the snapshot the previous commit reserved (CommitSnapshotRequest.reserve_next):
no CreateSnapshot while the layouts stay the same, a new one when they change or the reservation is gone, the
reservation's memory given back by a changed put and by the client's close, and every put read back bit for
bit with its own non-tensor values."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from server_helpers import held_numbers
from waiting import wait_until

from shardserve import connect, spmd
from shardserve.client import spmd as spmd_module
from shardserve.client.cluster import Cluster
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.launcher import LocalCluster


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


def state(step: int, width: int = 8) -> dict[str, Any]:
    """A model and optimizer-like state dict whose tensors and plain values change with `step`."""
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(16, width), "b": torch.arange(16, dtype=torch.int64) * step},
        "optim": {"step": step, "lr": 0.1 / step, "betas": (0.9, 0.95), "name": f"step-{step}"},
    }


def zeros_like(tree: dict[str, Any]) -> dict[str, Any]:
    return {
        key: zeros_like(value)
        if isinstance(value, dict)
        else torch.zeros_like(value)
        if isinstance(value, torch.Tensor)
        else None
        for key, value in tree.items()
    }


def assert_equal(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_equal(got[key], value)
        elif isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value and type(got[key]) is type(value), key


def assert_reads_back(
    client: Cluster, prefix: str, step: int, number: int, *, pinned: bool = False, **state_args: Any
) -> None:
    """get_state_dict of `prefix` (the newest, or snapshot `number` when `pinned`) answers snapshot `number` and
    fills state(step) bit for bit."""
    into = zeros_like(state(step, **state_args))
    snapshot = number if pinned else None
    assert spmd.get_state_dict(client, prefix, into=into, snapshot=snapshot) == number
    assert_equal(into, state(step, **state_args))


def reserved_number(client: Cluster, prefix: str) -> int:
    """The number of the snapshot reserved for the client's next put of `prefix` (left reserved)."""
    reservation = client.session.reservations.take(prefix)
    assert reservation is not None, f"no snapshot of {prefix!r} is reserved"
    client.session.reservations.keep(prefix, reservation)
    return reservation.snapshot.number


def test_steady_puts_fill_the_reserved_snapshot_and_read_back_with_their_own_values(
    cluster: LocalCluster, creates: list[str]
) -> None:
    with connect(cluster.address) as client:
        numbers = []
        for step in range(1, 5):
            numbers.append(spmd.put_state_dict(client, state(step), "steady", keep=2))
            reserved = reserved_number(client, "steady")
            assert_reads_back(client, "steady", step, numbers[-1])
        assert creates == ["steady"]  # the first put only
        assert numbers == sorted(numbers) and reserved > numbers[-1]
        # two committed snapshots kept, and the reserved one: nothing else held
        assert held_numbers(cluster.address, "steady") == {numbers[-2], numbers[-1], reserved}
        assert_reads_back(client, "steady", 3, numbers[-2], pinned=True)
    # the client's close aborted the reservation: its memory is given back now, not at the pending timeout
    assert held_numbers(cluster.address, "steady") == {numbers[-2], numbers[-1]}


def test_a_changed_layout_gives_the_reservation_back_and_creates_anew(
    cluster: LocalCluster, creates: list[str]
) -> None:
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state(1), "changed", keep=1)
        unused = reserved_number(client, "changed")
        number = spmd.put_state_dict(client, state(2, width=12), "changed", keep=1)
        assert creates == ["changed", "changed"]
        assert unused not in held_numbers(cluster.address, "changed")
        assert_reads_back(client, "changed", 2, number, width=12)
        reserved = reserved_number(client, "changed")
        assert held_numbers(cluster.address, "changed") == {number, reserved}


def test_a_reservation_aborted_by_someone_else_makes_the_next_put_create_one(
    cluster: LocalCluster, creates: list[str]
) -> None:
    with connect(cluster.address) as client, connect(cluster.address) as other:
        spmd.put_state_dict(client, state(1), "lost", keep=1)
        other.session.call(
            "AbortSnapshot",
            pb.AbortSnapshotRequest(prefix="lost", number=reserved_number(client, "lost")),
        )
        number = spmd.put_state_dict(client, state(2), "lost", keep=1)
        assert creates == ["lost", "lost"]
        assert_reads_back(client, "lost", 2, number)


def test_a_put_into_an_aborted_reservation_never_writes_into_another_snapshot(
    cluster: LocalCluster,
) -> None:
    """A steady reservation lies in memory its writer mapped for an earlier put. Aborted under it (by another
    client here; the pending timeout does the same), the writer still copies its next put into that mapping
    before the commit tells it the reservation is gone: the memory must not have become another snapshot's
    meanwhile, here the writer's own next snapshot of another prefix (the ranks give it back to the system
    instead of reusing it)."""

    def tensors(
        step: int,
    ) -> dict[str, torch.Tensor]:  # one size: any freed buffer fits any of them
        return {f"t{i}": torch.full((16, 8), float(100 * step + i)) for i in range(8)}

    def reads_back(client: Cluster, prefix: str, step: int) -> None:
        into = {key: torch.zeros(16, 8) for key in tensors(step)}
        spmd.get_state_dict(client, prefix, into=into)
        assert all(torch.equal(into[key], value) for key, value in tensors(step).items()), prefix

    with connect(cluster.address) as client, connect(cluster.address) as other:
        for step in (
            1,
            2,
            3,
        ):  # from the third on, the reservation reuses memory this writer mapped
            spmd.put_state_dict(client, tensors(step), "aborted", keep=1)
        other.session.call(
            "AbortSnapshot",
            pb.AbortSnapshotRequest(prefix="aborted", number=reserved_number(client, "aborted")),
        )
        spmd.put_state_dict(client, tensors(7), "bystander", keep=1, reserve_next=False)
        spmd.put_state_dict(
            client, tensors(4), "aborted", keep=1
        )  # copied into the aborted one first
        reads_back(other, "bystander", 7)
        reads_back(other, "aborted", 4)


def test_without_reserve_next_nothing_is_held_between_puts(
    cluster: LocalCluster, creates: list[str]
) -> None:
    with connect(cluster.address) as client:
        for step in (1, 2):
            number = spmd.put_state_dict(client, state(step), "plain", keep=1, reserve_next=False)
        assert creates == ["plain", "plain"]
        assert client.session.reservations.take("plain") is None
        # without a reservation the older snapshot is freed after the commit answered (deferred drops)
        wait_until(
            lambda: held_numbers(cluster.address, "plain") == {number},
            30,
            f"the ranks to hold snapshot {number} of 'plain' only",
        )


def test_a_commit_with_a_skeleton_naming_other_tensors_is_refused_and_nothing_is_visible(
    cluster: LocalCluster,
) -> None:
    from shardserve.client.errors import InvalidArgumentError
    from shardserve.client.ops.snapshots import commit_snapshot, create_snapshot
    from shardserve.core.metadata import ShardedTensorMetadata

    with connect(cluster.address) as client:
        layout: ShardedTensorMetadata = client.session.layouts.layout((4,), torch.float32, None, 1)
        created = create_snapshot(client.session, "refused", {"w": layout}, keep=1)
        skeleton = '{"format":1,"tree":{"dict":[["w",{"tensor":"other"}]]}}'
        with pytest.raises(InvalidArgumentError, match="skeleton") as raised:
            commit_snapshot(client.session, created, skeleton=skeleton)
        assert raised.value.metadata.get("field") == "skeleton"
        assert not client.session.call(
            "ListSnapshots", pb.ListSnapshotsRequest(prefix="refused")
        ).snapshots
        assert held_numbers(cluster.address, "refused") == set()


def test_a_job_of_one_takes_each_reservation_after_its_commit_answered(
    cluster: LocalCluster, creates: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardserve.client.errors import InvalidArgumentError

    """A process putting alone with reserve_next="later" commits with reserve_later and takes the next snapshot
    with TakeReservedSnapshot on its reservation thread: one create for all its steady puts, one take per
    commit; any other value of reserve_next is refused naming it."""
    taken: list[int] = []
    real = spmd_module.take_reserved_snapshot

    def counted(session: Any, prefix: str, committed: int) -> pb.SnapshotInfo | None:
        taken.append(committed)
        return real(session, prefix, committed)

    monkeypatch.setattr(spmd_module, "take_reserved_snapshot", counted)
    with connect(cluster.address) as client:
        numbers = [
            spmd.put_state_dict(client, state(step), "taken", keep=1, reserve_next="later")
            for step in (1, 2, 3)
        ]
        reserved = reserved_number(client, "taken")
        assert creates == ["taken"] and taken == numbers
        assert numbers == sorted(numbers) and reserved > numbers[-1]
        assert_reads_back(client, "taken", 3, numbers[-1])
        assert held_numbers(cluster.address, "taken") == {numbers[-1], reserved}
        for wrong in ("soon", 1, None):
            with pytest.raises(InvalidArgumentError, match="reserve_next") as refused:
                spmd.put_state_dict(client, state(4), "taken", keep=1, reserve_next=wrong)
            assert refused.value.metadata.get("field") == "reserve_next"
        assert creates == ["taken"] and len(taken) == 3


def test_take_reserved_snapshot_answers_once_and_refuses_what_is_not_reserved(
    cluster: LocalCluster,
) -> None:
    from shardserve.client.errors import InvalidArgumentError, TensorNotFoundError
    from shardserve.client.ops.snapshots import create_snapshot

    with connect(cluster.address) as client:
        session = client.session
        layout = session.layouts.layout((4,), torch.float32, None, 1)
        created = create_snapshot(
            session, "wire", {"w": layout}, keep=1, writer_host_id=session.paths.in_place_host()
        )
        assert created.entries[
            0
        ].writable  # its shards count as written at the commit (never read here)
        commit = pb.CommitSnapshotRequest(
            prefix="wire", number=created.number, reserve_later=True, written_in_place=True
        )
        with pytest.raises(InvalidArgumentError, match="reserve_later") as refused:
            session.call("CommitSnapshot", commit)
        assert refused.value.metadata.get("field") == "reserve_later"
        commit.reserve_next = True
        assert not session.call("CommitSnapshot", commit).HasField("next")
        take = pb.TakeReservedSnapshotRequest(prefix="wire", committed=created.number)
        reserved = session.call("TakeReservedSnapshot", take)
        assert reserved.number > created.number and [e.key for e in reserved.entries] == ["w"]
        with pytest.raises(TensorNotFoundError) as again:
            session.call("TakeReservedSnapshot", take)
        assert again.value.metadata.get("field") == "committed"
        session.call(
            "AbortSnapshot", pb.AbortSnapshotRequest(prefix="wire", number=reserved.number)
        )
        assert held_numbers(cluster.address, "wire") == {created.number}


def test_a_rank_killed_between_puts_makes_the_next_put_create_on_the_live_ranks(
    make_cluster: Callable[..., LocalCluster], creates: list[str]
) -> None:
    import os
    import signal

    from shardserve.server.common.rank_options import RankOptions

    doomed = make_cluster(ranks=3, rank_options=RankOptions(log_level="WARNING"))
    with connect(doomed.address) as client:
        spmd.put_state_dict(client, state(1), "survivor", keep=1)
        for step in (
            1,
            2,
            3,
        ):  # a tensor put every step: its next version reserved over the three ranks
            client.put("one", torch.full((30, 4), float(step)), overwrite=True)
        os.kill(doomed.rank_pids[2], signal.SIGKILL)
        wait_until(
            lambda: not any(r.rank == 2 and r.alive for r in client.session.refresh_ranks()),
            60,
            "the coordinator to see rank 2 die",
        )
        number = spmd.put_state_dict(client, state(2), "survivor", keep=1)
        assert creates == ["survivor", "survivor"]
        summary = client.snapshot("survivor").summary
        assert summary.number == number
        assert all(
            2 not in {shard.rank for shard in tensor.metadata.shards_metadata}
            for tensor in summary.tensors.values()
        )
        assert_reads_back(client, "survivor", 2, number)
        for step in (
            4,
            5,
            6,
        ):  # the reservation on the dead rank given back, the puts on the live ranks
            one = client.put("one", torch.full((30, 4), float(step)), overwrite=True)
            assert 2 not in {shard.rank for shard in one.metadata().shards_metadata}
            assert torch.equal(client.tensor("one").full_tensor(), torch.full((30, 4), float(step)))


def test_a_reserved_put_that_fails_is_aborted_and_put_again_in_a_new_snapshot(
    cluster: LocalCluster, creates: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = spmd_module.write_whole
    failures = [RuntimeError("injected write failure")]

    def fail_once(*args: Any, **kwargs: Any) -> dict[str, int]:
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state(1), "retried", keep=1)
        failed = reserved_number(client, "retried")
        monkeypatch.setattr(spmd_module, "write_whole", fail_once)
        number = spmd.put_state_dict(client, state(2), "retried", keep=1)
        assert not failures and creates == ["retried", "retried"]
        assert failed not in held_numbers(cluster.address, "retried")
        assert_reads_back(client, "retried", 2, number)


@pytest.mark.slow
def test_a_coordinator_killed_between_puts_forgets_the_reservation_and_the_next_put_creates(
    tmp_path: Path, creates: list[str]
) -> None:
    """kill -9 of the coordinator between two steady puts, restarted on the same port and catalog: the client,
    connected throughout, holds a reservation the new coordinator never heard of; its put creates a snapshot
    and reads back bit for bit, and the snapshot put before the kill is still served."""
    from server_processes import fork_server, rank_env, server_env, stop_all

    from shardserve.server.launcher import free_port

    port, env = free_port(), server_env()
    coordinator_args = ["coordinator", "--listen", f"127.0.0.1:{port}"]
    coordinator_args += ["--state-dir", str(tmp_path / "state"), "--heartbeat-interval", "0.5"]
    address = f"127.0.0.1:{port}"
    procs = []
    with open(tmp_path / "log.txt", "w") as log:
        try:
            procs.append(fork_server(coordinator_args, env, log))
            for rank in range(2):
                procs.append(fork_server(["--coordinator", address], rank_env(env, rank, 2), log))

            def ranks_alive(count: int) -> Callable[[], bool]:
                def alive() -> bool:
                    with connect(address) as probe:
                        return len([r for r in probe.ranks() if r.alive]) == count

                return alive

            wait_until(ranks_alive(2), 120, "two ranks")
            with connect(address) as client:
                for step in (1, 2):
                    before = spmd.put_state_dict(client, state(step), "restarted", durable=True)
                reserved_number(client, "restarted")
                procs[0].kill()
                procs[0].wait(30)
                procs[0] = fork_server(coordinator_args, env, log)
                wait_until(ranks_alive(2), 120, "the ranks registered again")
                number = spmd.put_state_dict(client, state(3), "restarted", durable=True)
                assert creates == ["restarted", "restarted"] and number > before
                assert_reads_back(client, "restarted", 2, before, pinned=True)
                assert_reads_back(client, "restarted", 3, number, pinned=True)
        finally:
            stop_all(procs)


def _segment_mappings() -> int:
    """How many mappings of rank shard segments (memfds) this process holds."""
    with open("/proc/self/maps") as maps:
        return sum("shardserve-shard" in line for line in maps)


def test_a_reader_of_steady_puts_maps_each_segment_once(cluster: LocalCluster) -> None:
    """Steady puts alternate between two sets of segments (the committed snapshot's and the reservation's);
    a get after each put reads the new snapshot through the mappings made for the one before last, instead of
    mapping the same memory again."""
    with connect(cluster.address) as client:
        counts = []
        for step in range(1, 7):
            torch.manual_seed(step)
            weights = {
                "a": torch.randn(256, 256),
                "b": torch.randn(128, 512),
            }  # read through mappings
            spmd.put_state_dict(client, weights, "mapped_once", keep=1)
            into = {key: torch.zeros_like(value) for key, value in weights.items()}
            spmd.get_state_dict(client, "mapped_once", into=into)
            assert all(torch.equal(into[key], weights[key]) for key in weights)
            counts.append(_segment_mappings())
        assert counts[1] > counts[0] > 0  # the writer's and the reader's mappings of both sets
        assert counts[2:] == [counts[1]] * 4, counts


def test_a_reader_of_steady_puts_finds_each_new_snapshot_by_its_labels_without_opening_it(
    cluster: LocalCluster,
) -> None:
    """The rank labels each segment it recycles with the shard it holds now: once the reader maps both sets of
    segments, a get after each put calls no rank to open the new snapshot's shards (OpenShard(s)), and reads
    every step's values bit for bit. A snapshot whose segments it never mapped is opened as before."""
    from shardserve.client import metrics as client_metrics

    with connect(cluster.address, transport="shm") as client:
        opened, labelled = [], []
        for step in range(1, 8):
            torch.manual_seed(step)
            weights = {
                f"w{i}": torch.randn(64, 32) for i in range(6)
            }  # 8 KiB each: small pieces too
            spmd.put_state_dict(client, weights, "labelled", keep=1, durable=False)
            into = {key: torch.zeros_like(value) for key, value in weights.items()}
            spmd.get_state_dict(client, "labelled", into=into)
            assert all(torch.equal(into[key], weights[key]) for key in weights), step
            opened.append(client_metrics()["shm_opens"])
            labelled.append(client_metrics()["shm_labelled"])
        assert opened[3:] == [opened[2]] * 4, opened  # nothing opened after both sets were mapped
        assert labelled[-1] - labelled[2] >= 4 * 6, labelled  # every shard found by its label
        spmd.put_state_dict(client, {"other": torch.randn(64, 32)}, "unlabelled", durable=False)
        into = {"other": torch.zeros(64, 32)}
        spmd.get_state_dict(client, "unlabelled", into=into)
        assert client_metrics()["shm_opens"] > opened[-1]


def test_a_tensor_put_every_step_is_fetched_after_each_put_without_opening_its_shards(
    cluster: LocalCluster,
) -> None:
    """A single tensor put every step lands in segments the rank recycles (the version reserved after the one
    before): the reader's fetch after each put finds the new version's shards by their labels, opens none, and
    reads each step's bytes bit for bit, however often the segments were reused under its mappings."""
    from shardserve.client import metrics as client_metrics

    with connect(cluster.address, transport="shm") as client:
        source = torch.empty(256, 1024)
        out = torch.empty_like(source)
        opened = []
        for step in range(1, 9):
            source.copy_(torch.full((256, 1024), float(step)) + torch.arange(1024))
            client.put("labelled_one", source, overwrite=True, durable=False)
            client.tensor("labelled_one").fetch((0, 0), (256, 1024), out=out)
            assert torch.equal(out, source), step
            opened.append(client_metrics()["shm_opens"])
        assert opened[4:] == [opened[3]] * 4, opened


def test_a_reader_of_a_tensor_put_every_step_reads_through_a_rank_killed_and_restarted(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Rank 1 is SIGKILLed under a reader that finds each new version by its segments' labels: the killed
    process's segments (their last headers still say served) are never read again, every fetch after each put
    reads that step's bytes, and once the restarted rank's new segments are mapped they are found by their
    labels too."""
    import signal

    from shardserve.client import metrics as client_metrics
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.supervisor import RestartPolicy

    cluster = make_cluster(
        ranks=2,
        rank_options=RankOptions(log_level="WARNING"),
        restart_policy=RestartPolicy(max_restarts=1, initial_backoff=0.2),
    )
    source, out = torch.empty(256, 1024), torch.empty(256, 1024)
    with connect(cluster.address) as writer, connect(cluster.address, transport="shm") as reader:

        def step(value: int) -> None:
            source.copy_(torch.full((256, 1024), float(value)) + torch.arange(1024))
            writer.put("survives", source, overwrite=True, durable=False)
            reader.tensor("survives").fetch((0, 0), (256, 1024), out=out)
            assert torch.equal(out, source), value

        for value in range(1, 5):
            step(value)
        cluster.kill_rank(1, signal.SIGKILL)
        wait_until(
            lambda: (
                cluster.restarts(1) == 1 and all(r.alive for r in writer.session.refresh_ranks())
            ),
            60,
            "rank 1 to be restarted and registered again",
        )
        for value in range(5, 9):  # the restarted rank's segments opened, then recycled
            step(value)
        opened, labelled = client_metrics()["shm_opens"], client_metrics()["shm_labelled"]
        for value in range(9, 12):
            step(value)
        assert client_metrics()["shm_opens"] == opened  # both ranks' shards found by their labels
        assert client_metrics()["shm_labelled"] - labelled >= 3 * 2


def test_a_reader_keeps_hundreds_of_shards_mapped_without_holding_their_files(
    cluster: LocalCluster,
) -> None:
    """A state dict of more tensors than a few hundred (a 7B model has about 300), each read through a mapping:
    a second read of the snapshot opens no shard again (every mapping was kept), and the mappings hold no open
    file each (the process's descriptors do not grow with them)."""
    from shardserve.client import metrics as client_metrics

    count = 300
    weights = {f"layer{i}.w": torch.full((96, 256), float(i)) for i in range(count)}  # 96 KiB each
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, weights, "many_mapped", keep=1, durable=False)
        into = {key: torch.zeros_like(value) for key, value in weights.items()}
        files_before = len(os.listdir("/proc/self/fd"))
        spmd.get_state_dict(client, "many_mapped", into=into)
        assert all(torch.equal(into[key], weights[key]) for key in weights)
        files_after = len(os.listdir("/proc/self/fd"))
        opens = client_metrics()["shm_opens"]
        into = {key: torch.zeros_like(value) for key, value in weights.items()}
        spmd.get_state_dict(client, "many_mapped", into=into)
        assert all(torch.equal(into[key], weights[key]) for key in weights)
        assert client_metrics()["shm_opens"] == opens
        assert files_after - files_before < count // 4, (files_before, files_after)
