"""The policy asks for a path by the capabilities it declares, never by which path it is: fake paths that
declare capabilities are used for them, and each concrete path declares what it does."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import torch

from shardserve.client.errors import ShardServeError
from shardserve.client.info import RankStatus
from shardserve.client.paths.factory import data_paths
from shardserve.client.paths.kinds import (
    CPU_AND_CUDA,
    Capabilities,
    PathKind,
    parse_transport,
)
from shardserve.client.paths.pipeline import NetworkCall
from shardserve.client.paths.policy import PathPolicy

STREAMED = Capabilities(devices=CPU_AND_CUDA, rank_calls=True, streamed=True)


class FakePath:
    """A data path that declares `capabilities` and records what it is asked."""

    def __init__(self, kind: PathKind, capabilities: Capabilities) -> None:
        self.kind = kind
        self.capabilities = capabilities
        self.asked: list[tuple[str, Any]] = []
        self.closed = False
        self.in_place_host_id = f"host-of-{kind}"

    def supports(self, rank: RankStatus, summary: object = None) -> bool:
        return True

    def refusal(self, rank: RankStatus) -> ShardServeError:
        return ShardServeError(f"the fake {self.kind} path cannot serve rank {rank.rank}")

    def read(self, address: str, read: object, cancel: object = None) -> None:
        self.asked.append(("read", address))

    def write_shards(self, address: str, writes: object) -> int:
        self.asked.append(("write", address))
        return 0

    def close(self) -> None:
        self.closed = True

    def read_rows(
        self, address: str, summary: object, index: int, local_rows: torch.Tensor
    ) -> torch.Tensor:
        self.asked.append(("rows", local_rows.tolist()))
        return torch.full((local_rows.numel(), 2), float(index))


def _rank(number: int = 0) -> RankStatus:
    return RankStatus(number, f"10.0.0.{number}:1", "cpu", "elsewhere", True, 0, 0, 1, 0.0)


def _summary(first_row: int) -> Any:
    shard = SimpleNamespace(shard_offsets=(first_row, 0))
    return SimpleNamespace(name="table", metadata=SimpleNamespace(shards_metadata=[shard]))


def _policy(*paths: FakePath, transport: str = "auto") -> PathPolicy:
    return PathPolicy(parse_transport(transport), channel=None, paths=paths)


def _run_now(job):  # type: ignore[no-untyped-def]
    future: Future = Future()
    future.set_result(job())
    return future


def test_a_path_with_row_reads_that_is_not_shared_memory_serves_lookups() -> None:
    rows = FakePath(PathKind.BULK, Capabilities(row_reads=True, rank_calls=True))
    policy = _policy(rows, FakePath(PathKind.GRPC, STREAMED))
    answer = policy.lookup_rows(_rank(), _summary(first_row=5), 0, torch.tensor([5, 9, 7]))
    assert answer is not None and answer.shape == (3, 2)
    assert rows.asked == [("rows", [0, 4, 2])]  # ids made local to the shard
    assert policy.row_reader(_rank()) is rows
    assert not policy.maps(_rank())  # reading rows is not mapping memory


def test_a_path_without_row_reads_is_never_asked_for_rows() -> None:
    network = FakePath(PathKind.BULK, Capabilities(rank_calls=True, pipelined=True))
    policy = _policy(network, FakePath(PathKind.GRPC, STREAMED))
    assert policy.lookup_rows(_rank(), _summary(first_row=0), 0, torch.tensor([1])) is None
    assert policy.row_reader(_rank()) is None and network.asked == []


def _calls(events: list[tuple[str, int, object]]) -> list[NetworkCall]:
    def send(number: int, path: object, cancel: object = None):  # type: ignore[no-untyped-def]
        events.append(("send", number, path))
        return lambda: events.append(("answer", number, path))

    def call(number: int, path: object, cancel: object = None) -> None:
        events.append(("call", number, path))

    return [
        NetworkCall(_rank(n), lambda path, cancel, n=n: send(n, path), lambda p, c, n=n: call(n, p))
        for n in (0, 1)
    ]


def test_a_path_without_pipelining_is_never_pipelined() -> None:
    unpipelined = FakePath(PathKind.BULK, Capabilities(rank_calls=True))
    streamed = FakePath(PathKind.GRPC, STREAMED)
    policy = _policy(unpipelined, streamed)
    events: list[tuple[str, int, object]] = []
    assert policy.send_all(_calls(events), _run_now).wait() == [PathKind.GRPC, PathKind.GRPC]
    assert sorted(events, key=str) == [("call", 0, streamed), ("call", 1, streamed)]


def test_a_path_that_declares_pipelining_gets_every_request_before_any_answer() -> None:
    pipelined = FakePath(PathKind.BULK, Capabilities(rank_calls=True, pipelined=True))
    policy = _policy(pipelined, FakePath(PathKind.GRPC, STREAMED))
    events: list[tuple[str, int, object]] = []
    assert policy.send_all(_calls(events), _run_now).wait() == [PathKind.BULK, PathKind.BULK]
    assert [event[:2] for event in events] == [
        ("send", 0),
        ("send", 1),
        ("answer", 0),
        ("answer", 1),
    ]
    assert all(path is pipelined for _, _, path in events)


def test_mapped_reads_and_the_devices_they_reach_come_from_the_first_path() -> None:
    mapping = FakePath(PathKind.SHARED_MEMORY, Capabilities(devices=CPU_AND_CUDA, maps_memory=True))
    policy = _policy(mapping, FakePath(PathKind.GRPC, STREAMED))
    assert policy.maps(_rank()) and policy.mapped_devices(_rank()) == {"cpu", "cuda"}
    network_only = _policy(FakePath(PathKind.GRPC, STREAMED))
    assert not network_only.maps(_rank()) and network_only.mapped_devices(_rank()) == frozenset()


def test_in_place_writes_come_from_the_path_that_declares_them() -> None:
    writer = FakePath(PathKind.BULK, Capabilities(in_place_writes=True, rank_calls=True))
    assert _policy(writer, FakePath(PathKind.GRPC, STREAMED)).in_place_host() == "host-of-bulk"
    assert _policy(FakePath(PathKind.GRPC, STREAMED)).in_place_host() == ""
    assert PathPolicy(parse_transport("bulk"), channel=None).in_place_host() == ""


def test_the_network_chain_is_the_paths_that_take_rank_calls() -> None:
    assert PathPolicy(None, channel=None).network.kinds == (PathKind.BULK, PathKind.GRPC)
    forced_shm = PathPolicy(parse_transport("shm"), channel=None)
    assert forced_shm.network.kinds == (PathKind.GRPC,) and not forced_shm.network.forced
    forced_tcp = PathPolicy(parse_transport("bulk"), channel=None)
    assert forced_tcp.network.kinds == (PathKind.BULK,) and forced_tcp.network.forced


def test_close_closes_every_path() -> None:
    paths = (FakePath(PathKind.SHARED_MEMORY, Capabilities()), FakePath(PathKind.GRPC, STREAMED))
    _policy(*paths).close()
    assert all(path.closed for path in paths)


def test_each_concrete_path_declares_what_it_does() -> None:
    shm, bulk, grpc_path = data_paths(None)
    assert [path.kind for path in (shm, bulk, grpc_path)] == list(PathKind)
    same_host = shm.capabilities
    assert same_host.maps_memory and same_host.row_reads and same_host.in_place_writes
    assert not same_host.rank_calls and not same_host.pipelined
    assert same_host.reaches("cpu") and same_host.reaches("cuda") == torch.cuda.is_available()
    for method in ("read_rows", "host_mapping", "device_mapping", "limit", "in_place_host_id"):
        assert hasattr(shm, method)
    assert bulk.capabilities == Capabilities(devices=CPU_AND_CUDA, rank_calls=True, pipelined=True)
    for method in ("send_read", "send_lookup", "read_regions"):
        assert callable(getattr(bulk, method))
    assert grpc_path.capabilities == STREAMED
    for method in ("lookup", "read_regions"):
        assert callable(getattr(grpc_path, method))
    for path in (shm, bulk, grpc_path):
        path.close()
