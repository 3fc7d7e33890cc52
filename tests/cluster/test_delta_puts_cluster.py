"""Delta puts (spmd.put_state_dict(..., delta=True)): only the blocks that changed are sent and stored, the rest
shared with the previous snapshot on the ranks; every snapshot reads bit for bit like a full put on every data
path, readers pinned to the older snapshot read its bytes whole, and a put with nothing to compare against (no
previous put, a changed shape, a newer snapshot by another writer, a dropped snapshot) is made in full."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from server_helpers import held_numbers
from waiting import wait_until

from shardserve import InvalidArgumentError, connect, spmd
from shardserve.client import metrics as client_metrics
from shardserve.client import spmd as spmd_module
from shardserve.client.cli.main import main as cli_main
from shardserve.client.cluster import Cluster
from shardserve.client.ops.snapshots import held_once
from shardserve.client.paths.segments import HEADER_FILES
from shardserve.core.delta import DELTA_BLOCK_BYTES
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.launcher import LocalCluster

ROWS, WIDTH = 2048, 512  # 4 MiB of fp32: four delta blocks of 512 rows


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each delta put's changed blocks took on the wire (one entry per delta put on this rank)."""
    counts: list[int] = []
    real = spmd_module.write_changed

    def counted(*args: Any, **kwargs: Any) -> int:
        counts.append(real(*args, **kwargs))
        return counts[-1]

    monkeypatch.setattr(spmd_module, "write_changed", counted)
    return counts


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per delta snapshot this process created (not taken from the copies a commit reserved)."""
    counts: list[int] = []
    real = spmd_module.create_delta

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(spmd_module, "create_delta", counted)
    return counts


def model(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {
        "a": torch.randn(ROWS, WIDTH),
        "b": torch.randn(ROWS, WIDTH),
        "ids": torch.arange(100, dtype=torch.int64),
        "scale": torch.tensor(1.5),
        "step": seed,
    }


def read(
    client: Cluster, prefix: str, like: dict[str, Any], number: int | None = None
) -> dict[str, Any]:
    into = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()
    }
    spmd.get_state_dict(client, prefix, into=into, snapshot=number)
    return into


def assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize(
    "transport", ["auto", "grpc"]
)  # changed bytes through a staging memfd, or inline
def test_unchanged_sends_nothing_and_one_row_sends_one_block(
    cluster: LocalCluster, sent: list[int], transport: str
) -> None:
    prefix = f"d/rows-{transport}"
    with connect(cluster.address, transport=transport) as client:
        state = model(1)
        first = spmd.put_state_dict(client, state, prefix, keep=4, delta=True)
        assert sent == []  # no previous put: in full
        second = spmd.put_state_dict(client, state, prefix, keep=4, delta=True)
        assert second > first and sent == [0]
        assert_same(read(client, prefix, state), state)
        state["a"][700] += 1.0
        state["a"][1024:1536] = -1.0  # a whole delta block, four rank blocks rewritten in full
        state["step"] = 2
        third = spmd.put_state_dict(client, state, prefix, keep=4, delta=True)
        assert sent == [0, 2 * DELTA_BLOCK_BYTES]  # rows 512..1023 and 1024..1535 of "a"
        assert_same(read(client, prefix, state), state)
        older = read(client, prefix, state, second)
        assert older["a"][700].sum() != state["a"][700].sum()
        assert torch.equal(older["b"], state["b"]) and older["step"] == 1
        assert [s.number for s in client.snapshots(prefix)] == [first, second, third]


def test_a_delta_snapshot_counts_what_it_shares_once(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ranks hold a delta snapshot's unchanged blocks once: its listing says what it stores anew (the
    rewritten blocks), and what the kept snapshots hold together counts the shared bytes once."""
    prefix = "d/sized"
    with connect(cluster.address) as client:
        state = model(3)
        first = spmd.put_state_dict(client, state, prefix, keep=2, delta=True)
        state["a"][1024:1536] = -1.0  # one delta block: four rank blocks
        second = spmd.put_state_dict(client, state, prefix, keep=2, delta=True)
        older, newer = client.snapshots(prefix)
        assert (older.number, newer.number) == (first, second)
        assert (older.delta_of, older.shared_nbytes) == (0, 0)
        assert newer.delta_of == first
        assert newer.shared_nbytes == newer.nbytes - DELTA_BLOCK_BYTES
        assert held_once([older, newer]) == {first: older.nbytes, second: DELTA_BLOCK_BYTES}
        assert held_once([newer]) == {second: newer.nbytes}  # alone, it holds every byte
        assert cli_main(["--coordinator", client.address, "snapshots", prefix]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"({DELTA_BLOCK_BYTES} new, the rest shared with snapshot {first})" in lines[1]
    assert lines[2] == (
        f"{prefix}\theld\t{older.nbytes + DELTA_BLOCK_BYTES} bytes "
        "(blocks shared between snapshots counted once)"
    )


def test_one_changed_tensor_on_every_read_path(cluster: LocalCluster, sent: list[int]) -> None:
    with connect(cluster.address) as client:
        state = model(3)
        spmd.put_state_dict(client, state, "d/tensor", delta=True)
        state["b"] = torch.randn(ROWS, WIDTH)
        state["scale"] = torch.tensor(-2.0)
        number = spmd.put_state_dict(client, state, "d/tensor", delta=True)
        assert sent == [ROWS * WIDTH * 4 + 4]
    for transport in ("shm", "bulk", "grpc"):
        with connect(cluster.address, transport=transport) as reader:
            assert_same(read(reader, "d/tensor", state), state)
            view = reader.snapshot("d/tensor", number)
            assert torch.equal(view["b"].fetch((0, 0), (ROWS, WIDTH)), state["b"]), transport
            assert torch.equal(view["a"].fetch((600, 0), (10, WIDTH)), state["a"][600:610])


def test_a_reader_of_delta_snapshots_maps_one_header_file_per_rank_and_opens_only_what_changed(
    cluster: LocalCluster,
) -> None:
    """The weight-sync loop with delta puts: each snapshot's tensors are new versions made of shared blocks,
    whose state words the ranks keep in slots of a header file; a same-host reader maps one such file per rank
    (a rank makes another only while 511 slots are in use) for all of them, opens only the versions that
    changed (an unchanged one is announced in the header of the version it copies, which the reader maps), and
    reads every snapshot bit for bit."""
    with connect(cluster.address, transport="shm") as client:
        state = model(5)
        spmd.put_state_dict(client, state, "d/slots", keep=2, delta=True)
        HEADER_FILES.clear()  # the shared cluster's files, mapped by earlier tests, forgotten
        before = client_metrics()
        steps = 8
        for step in range(
            steps
        ):  # "a" changes on both ranks every step, "b" never: a whole copy on each
            state["a"][step * 128] += 1.0
            state["a"][ROWS // 2 + step * 128] += 1.0
            spmd.put_state_dict(client, state, "d/slots", keep=2, delta=True)
            assert_same(read(client, "d/slots", state), state)
        after = client_metrics()
        assert len(client.ranks()) <= len(HEADER_FILES) < steps
        snapshot = client.snapshot("d/slots")
        shards = {key: len(snapshot[key].remote_shards()) for key in ("a", "b", "ids", "scale")}
        unchanged = shards["b"] + shards["ids"] + shards["scale"]
        # the first delta snapshot opened whole (the full put before it was not read), then only "a" each step,
        # the unchanged tensors found as copies of the versions read the step before
        assert after["shm_copies"] - before["shm_copies"] == unchanged * (steps - 1)
        assert after["shm_opens"] - before["shm_opens"] == sum(shards.values()) + shards["a"] * (
            steps - 1
        )


def test_changed_shape_puts_in_full(cluster: LocalCluster, sent: list[int]) -> None:
    with connect(cluster.address) as client:
        state = model(4)
        spmd.put_state_dict(client, state, "d/shape", delta=True)
        state["a"] = torch.randn(ROWS + 1, WIDTH)
        spmd.put_state_dict(client, state, "d/shape", delta=True)
        assert sent == []
        assert_same(read(client, "d/shape", state), state)
        state["a"][0] = 0.0
        spmd.put_state_dict(client, state, "d/shape", delta=True)
        assert sent == [DELTA_BLOCK_BYTES]
        assert_same(read(client, "d/shape", state), state)


def test_newer_or_dropped_previous_snapshot_puts_in_full(
    cluster: LocalCluster, sent: list[int]
) -> None:
    with connect(cluster.address) as client, connect(cluster.address) as other:
        state = model(5)
        spmd.put_state_dict(client, state, "d/newer", delta=True)
        spmd.put_state_dict(other, model(6), "d/newer")  # not the newest any more
        spmd.put_state_dict(client, state, "d/newer", delta=True)
        assert sent == []
        assert_same(read(client, "d/newer", state), state)
        spmd.put_state_dict(client, state, "d/dropped", keep=1, delta=True)
        spmd.put_state_dict(other, model(9), "d/dropped", keep=1)  # drops the client's snapshot
        spmd.put_state_dict(client, state, "d/dropped", keep=1, delta=True)
        assert sent == []
        assert_same(read(client, "d/dropped", state), state)


def test_pinned_readers_read_the_older_snapshot_whole(
    cluster: LocalCluster, sent: list[int]
) -> None:
    with connect(cluster.address) as client, connect(cluster.address) as reader:
        state = model(7)
        pinned_state = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
        }
        pinned = spmd.put_state_dict(client, state, "d/pinned", keep=8, delta=True)
        failures: list[str] = []
        stop = threading.Event()

        def read_pinned() -> None:
            while not stop.is_set():
                got = read(reader, "d/pinned", pinned_state, pinned)
                for key in ("a", "b"):
                    if not torch.equal(got[key], pinned_state[key]):
                        failures.append(key)

        thread = threading.Thread(target=read_pinned)
        thread.start()
        try:
            for row in range(0, ROWS, 300):
                state["a"][row] = float(row)
                spmd.put_state_dict(client, state, "d/pinned", keep=8, delta=True)
        finally:
            stop.set()
            thread.join()
        assert failures == [] and len(sent) == len(range(0, ROWS, 300))
        assert_same(read(client, "d/pinned", state), state)
        assert_same(read(reader, "d/pinned", pinned_state, pinned), pinned_state)


def test_delta_with_a_cast_and_the_reservation(cluster: LocalCluster, sent: list[int]) -> None:
    with connect(cluster.address) as client:
        state = model(8)
        spmd.put_state_dict(
            client, state, "d/cast", dtype=torch.bfloat16
        )  # reserves the next snapshot
        spmd.put_state_dict(client, state, "d/cast", dtype=torch.bfloat16, delta=True)
        state["a"][5] = 3.0
        spmd.put_state_dict(client, state, "d/cast", dtype=torch.bfloat16, delta=True)
        assert sent == [DELTA_BLOCK_BYTES]  # bf16 rows of 1 KiB: rows 0..1023 of "a"
        cast = {
            k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in state.items()
            if isinstance(v, torch.Tensor)
        }
        got = read(client, "d/cast", {**cast, "step": None})
        assert_same({k: got[k] for k in cast}, cast)
        with pytest.raises(Exception, match="delta"):
            spmd.put_state_dict(client, state, "d/cast", delta="yes")  # type: ignore[arg-type]


def test_a_delta_puts_commit_reserves_the_copies_the_next_delta_put_fills(
    cluster: LocalCluster, sent: list[int], created: list[int]
) -> None:
    with connect(cluster.address) as client, connect(cluster.address, transport="grpc") as reader:
        state = model(21)
        numbers = [spmd.put_state_dict(client, state, "d/copies", keep=1, delta=True)]  # in full
        for step in range(4):
            state["a"][step * 600] = float(step)
            numbers.append(spmd.put_state_dict(client, state, "d/copies", keep=1, delta=True))
            assert_same(read(reader, "d/copies", state), state)
        # only the first delta put created its snapshot; each later one filled the copies the commit before reserved
        assert created == [1] and numbers == sorted(numbers)
        assert sent == [DELTA_BLOCK_BYTES] * 4
        reservation = client.session.reservations.take("d/copies")
        assert reservation is not None and reservation.snapshot.delta_of == numbers[-1]
        client.session.reservations.keep("d/copies", reservation)
        held = {
            numbers[-1],
            reservation.snapshot.number,
        }  # the older ones dropped after the commits answered
        wait_until(
            lambda: held_numbers(cluster.address, "d/copies") == held, 30, "kept and reserved"
        )
        # another shape: the copies are given back and the put is made in full
        other = {**state, "a": torch.randn(ROWS + 8, WIDTH)}
        number = spmd.put_state_dict(client, other, "d/copies", keep=1, delta=True)
        assert_same(read(reader, "d/copies", other), other)
        wait_until(lambda: held_numbers(cluster.address, "d/copies") == {number}, 30, "the new one")
    assert created == [1]


def test_reserved_copies_aborted_under_their_writer_are_made_again_and_read_back(
    cluster: LocalCluster, sent: list[int], created: list[int]
) -> None:
    """Another client aborts the copies a delta put's commit reserved (as the pending timeout would): the next
    delta put fails to fill them, copies the previous snapshot again, and reads back bit for bit."""
    with connect(cluster.address) as client, connect(cluster.address) as other:
        state = model(22)
        spmd.put_state_dict(client, state, "d/aborted", keep=1, delta=True)  # in full
        state["b"][7] = 7.0
        spmd.put_state_dict(client, state, "d/aborted", keep=1, delta=True)  # reserves copies
        reservation = client.session.reservations.take("d/aborted")
        assert reservation is not None and reservation.snapshot.delta_of > 0
        client.session.reservations.keep("d/aborted", reservation)
        number = reservation.snapshot.number
        other.session.call(
            "AbortSnapshot", pb.AbortSnapshotRequest(prefix="d/aborted", number=number)
        )
        state["b"][1500] = -7.0
        put = spmd.put_state_dict(client, state, "d/aborted", keep=1, delta=True)
        assert created == [1, 1] and put > number  # the copies made again, in a new snapshot
        assert sent[-1] == DELTA_BLOCK_BYTES  # still only the changed block
        assert_same(read(other, "d/aborted", state), state)


def _delta_counts() -> tuple[int, int]:
    """(delta puts that sent only what changed, bytes they sent) of this process so far: the client's metrics."""
    now = client_metrics()
    return now["delta_puts"], now["delta_bytes"]


def _put_delta(
    client: Cluster, name: str, tensor: torch.Tensor, *, delta: bool | str = True, **options: Any
) -> tuple[int, int, int]:
    """Put `tensor` with `delta`; (its version, delta puts made by it, bytes it sent as changed blocks)."""
    puts, sent = _delta_counts()
    version = client.put(name, tensor, overwrite=True, delta=delta, **options).version
    after_puts, after_sent = _delta_counts()
    return version, after_puts - puts, after_sent - sent


def test_a_tensor_put_with_delta_sends_only_its_changed_blocks(cluster: LocalCluster) -> None:
    with connect(cluster.address) as client, connect(cluster.address, transport="grpc") as reader:
        table = torch.randn(ROWS, WIDTH)
        first, deltas, _ = _put_delta(client, "d/table", table, replicas=2, durable=False)
        assert deltas == 0  # nothing to compare with: in full
        second, deltas, sent = _put_delta(client, "d/table", table, replicas=2, durable=False)
        assert second > first and (deltas, sent) == (1, 0)
        table[1500] = -1.0
        third, deltas, sent = _put_delta(client, "d/table", table, replicas=2, durable=False)
        assert (deltas, sent) == (1, 2 * DELTA_BLOCK_BYTES)  # one block, on both copies
        for proxy in (client.tensor("d/table"), reader.tensor("d/table")):
            assert proxy.version == third
            assert torch.equal(proxy.fetch((0, 0), (ROWS, WIDTH)), table)


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_shard_changed_whole_goes_in_one_call_through_memory_or_in_requests_of_a_few_mib(
    cluster: LocalCluster, transport: str
) -> None:
    """Over the network a shard's changed bytes are cut into requests of at most 4 MiB (a 6 MiB shard: two),
    through memory they go at once; both read back bit for bit."""
    name = f"d/whole-{transport}"
    with connect(cluster.address, transport=transport) as client:
        table = torch.randn(3 * ROWS, WIDTH)  # 12 MiB: a 6 MiB shard on each rank
        _put_delta(client, name, table, durable=False)
        table.add_(1.0)
        version, deltas, sent = _put_delta(client, name, table, durable=False)
        assert (deltas, sent) == (1, table.numel() * 4)
        proxy = client.tensor(name)
        assert proxy.version == version
        assert torch.equal(proxy.fetch((0, 0), (3 * ROWS, WIDTH)), table)


def test_a_tensor_delta_puts_in_full_after_another_writer_or_a_new_layout(
    cluster: LocalCluster,
) -> None:
    with connect(cluster.address) as client, connect(cluster.address) as other:
        table = torch.randn(ROWS, WIDTH)
        _put_delta(client, "d/shared", table, durable=False)
        changed = table + 1
        other.put("d/shared", changed, overwrite=True, durable=False)
        version, deltas, _ = _put_delta(client, "d/shared", table, durable=False)
        assert deltas == 0  # the version it would copy is not the READY one any more
        assert torch.equal(client.tensor("d/shared").fetch((0, 0), (ROWS, WIDTH)), table)
        wider = torch.randn(ROWS, WIDTH * 2)
        _, deltas, _ = _put_delta(client, "d/shared", wider, durable=False)
        assert deltas == 0
        assert torch.equal(client.tensor("d/shared").fetch((0, 0), (ROWS, WIDTH * 2)), wider)
        _, deltas, _ = _put_delta(client, "d/shared", wider, dtype=torch.bfloat16, durable=False)
        assert deltas == 0  # another stored dtype: another layout
        got = client.tensor("d/shared").fetch((0, 0), (ROWS, WIDTH * 2))
        assert torch.equal(got, wider.to(torch.bfloat16))


def test_a_tensor_delta_reads_like_a_full_put_while_a_reader_holds_the_older_version(
    cluster: LocalCluster,
) -> None:
    with connect(cluster.address) as client, connect(cluster.address) as reader:
        table = torch.randn(ROWS, WIDTH)
        _put_delta(client, "d/pinned", table, durable=False)
        pinned = reader.tensor("d/pinned")
        before = table.clone()
        table[:8] = 0.0
        _, deltas, sent = _put_delta(client, "d/pinned", table, durable=False)
        assert (deltas, sent) == (1, DELTA_BLOCK_BYTES)
        assert torch.equal(pinned.fetch((0, 0), (ROWS, WIDTH)), before)  # its version, whole
        assert torch.equal(reader.tensor("d/pinned").fetch((0, 0), (ROWS, WIDTH)), table)


def test_delta_needs_overwrite(cluster: LocalCluster) -> None:
    with connect(cluster.address) as client:
        with pytest.raises(InvalidArgumentError, match="overwrite=True"):
            client.put("d/bad", torch.zeros(4), delta=True)
        with pytest.raises(InvalidArgumentError, match="delta"):
            client.put("d/bad", torch.zeros(4), overwrite=True, delta="yes")


def _hashed_bytes() -> int:
    return int(client_metrics()["delta_hashed_bytes"])


def test_trusting_version_counters_reads_only_what_torch_saw_written(
    cluster: LocalCluster, sent: list[int]
) -> None:
    """delta="version_counters": an unchanged tensor is not read, one written in place (an optimizer's step) is
    read and its changed blocks sent, one replaced by a new tensor of the same shape is read; every snapshot
    reads back bit for bit. A write torch does not count (through `.data`) is not sent: the documented limit,
    which delta=True (reading every byte) does see."""
    layer = torch.nn.Linear(WIDTH, ROWS)  # weight: ROWS x WIDTH fp32, 4 MiB
    state = {"w": layer.weight.detach(), "b": torch.randn(ROWS, WIDTH), "step": 0}
    prefix, mode = "d/trusted", "version_counters"
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state, prefix, keep=2, delta=mode)  # in full
        before = _hashed_bytes()
        spmd.put_state_dict(client, state, prefix, keep=2, delta=mode)
        assert _hashed_bytes() == before and sent == [0]  # nothing read, nothing sent
        layer(torch.ones(1, WIDTH)).sum().backward()
        torch.optim.SGD(layer.parameters(), lr=0.5).step()
        state["w"] = (
            layer.weight.detach()
        )  # as state_dict() hands it out: a new tensor, the same storage
        before = _hashed_bytes()
        spmd.put_state_dict(client, state, prefix, keep=2, delta=mode)
        assert _hashed_bytes() - before == ROWS * WIDTH * 4 and sent[-1] > 0
        assert_same(read(client, prefix, state), state)
        state["b"] = state["b"].clone()
        state["b"][0] = 3.0
        before = _hashed_bytes()
        spmd.put_state_dict(client, state, prefix, keep=2, delta=mode)
        assert _hashed_bytes() - before == ROWS * WIDTH * 4 and sent[-1] == DELTA_BLOCK_BYTES
        assert_same(read(client, prefix, state), state)
        layer.weight.data[0] = 5.0  # not counted by torch
        spmd.put_state_dict(client, state, prefix, keep=2, delta=mode)
        assert sent[-1] == 0 and read(client, prefix, state)["w"][0].ne(5.0).all()
        spmd.put_state_dict(client, state, prefix, keep=2, delta=True)
        assert sent[-1] == DELTA_BLOCK_BYTES
        assert_same(read(client, prefix, state), state)


def test_a_tensor_put_trusting_version_counters(cluster: LocalCluster) -> None:
    with connect(cluster.address) as client:
        table = torch.randn(ROWS, WIDTH)
        mode = "version_counters"
        client.put("d/trusted-table", table, overwrite=True, delta=mode, durable=False)
        before = _hashed_bytes()
        _, deltas, sent = _put_delta(client, "d/trusted-table", table, delta=mode, durable=False)
        assert (deltas, sent, _hashed_bytes() - before) == (1, 0, 0)
        table[1500] = -1.0
        version, deltas, sent = _put_delta(
            client, "d/trusted-table", table, delta=mode, durable=False
        )
        assert (deltas, sent) == (1, DELTA_BLOCK_BYTES)
        proxy = client.tensor("d/trusted-table")
        assert proxy.version == version
        assert torch.equal(proxy.fetch((0, 0), (ROWS, WIDTH)), table)
