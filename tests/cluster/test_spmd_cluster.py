"""State dicts of SPMD jobs (client.spmd) against a real cluster: gloo jobs of spawned processes put and get.

One 4-process gloo world plays every job: the 4-process writer, and 3-, 2- and 1-process readers on groups of
its ranks with other layouts. Every local shard is compared bit for bit with plain torch slicing of the global
tensor. A reader loops while a writer puts, and a writer killed mid-put leaves nothing visible. Hundreds of
small tensors cost one AllocateMany / PromoteMany / DropMany per rank (the ranks' call counts, scraped).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_world import World
from waiting import wait_until

from shardserve import connect, spmd
from shardserve.core.state_tree import split_state_dict
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.launcher import LocalCluster

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
SHAPES = [(10, 6), (7, 5), (9,), (5, 3, 2), (1, 8), (13, 4)]
WRITER_LAYOUTS = [
    "s0",
    "s1",
    "rep",
    "m_s0_s1",
    "m_s0_rep",
    "m_rep_s1",
    "m_s1_s0",
    "sharded",
    "plain",
]
READER_LAYOUTS = ["s0", "s1", "rep", "plain"]


def entries() -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    """~50 tensors: (dotted key, shape, dtype, writer layout), nested up to 3 levels."""
    out = []
    for i in range(50):
        shape, dtype, layout = (
            SHAPES[i % len(SHAPES)],
            DTYPES[i % len(DTYPES)],
            WRITER_LAYOUTS[i % len(WRITER_LAYOUTS)],
        )
        if layout in ("s1", "m_s0_s1", "m_rep_s1", "m_s1_s0") and len(shape) < 2:
            layout = "s0"
        out.append((f"block{i % 4}.layer{i}.w" if i % 3 else f"top{i}", shape, dtype, layout))
    return out


def global_value(key: str, shape: tuple[int, ...], dtype: torch.dtype, value: int) -> torch.Tensor:
    """The global tensor of `key` in the snapshot carrying `value` (every element tells both)."""
    seed = sum(map(ord, key))
    base = (
        torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape) * 7
        + seed
        + value * 1000
    )
    if dtype == torch.bool:
        return (base + value) % 2 == 1
    if dtype == torch.uint8:
        return (base % 251).to(dtype)
    return base.to(dtype) if not dtype.is_floating_point else (base.to(torch.float64) / 8).to(dtype)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in flat.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = v
    return out


def _meshes() -> dict[str, Any]:
    """Every mesh used, made on every rank of the world (a mesh's groups are made by all ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    return {
        "w4": DeviceMesh("cpu", [0, 1, 2, 3]),
        "m22": DeviceMesh("cpu", [[0, 1], [2, 3]]),
        "r3": DeviceMesh("cpu", [0, 1, 2]),
        "r2": DeviceMesh("cpu", [2, 3]),
    }


def build(layout: str, full: torch.Tensor, meshes: dict[str, Any], mesh1: str) -> Any:
    """`full` held in `layout`: a DTensor on a 1-D mesh `mesh1` or the 2x2 mesh, a ShardedTensor, or plain."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = {
        "s0": [Shard(0)],
        "s1": [Shard(1)],
        "rep": [Replicate()],
        "m_s0_s1": [Shard(0), Shard(1)],
        "m_s0_rep": [Shard(0), Replicate()],
        "m_rep_s1": [Replicate(), Shard(1)],
        "m_s1_s0": [Shard(1), Shard(0)],
    }
    if layout == "plain":
        return full.clone()
    if layout == "sharded":
        return _sharded(full)
    mesh = meshes["m22"] if layout.startswith("m_") else meshes[mesh1]
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements[layout])
    local = (
        full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].clone()
        if mesh.get_coordinate() is not None
        else torch.empty(0, dtype=full.dtype)
    )
    return DTensor.from_local(
        local, mesh, placements[layout], run_check=False, shape=full.shape, stride=full.stride()
    )


def _sharded(full: torch.Tensor) -> Any:
    """A ShardedTensor of 4 row chunks (torch.chunk rule: uneven), chunk r on rank r."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    rank, bounds, start = dist.get_rank(), [], 0
    for chunk in torch.chunk(torch.arange(full.shape[0]), 4):
        bounds.append((start, len(chunk)))
        start += len(chunk)
    bounds += [(full.shape[0], 0)] * (4 - len(bounds))
    offset, rows = bounds[rank]
    shards = []
    if rows:
        meta = ShardMetadata(
            [offset] + [0] * (full.dim() - 1), [rows, *full.shape[1:]], f"rank:{rank}/cpu"
        )
        shards = [Shard(full[offset : offset + rows].clone(), meta)]
    return init_from_local_shards(shards, *full.shape)


def writer_state(value: int, meshes: dict[str, Any]) -> dict[str, Any]:
    return nest(
        {
            key: build(layout, global_value(key, shape, dtype, value), meshes, "w4")
            for key, shape, dtype, layout in entries()
        }
    )


def reader_state(layouts: list[str], mesh1: str, meshes: dict[str, Any]) -> dict[str, Any]:
    """Zeros in another layout per key (cycling through `layouts`); 2-D meshes are not used by readers."""
    out = {}
    for i, (key, shape, dtype, _) in enumerate(entries()):
        layout = layouts[i % len(layouts)]
        if layout == "s1" and len(shape) < 2:
            layout = "s0"
        out[key] = build(layout, torch.zeros(shape, dtype=dtype), meshes, mesh1)
    return nest(out)


def mismatches(state: dict[str, Any], value: int | None) -> list[str]:
    """Keys whose local shards differ from plain torch slicing of the global tensor (of `value`; None: of the
    value the first element carries, the same for every key)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    flat = split_state_dict(state, is_tensor=lambda v: isinstance(v, torch.Tensor)).tensors
    bad, seen = [], set()
    for key, shape, dtype, _ in entries():
        got = flat[key]
        if isinstance(got, DTensor):
            if got.device_mesh.get_coordinate() is None:
                continue
            sizes, offsets = compute_local_shape_and_global_offset(
                got.shape, got.device_mesh, got.placements
            )
            local = got.to_local()
        else:
            sizes, offsets, local = tuple(got.shape), (0,) * got.dim(), got
        candidates = [value] if value is not None else list(range(0, 40))
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        matching = [
            v for v in candidates if torch.equal(global_value(key, shape, dtype, v)[box], local)
        ]
        if not matching:
            bad.append(key)
        elif value is None and dtype not in (torch.bool, torch.uint8) and local.numel():
            seen.add(matching[0])
    if len(seen) > 1:
        bad.append(f"a mix of snapshots {sorted(seen)}")
    return bad


# ---------------------------------------------------------------- job functions (run on every world rank)


def job_put_then_gets(rank: int, address: str, pack: bool = False) -> dict[str, Any]:
    meshes = _meshes()
    prefix = "packed" if pack else "model"
    groups = {
        "r3": dist.new_group([0, 1, 2]),
        "r2": dist.new_group([2, 3]),
        "r1": dist.new_group([3]),
    }
    cluster = connect(address)
    number = spmd.put_state_dict(cluster, writer_state(3, meshes), prefix, pack=pack)
    results = {"number": number}
    for job, ranks, layouts in (
        ("r3", [0, 1, 2], ["s1", "s0", "rep"]),
        ("r2", [2, 3], ["s0", "rep", "s1"]),
        ("r1", [3], ["plain"]),
    ):
        into = reader_state(layouts, job if job != "r1" else "w4", meshes)
        if rank in ranks:
            got = spmd.get_state_dict(cluster, prefix, into=into, group=groups[job])
            results[job] = (got, mismatches(into, 3))
        dist.barrier()
    cluster.close()
    return results


def job_write_while_reading(rank: int, address: str, puts: int) -> list[tuple[int, list[str]]]:
    meshes = _meshes()
    writers, readers = dist.new_group([0, 1]), dist.new_group([2, 3])
    from torch.distributed.device_mesh import DeviceMesh

    pair = {"w01": DeviceMesh("cpu", [0, 1]), "r23": DeviceMesh("cpu", [2, 3]), **meshes}
    cluster, out = connect(address), []

    def put(value: int) -> int:
        state = nest(
            {
                key: build(
                    "s0" if layout != "plain" else "plain",
                    global_value(key, shape, dtype, value),
                    pair,
                    "w01",
                )
                for key, shape, dtype, layout in entries()
            }
        )
        return spmd.put_state_dict(cluster, state, "loop", group=writers)

    if rank in (0, 1):
        out.append((put(9), []))
    dist.barrier()  # readers start once a first snapshot is there, then race the writer's next ones
    if rank in (0, 1):
        out += [(put(value), []) for value in range(10, 10 + puts)]
    else:
        for _ in range(puts + 2):
            into = reader_state(["s1", "rep"], "r23", pair)
            number = spmd.get_state_dict(cluster, "loop", into=into, group=readers)
            out.append((number, mismatches(into, None)))
    cluster.close()
    return out


def job_put_stalled(rank: int, address: str, value: int, stall_marker: str) -> int:
    """A 2-process put whose rank 1 stalls in its first shard write (after touching `stall_marker`)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = {"w2": DeviceMesh("cpu", [0, 1])}
    if stall_marker and rank == 1:
        from shardserve.client.session import Session

        def stalled(self: Session, writes: Any) -> dict[str, int]:
            open(stall_marker, "w").close()
            time.sleep(600)
            raise AssertionError("the stalled writer was not killed")

        Session.write_shards = stalled  # type: ignore[method-assign]
    state = {
        key: build(
            "s0" if layout != "plain" else "plain",
            global_value(key, shape, dtype, value),
            mesh,
            "w2",
        )
        for key, shape, dtype, layout in entries()[:8]
    }
    with connect(address) as cluster:
        return spmd.put_state_dict(cluster, state, "killed")


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(ranks=3, metrics_port=0)  # metrics: the per-method call counts of the ranks


def rank_calls(address: str) -> dict[str, float]:
    """The calls every rank has handled so far, summed over the ranks, by method."""
    import grpc

    from shardserve.client.cli.top import by_label, scrape
    from shardserve.protos import shardserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        ranks = pb_grpc.CoordinatorStub(channel).ListRanks(pb.ListRanksRequest(), timeout=10).ranks
    out: dict[str, float] = {}
    for rank in ranks:
        for method, count in by_label(
            scrape(rank.metrics_address), "shardserve_rpc_requests_total", "method"
        ).items():
            out[method] = out.get(method, 0.0) + count
    return out


def job_put_failing(rank: int, address: str, failing: int, step: str) -> tuple[str, int]:
    """A 4-process put in which job rank `failing` fails `step` ("write": its shard writes; "commit": the
    commit, which only job rank 0 makes): what every rank raised, and the snapshots of the prefix after."""
    import shardserve.client.spmd as spmd_module

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected {step} failure")

    name = "write_whole" if step == "write" else "commit_snapshot"
    real = getattr(spmd_module, name)
    if rank == failing:
        setattr(spmd_module, name, fail)
    state = {f"w{i}": torch.full((8, 4), float(rank)) for i in range(4)}
    try:
        with connect(address) as cluster:
            try:
                spmd.put_state_dict(cluster, state, f"failing-{step}", keep=1, durable=False)
            except spmd.SpmdError as err:
                raised = str(err)
            else:
                raised = ""
            kept = len(cluster.snapshots(f"failing-{step}"))
    finally:
        setattr(spmd_module, name, real)
    return raised, kept


@pytest.fixture(scope="module")
def world4() -> Iterator[World]:
    world = World(4)
    yield world
    world.close()


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True])
def test_four_process_put_read_by_three_two_and_one_process_jobs(
    cluster: LocalCluster, world4: World, pack: bool
) -> None:
    """With `pack`, the plain tensors (small, written by job rank 0 alone) are stored in packs: the other
    ranks plan the same packs without their bytes, and readers holding them as DTensors read their boxes
    out of the packs."""
    answers = world4.run(job_put_then_gets, cluster.address, pack, timeout=240)
    number = answers[0]["number"]
    assert all(a["number"] == number for a in answers.values())
    for rank, answer in answers.items():
        for job in ("r3", "r2", "r1"):
            if job in answer:
                got, bad = answer[job]
                assert got == number and bad == [], (rank, job, bad)
    assert {job for a in answers.values() for job in a} == {"number", "r3", "r2", "r1"}
    plain = [key for key, _, _, layout in entries() if layout == "plain"]
    with connect(cluster.address) as client:
        snapshot = client.snapshot("packed" if pack else "model")
        assert snapshot.number == number and len(snapshot.keys()) == len(entries())
        stored = {
            entry.key
            for entry in client.session.call(
                "GetSnapshot", pb.GetSnapshotRequest(prefix="packed" if pack else "model")
            ).entries
        }
        assert (stored & set(plain), "_packed.0" in stored) == (
            (set(), True) if pack else (set(plain), False)
        )
        whole = snapshot.read()
        for key, shape, dtype, _ in entries():
            assert torch.equal(whole[key], global_value(key, shape, dtype, 3)), key


@pytest.mark.parametrize("step, failing", [("write", 2), ("commit", 0)])
def test_a_step_failing_on_one_job_rank_is_raised_on_every_rank(
    cluster: LocalCluster, world4: World, step: str, failing: int
) -> None:
    """Writes end in one reduction of a failure flag and the commit's number comes in one broadcast; a failure
    on one job rank still reaches every rank with its message, and nothing of the put is visible."""
    answers = world4.run(job_put_failing, cluster.address, failing, step, timeout=120)
    what = "writing shards" if step == "write" else "committing"
    expected = f"{what} failed on job rank {failing}: RuntimeError: injected {step} failure"
    assert {rank: raised for rank, (raised, _) in answers.items()} == dict.fromkeys(
        range(4), expected
    )
    assert {kept for _, kept in answers.values()} == {0}


def test_reads_while_writing_see_one_snapshot_each(cluster: LocalCluster, world4: World) -> None:
    answers = world4.run(job_write_while_reading, cluster.address, 4, timeout=300)
    written = {number for rank in (0, 1) for number, _ in answers[rank]}
    assert len(written) == 5
    for rank in (2, 3):
        for number, bad in answers[rank]:
            assert bad == [], (rank, number, bad)
    with connect(cluster.address) as client:
        kept = [s.number for s in client.snapshots("loop")]
    assert kept == sorted(written)[-2:]  # keep=2


def test_writer_killed_mid_put_leaves_nothing_visible(cluster: LocalCluster, tmp_path: Any) -> None:
    world = World(2)
    try:
        first = world.run(job_put_stalled, cluster.address, 1, "", timeout=120)[0]
        marker = str(tmp_path / "stalled")
        world.start(job_put_stalled, cluster.address, 2, marker)
        wait_until(lambda: os.path.exists(marker), 120, "the stalled put to reach its writes")
        for process in world.processes:
            os.kill(process.pid, signal.SIGKILL)
    finally:
        world.close()
    with connect(cluster.address) as client:
        assert [s.number for s in client.snapshots("killed")] == [first]
        pending = [
            t.name
            for t in client.list(include_pending=True)
            if t.name.startswith("killed@") and t.state == "PENDING"
        ]
        assert pending  # the killed put's tensors exist, unseen, until aborted or reaped
        assert not [
            t.name
            for t in client.list()
            if t.name.startswith("killed@") and not t.name.startswith(f"killed@{first}/")
        ]
        into = {key: torch.zeros(shape, dtype=dtype) for key, shape, dtype, _ in entries()[:8]}
        assert spmd.get_state_dict(client, "killed", into=into) == first
        for key, shape, dtype, _ in entries()[:8]:
            assert torch.equal(into[key], global_value(key, shape, dtype, 1)), key
        assert (
            client.session.call("ListSnapshots", pb.ListSnapshotsRequest(prefix="killed"))
            .snapshots[0]
            .number
            == first
        )


def test_single_process_keeps_the_newest_snapshots_and_pins_one(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardserve.client.cli.main import main as cli

    with connect(cluster.address) as client:
        numbers = [
            spmd.put_state_dict(
                client,
                {"w": torch.full((6, 2), float(v)), "opt": {"step": torch.tensor(v)}},
                "solo",
                keep=2,
            )
            for v in range(3)
        ]
        assert [s.number for s in client.snapshots("solo")] == numbers[1:]
        into = {"w": torch.zeros(6, 2), "opt": {"step": torch.tensor(0)}}
        assert spmd.get_state_dict(client, "solo", into=into, snapshot=numbers[1]) == numbers[1]
        assert torch.equal(into["w"], torch.full((6, 2), 1.0)) and int(into["opt"]["step"]) == 1
        with pytest.raises(spmd.SpmdError, match=f"no snapshot {numbers[0]}"):
            spmd.get_state_dict(client, "solo", into=into, snapshot=numbers[0])
        assert client.snapshot("solo").read()["opt.step"].item() == 2
    assert cli(["--coordinator", cluster.address, "snapshots", "solo", "--tensors"]) == 0
    out = capsys.readouterr().out
    assert f"snapshot {numbers[1]}\t2 tensors" in out and f"snapshot {numbers[2]}\t2 tensors" in out
    assert "opt.step\t()" in out and f"snapshot {numbers[0]}" not in out


def test_hundreds_of_small_tensors_cost_one_call_per_rank_and_read_back_bit_for_bit(
    cluster: LocalCluster,
) -> None:
    """300 small tensors of every dtype: create and commit make one AllocateMany and one PromoteMany per rank;
    each commit reserves the next snapshot with one more AllocateMany per rank, which also drops the older
    snapshot; the client's close aborts the last reservation (one DropMany per rank); every tensor reads back
    bit for bit."""
    keys = [
        (f"layer{i // 10}.p{i % 10}", SHAPES[i % len(SHAPES)], DTYPES[i % len(DTYPES)])
        for i in range(300)
    ]
    with connect(cluster.address) as client:
        before = rank_calls(cluster.address)
        for value in (1, 2):
            number = spmd.put_state_dict(
                client,
                nest({key: global_value(key, shape, dtype, value) for key, shape, dtype in keys}),
                "many",
                keep=1,
            )
        into = nest({key: torch.zeros(shape, dtype=dtype) for key, shape, dtype in keys})
        assert spmd.get_state_dict(client, "many", into=into) == number
        assert (
            len(client.session.call("GetSnapshot", pb.GetSnapshotRequest(prefix="many")).entries)
            == 300
        )
    moved = {
        method: count - before.get(method, 0.0)
        for method, count in rank_calls(cluster.address).items()
    }
    for key, shape, dtype in keys:
        got = into
        for part in key.split("."):
            got = got[part]
        assert got.dtype == dtype and torch.equal(got, global_value(key, shape, dtype, 2)), key
    for per_tensor in ("AllocateShards", "PromoteVersion", "DropVersion"):
        assert moved.get(per_tensor, 0.0) == 0, (per_tensor, moved)
    assert 3 <= moved.get("AllocateMany", 0.0) <= 3 * cluster.ranks, moved
    assert 2 <= moved.get("PromoteMany", 0.0) <= 2 * cluster.ranks, moved
    assert 1 <= moved.get("DropMany", 0.0) <= cluster.ranks, moved


def rank_holdings(address: str) -> list[tuple[int, list[str]]]:
    """(memory used, names held) of every rank, as its GetStats says."""
    import grpc

    from shardserve.protos import shardserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        ranks = pb_grpc.CoordinatorStub(channel).ListRanks(pb.ListRanksRequest(), timeout=10).ranks
    out = []
    for rank in sorted(ranks, key=lambda r: r.rank):
        with grpc.insecure_channel(rank.address) as channel:
            stats = pb_grpc.ShardServerStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
        out.append((stats.memory_used_bytes, sorted(h.name for h in stats.held)))
    return out


def test_a_snapshot_one_rank_cannot_hold_leaves_nothing_on_any_rank(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Every rank but one allocates its tensors; the last is over its memory limit: the put fails naming that
    rank and the tensor, and the tensors the other ranks allocated are dropped again (one DropMany each)."""
    from shardserve.core.specs import ChunkShardingSpec

    small = make_cluster(ranks=3, rank_options=RankOptions(memory_limit=1 << 20))
    on = {r: ChunkShardingSpec(0, [f"rank:{r}/cpu"]) for r in range(3)}
    state = {f"s{i}": torch.full((64,), float(i)) for i in range(40)} | {
        "big": torch.zeros(1 << 19)
    }  # 2 MiB
    specs = {f"s{i}": on[i % 2] for i in range(40)} | {"big": on[2]}
    with connect(small.address) as client:
        before = rank_holdings(small.address)
        with pytest.raises(
            spmd.SpmdError,
            match=r"MemoryLimitError.*rank 2: tensors\[0\] \('toolarge@\d+/big'"
            r" version \d+\): rank 2 memory limit",
        ):
            spmd.put_state_dict(client, state, "toolarge", spec=specs)
        assert rank_holdings(small.address) == before
        assert not client.session.call(
            "ListSnapshots", pb.ListSnapshotsRequest(prefix="toolarge")
        ).snapshots
        del state["big"], specs["big"]
        number = spmd.put_state_dict(client, state, "toolarge", spec=specs)
        into = {key: torch.zeros(64) for key in state}
        assert spmd.get_state_dict(client, "toolarge", into=into) == number
        assert all(torch.equal(into[key], value) for key, value in state.items())


def test_spec_layout_is_cut_by_the_job_boxes(cluster: LocalCluster) -> None:
    from shardserve.core.specs import ChunkShardingSpec

    full = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    with connect(cluster.address) as client:
        spec = ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in (2, 0)])
        spmd.put_state_dict(client, {"t": full}, "spec", spec=spec, replicas=1)
        meta = client.snapshot("spec")["t"].metadata()
        assert [(s.shard_offsets, s.shard_sizes, s.rank) for s in meta.shards_metadata] == [
            ((0, 0), (5, 4), 2),
            ((0, 4), (5, 4), 0),
        ]
        spmd.put_state_dict(client, {"t": full}, "spec", replicas=2)
        meta = client.snapshot("spec")["t"].metadata()
        assert len(meta.shards_metadata) == 2 and len({s.rank for s in meta.shards_metadata}) == 2
        out = {"t": torch.zeros(5, 8)}
        spmd.get_state_dict(client, "spec", into=out)
        assert torch.equal(out["t"], full)


def test_bad_input_names_the_field(cluster: LocalCluster) -> None:
    import grpc

    from shardserve import InvalidArgumentError

    with connect(cluster.address) as client:
        with pytest.raises(spmd.SpmdError, match=r"entry 'a\.b' is a builtins\.object"):
            spmd.put_state_dict(client, {"w": torch.ones(1), "a": {"b": object()}}, "bad")
        with pytest.raises(spmd.SpmdError, match="holds no tensor"):
            spmd.put_state_dict(client, {"a": {"b": "text"}}, "bad")
        with pytest.raises(InvalidArgumentError, match="prefix"):
            spmd.put_state_dict(client, {"a": torch.ones(1)}, "")
        with pytest.raises(InvalidArgumentError, match="keep"):
            spmd.put_state_dict(client, {"a": torch.ones(1)}, "bad", keep=0)
        with pytest.raises(spmd.SpmdError, match="float32 in the snapshot"):
            spmd.put_state_dict(client, {"a": torch.ones(2)}, "bad")
            spmd.get_state_dict(client, "bad", into={"a": torch.zeros(2, dtype=torch.int64)})
        stub = client.session
        for method, request, code in [
            (
                "CommitSnapshot",
                pb.CommitSnapshotRequest(prefix="bad", number=12345),
                grpc.StatusCode.NOT_FOUND,
            ),
            ("GetSnapshot", pb.GetSnapshotRequest(prefix=""), grpc.StatusCode.INVALID_ARGUMENT),
            (
                "CreateSnapshot",
                pb.CreateSnapshotRequest(prefix="bad"),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        ]:
            with pytest.raises(Exception) as caught:
                stub.call(method, request)
            assert caught.value.code == code, (method, caught.value)
        for request, field in [
            (pb.CommitSnapshotRequest(prefix="bad", number=12345, view=99), "view"),  # type: ignore[arg-type]
            (pb.CommitSnapshotRequest(prefix="bad", number=0), "number"),
            (pb.CommitSnapshotRequest(prefix="bad", number=1, skeleton="{not json"), "skeleton"),
        ]:
            with pytest.raises(InvalidArgumentError) as caught:
                stub.call("CommitSnapshot", request)
            assert caught.value.metadata.get("field") == field, caught.value


@pytest.mark.slow
def test_the_trainer_to_inference_example_runs_bit_for_bit(cluster: LocalCluster) -> None:
    """examples/trainer_to_inference.py as the docs run it: a 2-process job puts, a 3-process job gets."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            str(root / "examples" / "trainer_to_inference.py"),
            cluster.address,
            "--step",
            "7",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "every shard bit for bit" in done.stdout


PLAIN_WORLD_OF_ONE = """
import sys
import torch
from shardserve import connect, spmd

state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
with connect(sys.argv[1]) as cluster:
    spmd.put_state_dict(cluster, state, "plain-world-of-one", durable=False)
    into = {key: torch.zeros_like(value) for key, value in state.items()}
    spmd.get_state_dict(cluster, "plain-world-of-one", into=into)
assert all(torch.equal(into[key], state[key]) for key in state)
print(sorted(m for m in sys.modules if m.startswith("torch.distributed.tensor")))
"""


def test_a_plain_state_dict_is_put_and_read_without_importing_dtensor(
    cluster: LocalCluster,
) -> None:
    """A process of plain tensors (a world of one, an inference reader) never imports torch.distributed.tensor
    (~0.8 s, ~2.8 s where torch ships no bytecode): no value can be a DTensor whose module nobody imported."""
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_WORLD_OF_ONE, cluster.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
