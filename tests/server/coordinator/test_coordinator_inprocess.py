"""The coordinator in-process (reconcile, checkpoint saves): a real SQLite catalog, one rank answered by a
recording stand-in stub.

What the rank holds is compared with the catalog after a (re)registration: a
version it lost is kept, its copies marked lost; a version put on the rank
after its snapshot of what it holds must not be taken for lost (it is READY in
the catalog, yet not in the snapshot).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from waiting import wait_until

from shardserve.client.new_tensor import NewTensor
from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import TensorNotFound
from shardserve.server.coordinator.catalog.records import TensorRecord, TensorState
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.drivers.orders import (
    CommitOrder,
    ReshardOrder,
    SaveOrder,
    SnapshotOrder,
)
from shardserve.server.coordinator.options import CoordinatorOptions
from shardserve.server.coordinator.ranks.encoded import Encoded
from shardserve.server.coordinator.ranks.info import RankInfo
from shardserve.server.coordinator.role import CoordinatorRole
from shardserve.server.coordinator.server import CoordinatorServer
from shardserve.server.coordinator.service import CoordinatorServicer, new_tensor


class RankStub:
    """What rank 0 answers: GetStats from `held`, and a record of the drops and promotions asked of it."""

    def __init__(
        self, held: set[tuple[str, int]], served: frozenset[tuple[str, int]] = frozenset()
    ) -> None:
        self.held = held
        self.served = served  # of `held`, those GetStats says it serves
        self.calls: list[tuple[str, str, int]] = []
        self.batches: list[
            tuple[str, int]
        ] = []  # (method, versions) of each PromoteMany / DropMany
        self.refuse_allocations = False
        self.refuse_promotions = False
        self.refuse_batches = False
        self.stats_asked = 0

    def GetStats(self, request, timeout):  # noqa: N802 - the stub's names
        self.stats_asked += 1
        return pb.GetStatsResponse(
            held=[
                pb.HeldVersion(name=n, version=v, served=(n, v) in self.served)
                for n, v in sorted(self.held)
            ]
        )

    def DropVersion(self, request, timeout):  # noqa: N802
        self.calls.append(("drop", request.name, request.version))
        return pb.DropVersionResponse()

    def PromoteVersion(self, request, timeout):  # noqa: N802
        self.calls.append(("promote", request.name, request.version))
        if self.refuse_promotions:
            raise RankRefusal()
        return pb.PromoteVersionResponse()

    def AllocateShards(self, request, timeout):  # noqa: N802
        self.calls.append(("allocate", request.name, request.version))
        return pb.AllocateShardsResponse()

    def DropMany(self, request, timeout):  # noqa: N802
        request = _parsed(request, pb.DropManyRequest)
        self.batches.append(("DropMany", len(request.versions)))
        for one in request.versions:
            self.DropVersion(one, timeout)
        return pb.DropManyResponse()

    def PromoteMany(self, request, timeout):  # noqa: N802
        request = _parsed(request, pb.PromoteManyRequest)
        self.batches.append(("PromoteMany", len(request.versions)))
        if self.refuse_batches:
            raise RankRefusal()
        for one in request.versions:
            self.PromoteVersion(one, timeout)
        return pb.PromoteManyResponse()

    def AllocateMany(self, request, timeout):  # noqa: N802
        request = _parsed(request, pb.AllocateManyRequest)
        for one in request.drop_first:
            self.DropVersion(one, timeout)
        if self.refuse_allocations:
            raise RankRefusal()
        for one in request.tensors:
            self.AllocateShards(one, timeout)
        return pb.AllocateManyResponse()


def _parsed(request, kind):  # type: ignore[no-untyped-def]
    """A batch request as a rank reads it off the wire: the coordinator sends those as encoded bytes."""
    return kind.FromString(request.data) if isinstance(request, Encoded) else request


class AsStub:
    """A stand-in's methods as a gRPC stub's are: called, or issued with `.future(...)` (the coordinator fans
    out that way), which answers a future already done."""

    def __init__(self, stub: RankStub) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._stub, name))


class _Method:
    def __init__(self, call) -> None:  # type: ignore[no-untyped-def]
        self._call = call

    def __call__(self, request, timeout):  # type: ignore[no-untyped-def]
        return self._call(request, timeout)

    def future(self, request, timeout) -> futures.Future:  # type: ignore[no-untyped-def]
        done: futures.Future = futures.Future()
        try:
            done.set_result(self._call(request, timeout))
        except grpc.RpcError as err:
            done.set_exception(err)
        return done


class RankRefusal(grpc.RpcError):
    """A rank's RESOURCE_EXHAUSTED answer, as the stub raises it."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "rank 0 memory limit"


@pytest.fixture
def coordinator(tmp_path):
    coord = CoordinatorServer(SQLiteCatalog(tmp_path / "catalog.sqlite")).start()
    yield coord
    coord.close()


def _layout() -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (4, 4), TensorProperties(dtype=torch.float32)
    )


def _metadata() -> pb.ShardedTensorMetadata:
    return metadata_to_proto(_layout())


def _ready(coord: CoordinatorServer, name: str) -> TensorRecord:
    record = TensorRecord(
        name=name,
        version=coord.catalog.next_versions(1)[0],
        metadata=_layout(),
        created_unix=time.time(),
    )
    coord.catalog.add(record)
    return coord.catalog.commit(name, record.version)[0]


def _create(coord: CoordinatorServer, request: pb.CreateTensorRequest) -> pb.TensorInfo:
    """CreateTensor as the servicer runs it, errors raised rather than answered."""
    made = coord.lifecycle.create(new_tensor(request))
    return coord.answers.tensor(made.value, made.update_order)


def _health(coord: CoordinatorServer, name: str) -> str:
    return coord.answers.tensor(coord.lifecycle.get(name)).health


def _rank(coord: CoordinatorServer, stub: RankStub) -> None:
    """Register rank 0 of a world of one, called through `stub`."""
    coord.registry.stub_of = lambda channel: AsStub(stub)  # type: ignore[assignment, return-value]
    coord.registry.register(
        RankInfo(rank=0, address="127.0.0.1:1", device="cpu", world_size=1, pid=1), []
    )


def test_a_version_put_after_the_ranks_snapshot_is_not_taken_for_lost(coordinator):
    put_meanwhile, lost, kept = (
        _ready(coordinator, "new"),
        _ready(coordinator, "lost"),
        _ready(coordinator, "kept"),
    )
    stray = ("stray", 999)
    stub = RankStub(
        {("new", put_meanwhile.version), ("kept", kept.version), stray}
    )  # asked again: the rank now
    _rank(coordinator, stub)
    snapshot = {
        ("kept", kept.version),
        stray,
    }  # what it said when it registered, before "new" was put
    coordinator.upkeep.reconciler.reconcile(0, snapshot)
    names = {info.name for info in coordinator.catalog.list()}
    assert names == {"new", "kept", "lost"}  # a tensor is never forgotten because a rank lost it
    lost_shards = {info.name: list(info.lost_shards) for info in coordinator.catalog.list()}
    assert lost_shards == {
        "new": [],
        "kept": [],
        "lost": [0],
    }  # only the one the rank still does not hold
    assert _health(coordinator, "lost") == "lost" and _health(coordinator, "kept") == "healthy"
    assert ("drop", "stray", 999) in stub.calls and ("drop", "lost", lost.version) not in stub.calls
    assert ("promote", "kept", kept.version) in stub.calls
    assert not any(call[1] == "new" for call in stub.calls)


def test_nothing_is_forgotten_when_the_rank_cannot_say_what_it_holds(coordinator):
    info = _ready(coordinator, "t")

    class Silent(RankStub):
        def GetStats(self, request, timeout):  # noqa: N802
            raise grpc.RpcError()

    stub = Silent(set())
    _rank(coordinator, stub)
    coordinator.upkeep.reconciler.reconcile(0, set())
    assert coordinator.catalog.get("t", info.version) is not None and stub.calls == []


def test_a_reconcile_promotes_in_one_call_and_drops_in_one_call(coordinator):
    """The READY versions the rank holds are promoted again with one PromoteMany, the versions the catalog does
    not know dropped with one DropMany; versions on other ranks are not read as the rank's."""
    mine = [_ready(coordinator, f"t{i}") for i in range(20)]
    coordinator.catalog.add(
        TensorRecord(
            name="elsewhere",
            version=coordinator.catalog.next_versions(1)[0],
            metadata=ChunkShardingSpec(0, ["rank:3/cpu"]).build_metadata((4, 4)),
        )
    )
    strays = {("stray", 990 + i) for i in range(5)}
    held = {(r.name, r.version) for r in mine} | strays
    stub = RankStub(held)
    _rank(coordinator, stub)
    coordinator.upkeep.reconciler.reconcile(0, held)
    assert stub.batches == [("PromoteMany", 20), ("DropMany", 5)]
    assert {(n, v) for what, n, v in stub.calls if what == "promote"} == held - strays
    assert {(n, v) for what, n, v in stub.calls if what == "drop"} == strays


def test_a_registering_rank_has_only_the_versions_it_does_not_serve_promoted_again(coordinator):
    """After a coordinator's restart its ranks register serving what they held (HeldVersion.served): the
    reconcile promotes again only the READY versions a rank holds without serving them (restored from its disk,
    or a commit the coordinator died in), where it used to promote every one."""
    held = sorted((r.name, r.version) for r in (_ready(coordinator, f"t{i}") for i in range(4)))
    stub = RankStub(set(held))
    coordinator.registry.stub_of = lambda channel: AsStub(stub)  # type: ignore[assignment, return-value]
    request = pb.RegisterRankRequest(
        rank=pb.RankInfo(rank=0, address="127.0.0.1:1", device="cpu", world_size=1, pid=1),
        held=[pb.HeldVersion(name=n, version=v, served=i < 3) for i, (n, v) in enumerate(held)],
    )
    CoordinatorServicer(CoordinatorRole.sole(coordinator)).RegisterRank(request, None)  # type: ignore[arg-type]
    wait_until(lambda: stub.batches, 30.0, "the reconcile's promotion")
    assert stub.batches == [("PromoteMany", 1)]
    assert [(n, v) for what, n, v in stub.calls if what == "promote"] == [held[3]]


def test_a_failed_batch_promotion_is_done_one_version_at_a_time(coordinator):
    versions = [_ready(coordinator, f"t{i}") for i in range(3)]
    held = {(r.name, r.version) for r in versions}
    stub = RankStub(held)
    stub.refuse_batches = True
    _rank(coordinator, stub)
    coordinator.upkeep.reconciler.reconcile(0, held)
    assert stub.batches == [("PromoteMany", 3)]
    assert {(n, v) for what, n, v in stub.calls if what == "promote"} == held


def test_registrations_arriving_together_ask_for_few_promotion_rounds(coordinator, monkeypatch):
    """While the background pool is busy, the registrations of many ranks queue one round of finishing reshard
    promotions, not one each: with both workers held in a round, at most one more waits."""
    release, rounds, reconciled = threading.Event(), [], []

    def finish_promotions() -> None:
        rounds.append(1)
        release.wait(30.0)

    monkeypatch.setattr(coordinator.reshards, "finish_promotions", finish_promotions)
    reconcile = coordinator.upkeep.reconciler.reconcile
    monkeypatch.setattr(
        coordinator.upkeep.reconciler,
        "reconcile",
        lambda rank, held, **served: reconcile(rank, held, **served) or reconciled.append(rank),
    )
    coordinator.registry.stub_of = lambda channel: AsStub(RankStub(set()))  # type: ignore[assignment, return-value]
    for rank in range(20):
        coordinator.upkeep.register(
            RankInfo(rank=rank, address=f"127.0.0.1:{7100 + rank}", device="cpu", world_size=20), []
        )
    release.set()
    wait_until(
        lambda: len(reconciled) == 20, 30.0, "every rank reconciled"
    )  # queued with the rounds
    assert 1 <= len(rounds) <= 3


def test_a_rank_back_from_the_dead_is_reconciled_only_when_it_missed_a_call(tmp_path, caplog):
    """A heartbeat late past dead_after (a loaded host) brings the rank back with nothing to reconcile: reading
    its rows would cost the coordinator most when it is loaded already. A drop skipped while it was dead makes
    its comeback reconcile it: the drop is sent then."""
    options = CoordinatorOptions(dead_after=0.2)
    coord = CoordinatorServer(SQLiteCatalog(tmp_path / "catalog.sqlite"), options=options).start()
    try:
        stub = RankStub({("gone", 5)})  # a version the catalog no longer has
        _rank(coord, stub)
        wait_until(lambda: not coord.registry.rank_alive(0), 10.0, "rank 0 taken for dead")
        with caplog.at_level(logging.INFO, logger="shardserve.server.coordinator.upkeep"):
            coord.upkeep.heartbeat(0, 0)
        assert "no call to it was missed" in caplog.text and stub.stats_asked == 0
        wait_until(lambda: not coord.registry.rank_alive(0), 10.0, "rank 0 taken for dead again")
        coord.calls.drop_quietly("gone", 5, [0])  # skipped: rank 0 is not alive
        assert stub.calls == []
        coord.upkeep.heartbeat(0, 0)
        wait_until(lambda: ("drop", "gone", 5) in stub.calls, 10.0, "the missed drop sent")
        assert stub.stats_asked == 1
    finally:
        coord.close()


@pytest.mark.parametrize("marks_served", [True, False], ids=["served marked", "an older rank"])
def test_a_rank_back_from_the_dead_has_only_the_versions_it_does_not_serve_promoted_again(
    tmp_path, marks_served
):
    """A rank that was taken for dead and missed a call is reconciled from what GetStats says it holds: the
    READY versions it serves are left alone (a SIGSTOPped rank serves all it held), the one it holds unserved is
    promoted again, and the unknown one it missed the drop of is dropped. A rank that marks none served (one
    from before the flag) has every READY version it holds promoted again, as before."""
    options = CoordinatorOptions(dead_after=0.2)
    coord = CoordinatorServer(SQLiteCatalog(tmp_path / "catalog.sqlite"), options=options).start()
    try:
        ready = sorted((r.name, r.version) for r in (_ready(coord, f"t{i}") for i in range(3)))
        served = frozenset(ready[:2]) if marks_served else frozenset()
        stub = RankStub({*ready, ("gone", 5)}, served=served)
        _rank(coord, stub)
        wait_until(lambda: not coord.registry.rank_alive(0), 10.0, "rank 0 taken for dead")
        coord.calls.drop_quietly("gone", 5, [0])  # skipped: rank 0 is not alive
        coord.upkeep.heartbeat(0, 0)
        wait_until(lambda: ("drop", "gone", 5) in stub.calls, 10.0, "the missed drop sent")
        promoted = [(n, v) for what, n, v in stub.calls if what == "promote"]
        assert sorted(promoted) == ([ready[2]] if marks_served else ready)
        assert stub.batches == [("PromoteMany", len(promoted)), ("DropMany", 1)]
    finally:
        coord.close()


def test_a_failed_save_leaves_the_checkpoint_that_was_there(coordinator, tmp_path, monkeypatch):
    """The ranks write into a staging directory inside the path; a job that fails half way (one rank's file
    written) is removed whole, and the old checkpoint's files are untouched."""
    from shardserve.server.coordinator.drivers.collectives import CollectiveJobError

    _rank(coordinator, RankStub(set()))
    _ready(coordinator, "t")
    path = tmp_path / "ck"
    path.mkdir()
    old = {".metadata": b"old metadata", "__0_0.distcp": b"old data", "notes.txt": b"mine"}
    for name, data in old.items():
        (path / name).write_bytes(data)

    def failing_job(job, ranks, what):  # type: ignore[no-untyped-def]
        staging = job.path
        assert os.path.dirname(staging) == str(path) and os.path.basename(staging).startswith(
            ".saving-"
        )
        with open(os.path.join(staging, "__0_0.distcp"), "wb") as f:
            f.write(b"half of the new data")
        yield 1, 2
        raise CollectiveJobError("checkpoint save failed: rank 1: disk full")

    monkeypatch.setattr(coordinator.collectives, "run", failing_job)
    with pytest.raises(CollectiveJobError, match="disk full"):
        list(coordinator.checkpoints.save(SaveOrder(str(path), ("t",))))
    assert {p.name: p.read_bytes() for p in path.iterdir()} == old


def test_publish_replaces_the_checkpoint_and_keeps_other_files(tmp_path):
    from shardserve.server.coordinator.drivers.checkpoint import replace_checkpoint

    path, staging = tmp_path / "ck", tmp_path / "ck" / ".saving-x"
    staging.mkdir(parents=True)
    for name, data in {
        ".metadata": b"old",
        "__0_0.distcp": b"old 0",
        "__2_0.distcp": b"old 2",
        "notes.txt": b"mine",
    }.items():
        (path / name).write_bytes(data)
    for name, data in {
        ".metadata": b"new",
        "__0_0.distcp": b"new 0",
        "__1_0.distcp": b"new 1",
    }.items():
        (staging / name).write_bytes(data)
    replace_checkpoint(str(staging), str(path))
    assert {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()} == {
        ".metadata": b"new",
        "__0_0.distcp": b"new 0",
        "__1_0.distcp": b"new 1",
        "notes.txt": b"mine",
    }
    assert list(staging.iterdir()) == []


def test_a_change_waits_for_a_busy_tensor_only_so_long(coordinator, monkeypatch):
    """A reshard or checkpoint holds a tensor's lock for its whole run; a delete meanwhile is ABORTED after
    NAME_LOCK_WAIT_S instead of holding a gRPC worker without bound, and goes through once the lock is free."""
    import threading

    import shardserve.server.coordinator.drivers.locks as coordinator_module
    from shardserve.server.common.errors import TensorBusy

    _rank(coordinator, RankStub(set()))
    _ready(coordinator, "busy")
    monkeypatch.setattr(coordinator_module, "NAME_LOCK_WAIT_S", 0.2)
    held, release = threading.Event(), threading.Event()

    def long_change() -> None:
        with coordinator.locks.hold("busy"):
            held.set()
            release.wait(10)

    worker = threading.Thread(target=long_change)
    worker.start()
    assert held.wait(10)
    started = time.monotonic()
    with pytest.raises(TensorBusy, match="tensor 'busy' is busy") as err:
        coordinator.lifecycle.drop("busy")
    assert err.value.code == grpc.StatusCode.ABORTED and time.monotonic() - started < 5
    release.set()
    worker.join(10)
    coordinator.lifecycle.drop("busy")
    assert coordinator.catalog.ready("busy") is None


def _client_of(
    coord: CoordinatorServer,
    lose_create_answer: bool = False,
    create_runs: bool = True,
    sent: list | None = None,
):  # type: ignore[no-untyped-def]
    """A client Session whose coordinator calls go to `coord` in-process; CreateTensor's answer can be lost
    (DeadlineExceeded after the coordinator ran it, or before it ran when `create_runs` is False). Each
    CreateTensor request is added to `sent`."""
    from shardserve.client.errors import DeadlineExceededError
    from shardserve.client.session import Session

    def call(method, request):  # type: ignore[no-untyped-def]
        if method == "CreateTensor":
            if sent is not None:
                sent.append(request)
            info = _create(coord, request) if create_runs else None
            if lose_create_answer:
                raise DeadlineExceededError("coordinator: deadline exceeded")
            return info
        if method == "AbortTensor":
            return pb.AbortTensorResponse(
                version=coord.lifecycle.abort_put(request.name, request.put_token)
            )
        raise AssertionError(method)

    session = Session.__new__(Session)
    session.call = call  # type: ignore[method-assign]
    return session


def test_a_create_whose_answer_was_lost_is_aborted_by_its_put_token(coordinator):
    """The client cannot know the version a lost CreateTensor made; its put token finds and aborts it, so no
    pending version holds the ranks' memory (and blocks puts of the name) until the pending timeout."""
    from shardserve.client.errors import DeadlineExceededError

    stub = RankStub(set())
    _rank(coordinator, stub)
    cluster = _client_of(coordinator, lose_create_answer=True)
    with pytest.raises(DeadlineExceededError):
        cluster.create_tensor(NewTensor("t", _layout(), init="none"))
    assert coordinator.catalog.versions("t") == []
    (allocated,) = [call for call in stub.calls if call[0] == "allocate"]
    assert ("drop", "t", allocated[2]) in stub.calls


def test_an_abort_that_overtakes_its_create_wins(coordinator):
    """When the deadline passes before the coordinator ran CreateTensor, the abort comes first: the late
    CreateTensor with that token is refused, and allocates nothing."""
    from shardserve.client.errors import DeadlineExceededError
    from shardserve.server.common.errors import TensorBusy

    stub = RankStub(set())
    _rank(coordinator, stub)
    sent: list[pb.CreateTensorRequest] = []
    cluster = _client_of(coordinator, lose_create_answer=True, create_runs=False, sent=sent)
    with pytest.raises(DeadlineExceededError):
        cluster.create_tensor(NewTensor("t", _layout(), init="none"))
    (request,) = sent
    with pytest.raises(TensorBusy, match="put_token"):
        _create(coordinator, request)  # the call, arriving late
    assert coordinator.catalog.versions("t") == [] and stub.calls == []
    fresh = _client_of(coordinator).create_tensor(NewTensor("t", _layout()))
    assert fresh.state == pb.PENDING and fresh.put_token and fresh.put_token != request.put_token


def test_a_create_made_again_with_its_put_token_replaces_the_first_attempts_version(coordinator):
    """A CreateTensor made again with the same put token (its answer was lost: the coordinator that ran it died
    and the client asked the next leader) aborts the version the first attempt made and makes a new one; a
    create under another token still finds the put in progress."""
    from shardserve.server.common.errors import TensorExists

    stub = RankStub(set())
    _rank(coordinator, stub)
    request = pb.CreateTensorRequest(name="t", metadata=_metadata(), put_token="first-put")
    first = _create(coordinator, request)
    again = _create(coordinator, request)
    assert again.version > first.version and again.state == pb.PENDING
    assert [r.version for r in coordinator.catalog.versions("t")] == [again.version]
    assert ("drop", "t", first.version) in stub.calls
    other = pb.CreateTensorRequest(name="t", metadata=_metadata(), put_token="other-put")
    with pytest.raises(TensorExists, match="has a put in progress"):
        _create(coordinator, other)


def test_put_tokens_are_checked(coordinator):
    from shardserve.server.common.errors import InvalidArgument

    _rank(coordinator, RankStub(set()))
    assert coordinator.lifecycle.abort_put("t", "no-such-put") == 0
    for token, message in (
        ("", "put_token is empty"),
        ("x" * 129, "129 characters"),
        ("caf\u00e9", "ASCII"),
    ):
        with pytest.raises(InvalidArgument, match=message):
            coordinator.lifecycle.abort_put("t", token)
    with pytest.raises(InvalidArgument, match="put_token"):
        _create(coordinator, pb.CreateTensorRequest(name="t", metadata=_metadata(), put_token="\n"))
    made = _create(
        coordinator, pb.CreateTensorRequest(name="r", metadata=_metadata(), put_token="tok")
    )
    ready = coordinator.lifecycle.commit("r", made.version).value
    assert (
        ready.put_token == "tok" and coordinator.lifecycle.abort_put("r", "tok") == 0
    )  # a READY version is never aborted
    assert coordinator.catalog.get("r", ready.version).state == TensorState.READY


def test_name_locks_are_forgotten_once_unused(coordinator):
    """Every commit, abort or save of a name takes that name's lock; a lock per name ever asked about (unknown
    names included) would grow the coordinator without bound."""
    from shardserve.server.common.errors import TensorNotFound

    _rank(coordinator, RankStub(set()))
    for i in range(50):
        with pytest.raises(TensorNotFound):
            coordinator.lifecycle.commit(f"unknown-{i}", 1)
    assert coordinator.locks.names() == set()
    with coordinator.locks.hold("held"):
        assert coordinator.locks.names() == {"held"}
    assert coordinator.locks.names() == set()


def test_a_put_overtaken_by_a_newer_ready_version_is_aborted_not_hidden(coordinator):
    """A reshard or checkpoint load commits a newer version while a put's version is pending: committing the
    put would answer success yet never be served (readers take the newest READY version), so it is ABORTED
    and its shards dropped."""
    from shardserve.server.common.errors import TensorBusy

    stub = RankStub(set())
    _rank(coordinator, stub)
    put = _create(coordinator, pb.CreateTensorRequest(name="t", metadata=_metadata()))
    newer = _ready(coordinator, "t")  # the reshard's version, committed meanwhile
    with pytest.raises(
        TensorBusy,
        match=f"version {put.version} was overtaken while pending: version {newer.version}",
    ):
        coordinator.lifecycle.commit("t", put.version)
    assert [(r.version, r.state) for r in coordinator.catalog.versions("t")] == [
        (newer.version, TensorState.READY)
    ]
    assert ("drop", "t", put.version) in stub.calls and (
        "promote",
        "t",
        put.version,
    ) not in stub.calls


@pytest.mark.parametrize("replaced_by", ["put", "delete"])
def test_the_version_a_reshard_replaced_is_dropped_when_its_successor_goes_unpromoted(
    coordinator, monkeypatch, replaced_by
):
    """A reshard committed version b over a, and b's promotion is unfinished (a rank failed PromoteVersion):
    only the promotion would drop a. When b leaves the catalog first (a put commits over it, or a delete), a is
    dropped too, once, instead of staying served on the ranks with no catalog row."""
    stub = RankStub(set())
    _rank(coordinator, stub)
    a = _ready(coordinator, "t")

    def moved(job, ranks, what):  # type: ignore[no-untyped-def]
        yield 1, 1
        return {}

    monkeypatch.setattr(coordinator.collectives, "run", moved)
    stub.refuse_promotions = True
    steps = list(coordinator.reshards.reshard(ReshardOrder("t", _layout(), 1 << 20, 0.0)))
    b = steps[-1].tensor
    assert b.promoting and [r.version for r in coordinator.catalog.versions("t")] == [b.version]
    assert ("drop", "t", a.version) not in stub.calls  # kept: b is not promoted yet
    stub.refuse_promotions = False
    if replaced_by == "put":
        put = _create(
            coordinator, pb.CreateTensorRequest(name="t", metadata=_metadata(), overwrite=True)
        )
        coordinator.lifecycle.commit("t", put.version)
    else:
        coordinator.lifecycle.drop("t")
    assert ("drop", "t", a.version) in stub.calls
    coordinator.reshards.finish_promotions()  # nothing of b is left to finish, nor of a to drop again
    assert stub.calls.count(("drop", "t", a.version)) == 1


def _snapshot_order(prefix: str) -> SnapshotOrder:
    return SnapshotOrder(prefix, 1, {"w": _layout(), "b": _layout()}, "", durable=False)


def test_a_commit_reserves_the_next_snapshot_in_the_memory_it_frees(coordinator):
    """The reservation's AllocateMany drops the versions the commit removed, then allocates the next ones; the
    reserved snapshot has the committed one's layouts and is pending until committed in its turn."""
    stub = RankStub(set())
    _rank(coordinator, stub)
    snapshots = coordinator.snapshots
    first = snapshots.create(_snapshot_order("r")).record
    reserved = snapshots.commit(CommitOrder("r", first.number, reserve_next=True)).next
    assert reserved is not None
    second = snapshots.commit(CommitOrder("r", reserved.record.number, reserve_next=True))
    assert second.record.number == reserved.record.number and second.next is not None
    dropped = {(name, version) for kind, name, version in stub.calls if kind == "drop"}
    assert dropped == {(t.name, t.version) for t in first.tensors()}
    allocations = [call for call in stub.calls if call[0] == "allocate"]
    assert [name for _, name, _ in allocations[-2:]] == [
        t.name for t in second.next.record.tensors()
    ]
    assert [e.tensor.metadata for e in second.next.record.entries] == [
        e.tensor.metadata for e in first.entries
    ]
    assert [s.number for s in snapshots.list("r")] == [second.record.number]


@pytest.mark.parametrize("later", [False, True], ids=["in the answer", "after it"])
def test_a_reservation_the_ranks_refuse_leaves_the_commit_done_and_drops_the_old_snapshot(
    coordinator, later
):
    """Reserved before the commit answers (no next in the answer) or after it (NOT_FOUND to the taker)."""
    stub = RankStub(set())
    _rank(coordinator, stub)
    snapshots = coordinator.snapshots
    first = snapshots.create(_snapshot_order("q")).record
    second = snapshots.create(_snapshot_order("q")).record
    snapshots.commit(CommitOrder("q", first.number))
    stub.refuse_allocations = True
    order = CommitOrder("q", second.number, reserve_next=True, reserve_later=later)
    committed = snapshots.commit(order)
    assert committed.next is None and committed.record.number == second.number
    if later:
        with pytest.raises(TensorNotFound):
            snapshots.take_reserved("q", second.number)
    assert [s.number for s in snapshots.list("q")] == [second.number]
    snapshots.drops.wait("q")
    dropped = {(name, version) for kind, name, version in stub.calls if kind == "drop"}
    assert {(t.name, t.version) for t in first.tensors()} <= dropped
    assert all(record.name.startswith("q@") is False for record in coordinator.catalog.pending())


def test_a_commit_that_reserves_later_answers_first_and_the_writer_takes_the_reservation(
    coordinator,
):
    """With reserve_later the commit's answer carries no next snapshot; the reservation (the same drops and
    allocations as one made before the answer) is taken once with take_reserved, then NOT_FOUND."""
    stub = RankStub(set())
    _rank(coordinator, stub)
    snapshots = coordinator.snapshots
    first = snapshots.create(_snapshot_order("later")).record
    committed = snapshots.commit(
        CommitOrder("later", first.number, reserve_next=True, reserve_later=True)
    )
    assert committed.next is None
    reserved = snapshots.take_reserved("later", first.number)
    assert [e.tensor.metadata for e in reserved.record.entries] == [
        e.tensor.metadata for e in first.entries
    ]
    allocations = [call for call in stub.calls if call[0] == "allocate"]
    assert [name for _, name, _ in allocations[-2:]] == [t.name for t in reserved.record.tensors()]
    with pytest.raises(TensorNotFound) as taken_again:
        snapshots.take_reserved("later", first.number)
    assert taken_again.value.metadata == {"field": "committed"}
    second = snapshots.commit(CommitOrder("later", reserved.record.number))
    assert [s.number for s in snapshots.list("later")] == [second.record.number]
