"""Ranks on one host exchange a reshard's buckets through each other's shard memory (server/rank/jobs/same_host.py).

The split and the exports are pure logic, tested in-process. The exchange runs on real gloo worlds of two
spawned ranks whose source shards live in shared-memory segments, checked bit for bit against plain torch, with
the bytes that crossed gloo counted: none between two ranks of one host. Failures are caused for real: a source
process killed once its peer mapped its memory, or before, and a peer whose export names the wrong file.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_world import World
from reference import shards_of

from shardserve.core.metadata import TensorProperties
from shardserve.core.planner import plan_reshard
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos.same_host import host_id
from shardserve.server.common.ports import free_port
from shardserve.server.rank.jobs import peer_memory
from shardserve.server.rank.jobs.peer_memory import (
    CudaShard,
    PeerExport,
    PeerMemoryError,
    SegmentHandle,
    decode_handles,
    encode_handles,
    local_export,
    open_shard,
)
from shardserve.server.rank.jobs.reshard import ReshardError, ReshardStats, run_reshard
from shardserve.server.rank.jobs.same_host import PeerMemory, split_part
from shardserve.server.rank.shared_memory import SharedMemory

SIZE = (64, 48)
TIMEOUT_S = 30.0
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def chunked(dim: int, dtype: torch.dtype, ranks=(0, 1)):
    return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
        SIZE, TensorProperties(dtype=dtype)
    )


def full_tensor(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, SIZE, generator=gen).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, SIZE, generator=gen, dtype=torch.int64)
    return torch.randn(SIZE, generator=gen).to(dtype)


# --- pure: exports and the split --------------------------------------------------------------


def export(host="h", uid=1000, shards=(0, 1)):
    return PeerExport(host, uid, 4242, {i: SegmentHandle(7, 8, 9, 4096, 16) for i in shards})


def test_an_export_round_trips_and_a_malformed_one_is_refused():
    cuda = CudaShard(64)
    original = PeerExport(
        "boot;net:1;pid:2", 1000, 77, {0: SegmentHandle(5, 6, 7, 4096, 64), 3: cuda}
    )
    assert PeerExport.decode(original.encode()) == original
    for bad in [
        b"not json",
        b'{"host": "h", "uid": -1, "pid": 1, "shards": {}}',
        b'{"host": "h", "uid": true, "pid": 1, "shards": {}}',
        b'{"host": "h", "uid": 1, "pid": 1, "shards": {"x": {"segment": {}}}}',
        b'{"host": "h", "uid": 1, "pid": 1, "shards": {"0": {"cuda": "!!", "nbytes": 4}}}',
        b'{"host": "h", "uid": 1, "pid": 1}',
    ]:
        with pytest.raises(PeerMemoryError, match="malformed"):
            PeerExport.decode(bad)


def test_a_peer_maps_only_on_its_own_host_as_the_same_user_or_root():
    assert export("h", 1000).maps(export("h", 1000))
    assert export("h", 0).maps(export("h", 1000))
    assert not export("h", 1000).maps(export("h", 1001))
    assert not export("h", 1000).maps(export("other", 1000))
    assert not export("", 1000).maps(export("", 1000))  # an unknown host is nobody's


def test_both_ends_split_a_plan_alike_by_host_and_exported_shards():
    plan = plan_reshard(chunked(0, torch.float32), chunked(1, torch.float32), 1024)
    parts = {r: plan.for_rank(r) for r in (0, 1)}
    same = {0: export(shards=[0]), 1: export(shards=[1])}
    for r in (0, 1):
        split = split_part(parts[r], same[r], {1 - r: same[1 - r]})
        assert not split.wire.sends and not split.wire.recvs
        assert split.mapped_sends == parts[r].sends and split.mapped_recvs == parts[r].recvs
        assert split.wire.local == parts[r].local
        assert split.sources == split.destinations == (1 - r,)
    # rank 1 exports nothing (its shard is in private memory): what it sends goes over the wire, both ends agree
    lopsided = {0: export(shards=[0]), 1: export(shards=[])}
    splits = {r: split_part(parts[r], lopsided[r], {1 - r: lopsided[1 - r]}) for r in (0, 1)}
    assert splits[0].mapped_sends == splits[1].mapped_recvs == parts[0].sends
    assert splits[1].wire.sends == splits[0].wire.recvs == parts[1].sends
    # two hosts: everything on the wire
    apart = {0: export("a", shards=[0]), 1: export("b", shards=[1])}
    for r in (0, 1):
        split = split_part(parts[r], apart[r], {1 - r: apart[1 - r]})
        assert split.wire == parts[r] and not split.mapped_sends and not split.mapped_recvs


def test_cuda_shards_are_lent_by_ipc_to_the_destinations_that_copy_them():
    plan = plan_reshard(chunked(0, torch.float32), chunked(1, torch.float32), 1024)
    on_gpu = {0: PeerExport("h", 1000, 1, {0: CudaShard(6144)}), 1: export(shards=[1])}
    split_0 = split_part(plan.for_rank(0), on_gpu[0], {1: on_gpu[1]})
    split_1 = split_part(plan.for_rank(1), on_gpu[1], {0: on_gpu[0]})
    # rank 0's shard is on its GPU: it makes a handle for rank 1 alone; rank 1's is a memfd, no handle
    assert split_0.lent_by_ipc == {1: (0,)} and split_0.borrowed_by_ipc == {}
    assert split_1.borrowed_by_ipc == {0: (0,)} and split_1.lent_by_ipc == {}
    handles = {3: b"\x00handle", 5: b""}
    assert decode_handles(encode_handles(handles)) == handles
    with pytest.raises(PeerMemoryError, match="malformed"):
        decode_handles(b'{"3": "not base64!"}')
    with pytest.raises(PeerMemoryError, match="no CUDA IPC handle came"):
        open_shard(on_gpu[0], 0, sizes=(32, 48), dtype=torch.float32)


def test_only_whole_segments_are_exported_and_the_switch_turns_it_off(monkeypatch):
    shared = SharedMemory()
    in_segment = shared.empty((4, 8), torch.float32)
    private = torch.zeros(4, 8)
    empty = shared.empty((0, 8), torch.float32)
    mine = local_export({0: in_segment, 1: private, 2: empty}, shared.segment_of)
    assert set(mine.shards) == {0}
    assert mine.host == host_id() and mine.pid == os.getpid() and mine.uid == os.getuid()
    monkeypatch.setenv(peer_memory.ENV_SWITCH, "0")
    assert local_export({0: in_segment}, shared.segment_of).shards == {}


def test_an_exported_segment_maps_bit_for_bit_and_a_wrong_one_is_refused():
    shared = SharedMemory()
    shard = shared.empty((5, 7), torch.float64)
    shard.copy_(torch.randn(5, 7, dtype=torch.float64))
    mine = local_export({3: shard}, shared.segment_of)
    mapped = open_shard(mine, 3, sizes=(5, 7), dtype=torch.float64)
    assert torch.equal(mapped, shard)
    with pytest.raises(PeerMemoryError, match="not exported"):
        open_shard(mine, 4, sizes=(5, 7), dtype=torch.float64)
    with pytest.raises(PeerMemoryError, match="bytes"):
        open_shard(mine, 3, sizes=(5, 8), dtype=torch.float64)
    handle = mine.shards[3]
    assert isinstance(handle, SegmentHandle)
    forged = PeerExport(
        mine.host,
        mine.uid,
        mine.pid,
        {
            3: SegmentHandle(
                handle.fd, handle.inode + 1, handle.device_id, handle.data_offset, handle.nbytes
            )
        },
    )
    with pytest.raises(PeerMemoryError, match="not the shard segment"):
        open_shard(forged, 3, sizes=(5, 7), dtype=torch.float64)


# --- two spawned ranks of one host ----------------------------------------------------------------


def _reshard(rank: int, src_dim: int, dst_dim: int, dtype_name: str, mode: str) -> dict:
    """Reshard SIZE from chunks of src_dim to chunks of dst_dim between ranks 0 and 1. `mode`: "mapped" (both
    sources in segments), "lopsided" (rank 1's in private memory), "apart" (rank 1 claims another host), "off"
    (no peer memory: every bucket over gloo)."""
    dtype = getattr(torch, dtype_name)
    src, dst = chunked(src_dim, dtype), chunked(dst_dim, dtype)
    full = full_tensor(dtype, seed=src_dim * 10 + dst_dim)
    plan = plan_reshard(src, dst, 1024)
    shared = SharedMemory()
    shards = {}
    for i in src.shards_on(rank):
        piece = shards_of(full, src)[i]
        private = mode == "lopsided" and rank == 1
        shards[i] = piece.clone() if private else shared.empty(piece.shape, dtype)
        shards[i].copy_(piece)
    lent = None
    if mode != "off":
        mine = local_export(shards, shared.segment_of)
        if mode == "apart" and rank == 1:
            mine = PeerExport("another-host", mine.uid, mine.pid, mine.shards)
        lent = PeerMemory(mine)
    stats = ReshardStats()
    out = run_reshard(plan, rank, shards, TIMEOUT_S, stats=stats, peer_memory=lent)
    expected = shards_of(full, dst)
    part = plan.for_rank(rank)
    return {
        "equal": all(torch.equal(t, expected[i]) and t.dtype == dtype for i, t in out.items()),
        "keys": sorted(out),
        "stats": vars(stats),
        "remote_in": sum(b.nbytes for b in part.recvs),
        "remote_out": sum(b.nbytes for b in part.sends),
    }


@pytest.fixture(scope="module")
def pair():
    world = World(2)
    yield world
    world.close()


@pytest.mark.parametrize("dtype", [str(d).removeprefix("torch.") for d in DTYPES])
@pytest.mark.parametrize("src_dim,dst_dim", [(0, 1), (1, 0)], ids=["rows_to_cols", "cols_to_rows"])
def test_two_ranks_of_one_host_copy_through_each_others_memory(pair, src_dim, dst_dim, dtype):
    answers = pair.run(_reshard, src_dim, dst_dim, dtype, "mapped")
    for rank, answer in answers.items():
        assert answer["equal"] and answer["keys"] == [rank]
        stats = answer["stats"]
        assert stats["sent_bytes"] == stats["received_bytes"] == 0  # nothing crossed gloo
        assert stats["mapped_bytes"] == answer["remote_in"] > 0


def test_what_cannot_be_mapped_still_crosses_gloo(pair):
    answers = pair.run(_reshard, 0, 1, "float32", "lopsided")
    assert all(a["equal"] for a in answers.values())
    # rank 0's source is in a segment: rank 1 maps it; rank 1's is private: it sends it to rank 0
    assert answers[1]["stats"]["mapped_bytes"] == answers[1]["remote_in"] > 0
    assert answers[0]["stats"]["sent_bytes"] == 0
    assert answers[1]["stats"]["sent_bytes"] == answers[1]["remote_out"] > 0
    assert answers[0]["stats"]["received_bytes"] == answers[0]["remote_in"]


@pytest.mark.parametrize("mode", ["apart", "off"])
def test_ranks_of_two_hosts_or_with_it_off_send_every_bucket(pair, mode):
    answers = pair.run(_reshard, 1, 0, "bfloat16", mode)
    for answer in answers.values():
        assert answer["equal"]
        assert answer["stats"]["mapped_bytes"] == 0
        assert answer["stats"]["sent_bytes"] == answer["remote_out"] > 0


# --- failures: real processes killed ---------------------------------------------------------------

FAULT_TIMEOUT_S = 20.0


def _fault_rank(rank: int, port: int, scenario: str, results, release) -> None:
    """One rank of a two-rank reshard (rows -> cols, float32) in which `scenario` goes wrong; a rank that
    lives on stays, as a rank process would, until the test has every answer (`release`)."""
    try:
        results.put((rank, "pid", os.getpid()))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=FAULT_TIMEOUT_S),
        )
        src, dst = chunked(0, torch.float32), chunked(1, torch.float32)
        full = full_tensor(torch.float32, seed=7)
        plan = plan_reshard(src, dst, 1024)
        shared = SharedMemory()
        shards = {}
        for i in src.shards_on(rank):
            shards[i] = shared.empty(shards_of(full, src)[i].shape, torch.float32)
            shards[i].copy_(shards_of(full, src)[i])
        mine = local_export(shards, shared.segment_of)
        if scenario == "forged" and rank == 1:
            forged = {
                i: SegmentHandle(h.fd, h.inode + 1, h.device_id, h.data_offset, h.nbytes)
                for i, h in mine.shards.items()
            }  # type: ignore[union-attr]
            mine = PeerExport(mine.host, mine.uid, mine.pid, forged)
        lent = PeerMemory(mine, after_mapping=_hook(rank, scenario))
        expected = shards_of(full, dst)
        out = {i: torch.full_like(expected[i], float("nan")) for i in dst.shards_on(rank)}
        started = time.monotonic()
        try:
            run_reshard(plan, rank, shards, FAULT_TIMEOUT_S, peer_memory=lent, out=out)
        except ReshardError as err:
            elapsed = time.monotonic() - started
            copied = all(torch.equal(t, expected[i]) for i, t in out.items())
            results.put((rank, "error", (str(err), err.peers, elapsed, copied)))
            return
        results.put((rank, "done", all(torch.equal(t, expected[i]) for i, t in out.items())))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        results.put((rank, "crash", traceback.format_exc()))
    finally:
        release.wait(timeout=90)
        results.close()
        results.join_thread()
        os._exit(0)


def _hook(rank: int, scenario: str):
    """The after-mapping hook of `rank` in `scenario`: rank 0 says it has mapped rank 1's memory and waits for
    rank 1's death; rank 1 waits for that word, then dies."""
    mapped = os.environ.get(_MAPPED_FILE, "")

    def dies_once_rank_0_mapped() -> None:
        _poll(lambda: os.path.exists(mapped))
        os._exit(3)

    def waits_for_the_death_of_rank_1() -> None:
        with open(mapped, "w"):
            pass
        _poll(lambda: not _rank_1_alive())

    if scenario == "source_dies_after_mapping":
        return dies_once_rank_0_mapped if rank == 1 else waits_for_the_death_of_rank_1
    return lambda: None


def _poll(done) -> None:
    deadline = time.monotonic() + FAULT_TIMEOUT_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


_RANK_1_PID = "SHARDSERVE_TEST_RANK_1_PID"
_MAPPED_FILE = "SHARDSERVE_TEST_MAPPED_FILE"


def _rank_1_alive() -> bool:
    pid = int(os.environ.get(_RANK_1_PID, "0"))
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def run_faulty_pair(scenario: str) -> dict[int, tuple[str, object]]:
    """Start rank 1, then rank 0 (told rank 1's pid), and collect what each ended with. Spawned: each rank
    reads what the test sets in its environment at its start (a forkserver's children have the server's)."""
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = {
        r: ctx.Process(target=_fault_rank, args=(r, port, scenario, results, release), daemon=True)
        for r in (1, 0)
    }
    procs[1].start()
    answers: dict[int, tuple[str, object]] = {}
    pid_1 = _take(results, 1, "pid")
    os.environ[_RANK_1_PID] = str(pid_1)  # spawned rank 0 inherits it
    try:
        procs[0].start()
    finally:
        del os.environ[_RANK_1_PID]
    _take(results, 0, "pid")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (
        0 in answers and (1 in answers or not procs[1].is_alive())
    ):
        try:
            rank, kind, value = results.get(timeout=1)
        except queue.Empty:
            continue
        answers[rank] = (kind, value)
    release.set()
    for proc in procs.values():
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    answers.setdefault(1, ("exit", procs[1].exitcode))
    return answers


def _take(results, rank: int, kind: str):
    got_rank, got_kind, value = results.get(timeout=90)
    assert (got_rank, got_kind) == (rank, kind), (got_rank, got_kind, value)
    return value


def test_a_source_killed_after_its_memory_was_mapped_leaves_the_copy_whole(tmp_path, monkeypatch):
    """Rank 1 dies (kill -9 semantics: os._exit, no clean-up) right after mapping rank 0's memory; rank 0 copies
    from its mapping of rank 1 only once rank 1 is dead: the memfd's pages outlive the process, so what it
    copied is bit for bit the source, never freed memory. Rank 0 then fails to hear from rank 1 (its job fails,
    as the coordinator would see anyway)."""
    monkeypatch.setenv(_MAPPED_FILE, str(tmp_path / "rank-0-mapped"))
    answers = run_faulty_pair("source_dies_after_mapping")
    kind, value = answers[0]
    assert kind == "error", answers
    message, peers, elapsed, copied = value
    assert peers == (1,) and "rank 1" in message
    assert elapsed < FAULT_TIMEOUT_S  # the closed connection ends it, not the deadline
    assert copied  # out of the dead rank's memory, bit for bit
    assert answers[1] == ("exit", 3)


def test_a_peer_whose_memory_cannot_be_mapped_fails_the_job_at_once_on_both_ends():
    answers = run_faulty_pair("forged")
    kind, value = answers[0]
    assert kind == "error", answers
    message, peers, _, _ = value
    assert peers == (1,) and "cannot map the memory of rank 1" in message
    assert "not the shard segment" in message
    # rank 1 mapped rank 0 and copied, then heard that rank 0 failed: it fails at once, not at its deadline
    kind, value = answers[1]
    assert kind == "error", answers
    message, peers, elapsed, _ = value
    assert peers == (0,) and "rank 0 failed to copy" in message
    assert elapsed < FAULT_TIMEOUT_S / 2


# --- two ranks on one GPU (never on NCCL, which refuses them) ---------------------------------------


def _reshard_on_one_gpu(rank: int, dtype_name: str, strided: bool) -> dict:
    """Rows -> columns between two ranks whose shards are all on cuda:0, through CUDA IPC."""
    dtype = getattr(torch, dtype_name)
    on_gpu = ChunkShardingSpec(0, ["rank:0/cuda:0", "rank:1/cuda:0"])
    src = on_gpu.build_metadata(SIZE, TensorProperties(dtype=dtype))
    dst = ChunkShardingSpec(1, ["rank:0/cuda:0", "rank:1/cuda:0"]).build_metadata(
        SIZE, TensorProperties(dtype=dtype)
    )
    full = full_tensor(dtype, seed=3)
    shards = {}
    for i in src.shards_on(rank):
        piece = shards_of(full, src)[i]
        # a shard that is a view into a bigger allocation: its handle must name its offset
        backing = torch.zeros((2 * piece.numel(),), dtype=dtype, device="cuda:0")
        shards[i] = (
            backing[piece.numel() :].view(piece.shape)
            if strided
            else backing[: piece.numel()].view(piece.shape)
        )
        shards[i].copy_(piece)
    stats = ReshardStats()
    lent = PeerMemory(local_export(shards, lambda tensor: None))
    out = run_reshard(
        plan_reshard(src, dst, 1024), rank, shards, TIMEOUT_S, stats=stats, peer_memory=lent
    )
    expected = shards_of(full, dst)
    return {
        "equal": all(
            torch.equal(t.cpu(), expected[i]) and t.device.type == "cuda" for i, t in out.items()
        ),
        "stats": vars(stats),
    }


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strided", [False, True], ids=["storage_start", "storage_offset"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_two_ranks_on_one_gpu_reshard_through_cuda_ipc(pair, dtype, strided):
    answers = pair.run(_reshard_on_one_gpu, dtype, strided)
    for answer in answers.values():
        assert answer["equal"]
        assert answer["stats"]["sent_bytes"] == answer["stats"]["received_bytes"] == 0
        assert answer["stats"]["mapped_bytes"] > 0
