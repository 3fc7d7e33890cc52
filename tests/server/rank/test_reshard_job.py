"""server.rank.jobs.reshard: real gloo worlds on 127.0.0.1 run reshard plans, checked bit for bit.

One 4-rank world is started per module and fed every layout pair through
queues; a separate 3-rank world is used for the peer that hangs and the peer
that dies mid-reshard, since those leave its process group unusable.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from reference import shards_of

from shardserve.core.executor import apply_plan
from shardserve.core.metadata import (
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    make_metadata,
)
from shardserve.core.planner import plan_reshard
from shardserve.core.specs import ChunkShardingSpec, chunk_bounds
from shardserve.server.common.ports import free_port
from shardserve.server.rank.jobs.groups import PeerGroup
from shardserve.server.rank.jobs.ordering import CollectiveExecutor, SequenceTimeoutError
from shardserve.server.rank.jobs.reshard import ReshardError, ReshardStats, run_reshard
from shardserve.server.rank_start import forkserver_context

WORLD = 4
FAULT_WORLD = 3
RESULT_TIMEOUT_S = 90
RESHARD_TIMEOUT_S = 30.0
FAULT_TIMEOUT_S = 3.0
DEAD_PEER_TIMEOUT_S = 40.0
HANG_GUARD_S = 60.0
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
}


# --- layouts -----------------------------------------------------------------------------------


def chunk(size, dim, ranks, dtype):
    return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
        size, TensorProperties(dtype=dtype)
    )


def grid(size, dims, row_cut, col_cut, ranks, dtype):
    """A 2x2 grid over two dims, cut at row_cut/col_cut, the four blocks on `ranks` (row-major)."""
    a, b = dims
    blocks = []
    for (ao, asz), (bo, bsz) in [
        (r, c)
        for r in ((0, row_cut), (row_cut, size[a] - row_cut))
        for c in ((0, col_cut), (col_cut, size[b] - col_cut))
    ]:
        offsets, sizes = [0] * len(size), list(size)
        offsets[a], sizes[a], offsets[b], sizes[b] = ao, asz, bo, bsz
        blocks.append((offsets, sizes))
    return make_metadata(size, [(o, s, r) for (o, s), r in zip(blocks, ranks)], dtype)


def even_grid(size, dims, ranks, dtype):
    (_, rows), _ = chunk_bounds(size[dims[0]], 2)
    (_, cols), _ = chunk_bounds(size[dims[1]], 2)
    return grid(size, dims, rows, cols, ranks, dtype)


def uneven_rows(size, dtype):
    cuts = [(0, 1), (1, 8), (9, 1), (10, size[0] - 10)]
    return make_metadata(
        size,
        [
            ((o,) + (0,) * (len(size) - 1), (n,) + tuple(size[1:]), r)
            for r, (o, n) in enumerate(cuts)
        ],
        dtype,
    )


def replicated(size, ranks, dtype):
    return make_metadata(size, [((0,) * len(size), size, r) for r in ranks], dtype)


def random_grid(size, seed, dtype):
    """A grid with 1-3 random cuts per dim, each block on a random rank (some ranks hold several, some none)."""
    gen = torch.Generator().manual_seed(seed)
    bounds = []
    for n in size:
        cuts = sorted(
            {
                int(c)
                for c in torch.randint(
                    1, n, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen
                )
            }
            if n > 1
            else set()
        )
        edges = [0, *cuts, n]
        bounds.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    blocks = itertools.product(*bounds)
    return make_metadata(
        size,
        [
            (
                tuple(o for o, _ in block),
                tuple(n for _, n in block),
                int(torch.randint(0, WORLD, (1,), generator=gen)),
            )
            for block in blocks
        ],
        dtype,
    )


def layout(name, size, dtype):
    """A layout by name; "random:<seed>" is a random grid."""
    if name.startswith("random:"):
        return random_grid(size, int(name.split(":")[1]), dtype)
    return LAYOUTS[name](size, dtype)


M2, M3 = (13, 21), (7, 5, 3)
ALL = list(range(WORLD))
LAYOUTS = {
    "rows": lambda s, d: chunk(s, 0, ALL, d),
    "cols": lambda s, d: chunk(s, 1, ALL, d),
    "uneven_rows": uneven_rows,
    "grid_enumerable": lambda s, d: grid(s, (0, 1), 5, 8, [2, 0, 3, 1], d),
    "cols_subset": lambda s, d: chunk(s, 1, [1, 3], d),
    "rows_subset01": lambda s, d: chunk(s, 0, [0, 1], d),
    "cols_subset01": lambda s, d: chunk(s, 1, [1, 0], d),
    "grid_dims02": lambda s, d: even_grid(s, (0, 2), [3, 2, 1, 0], d),
    "dim2": lambda s, d: chunk(s, 2, ALL, d),
    "dim1": lambda s, d: chunk(s, 1, ALL, d),
    "replicated02": lambda s, d: replicated(s, [0, 2], d),
    "replicated_all": lambda s, d: replicated(s, ALL, d),
    "cols_two_per_rank": lambda s, d: chunk(s, 1, ALL + ALL, d),
}

# (name, size, src layout, dst layout): every pair of layouts the reshard must support, both directions.
CASES = [
    ("row_to_col", M2, "rows", "cols"),
    ("col_to_row", M2, "cols", "rows"),
    ("uneven_to_even", M2, "uneven_rows", "rows"),
    ("even_to_uneven", M2, "rows", "uneven_rows"),
    ("chunk_to_enumerable_grid", M2, "cols", "grid_enumerable"),
    ("enumerable_grid_to_chunk", M2, "grid_enumerable", "rows"),
    ("all_to_subset", M2, "rows", "cols_subset"),
    ("subset_to_all", M2, "cols_subset", "rows"),
    ("1d_to_2d_grid", M3, "rows", "grid_dims02"),
    ("2d_grid_to_1d", M3, "grid_dims02", "dim2"),
    ("replicated_to_sharded", M3, "replicated02", "dim2"),
    ("sharded_to_replicated", M3, "dim1", "replicated_all"),
    ("one_to_several_per_rank", M2, "rows", "cols_two_per_rank"),
    ("several_to_one_per_rank", M2, "cols_two_per_rank", "rows"),
]


def full_tensor(size, dtype, seed):
    """A deterministic source tensor whose every element is distinguishable."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, size, generator=gen).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, size, generator=gen, dtype=torch.int64)
    return torch.randn(size, generator=gen).to(dtype)


# --- the worker processes ----------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, backend: str, commands, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    executor = CollectiveExecutor()
    while True:
        command = commands.get()
        if command is None:
            break
        try:
            results.put((rank, command["id"], _handle(rank, executor, command)))
        except Exception:
            results.put((rank, command["id"], {"crash": traceback.format_exc()}))
    executor.close()
    dist.destroy_process_group()


def _handle(rank: int, executor: CollectiveExecutor, command: dict) -> dict:
    role = command.get("roles", {}).get(rank, "run")
    if role == "absent":
        executor.skip(command["seq"])
        return {"absent": True}
    dtype = DTYPES[command["dtype"]]
    size = command["size"]
    src = on_cuda(layout(command["src"], size, dtype), command.get("cuda", False))
    dst = on_cuda(layout(command["dst"], size, dtype), command.get("cuda", False))
    full = full_tensor(size, dtype, command["seed"])
    plan = plan_reshard(src, dst, command["bucket_bytes"])
    src_shards = {
        i: t.to(src.shards_metadata[i].device, copy=True)
        for i, t in enumerate(shards_of(full, src))
        if src.shards_metadata[i].rank == rank
    }
    if role == "die":
        _exit_on_second_post()
    stats = ReshardStats()
    started = time.monotonic()
    future = executor.submit(
        command["seq"],
        lambda: run_reshard(plan, rank, src_shards, command["timeout_s"], stats=stats),
        wait_timeout_s=60,
    )
    try:
        out = future.result(timeout=RESULT_TIMEOUT_S)
    except ReshardError as exc:
        return {"error": str(exc), "peers": exc.peers, "elapsed": time.monotonic() - started}
    expected = shards_of(full, dst)
    reference = apply_plan(plan, shards_of(full, src))
    part = plan.for_rank(rank)
    return {
        "keys": sorted(out),
        "expected_keys": dst.shards_on(rank),
        "equal": {
            i: bool(torch.equal(t.cpu(), expected[i])) and t.dtype == dtype for i, t in out.items()
        },
        "equal_apply_plan": {i: bool(torch.equal(t.cpu(), reference[i])) for i, t in out.items()},
        "devices": {i: str(t.device) for i, t in out.items()},
        "stats": vars(stats),
        "plan_sent": sum(b.nbytes for b in part.sends),
        "plan_received": sum(b.nbytes for b in part.recvs),
        "peer_directions": len({b.dst_rank for b in part.sends})
        + len({b.src_rank for b in part.recvs}),
        "max_bucket": max((b.nbytes for b in part.sends + part.recvs), default=0),
    }


def on_cuda(meta: ShardedTensorMetadata, cuda: bool) -> ShardedTensorMetadata:
    """The same layout with every shard on its rank's GPU (cuda:rank) when `cuda`."""
    if not cuda:
        return meta
    shards = tuple(
        ShardMetadata(s.shard_offsets, s.shard_sizes, f"rank:{s.rank}/cuda:{s.rank}")
        for s in meta.shards_metadata
    )
    return ShardedTensorMetadata(shards, meta.size, meta.tensor_properties)


def _exit_on_second_post() -> None:
    """Make this process die abruptly when it posts its second batch of P2P operations."""
    original = PeerGroup.post
    calls = []

    def dying(self, ops, tag):
        calls.append(1)
        if len(calls) == 2:
            os._exit(3)
        return original(self, ops, tag)

    PeerGroup.post = dying


class World:
    """Worker processes of one gloo world, fed commands through per-rank queues."""

    def __init__(self, size: int, backend: str = "gloo") -> None:
        ctx = forkserver_context()
        self.size = size
        self.port = free_port()
        self.commands = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, size, self.port, backend, self.commands[r], self.results),
                daemon=True,
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()
        self.seq = 0
        self.next_id = 0

    def run(self, expect=None, **command) -> dict[int, dict]:
        """Send one command to every rank and collect the answers of `expect` (default all)."""
        expect = list(range(self.size)) if expect is None else expect
        command.update(id=self.next_id, seq=self.seq)
        self.next_id += 1
        self.seq += 1
        command.setdefault("timeout_s", RESHARD_TIMEOUT_S)
        command.setdefault("seed", command["id"])
        for q in self.commands:
            q.put(command)
        answers = {}
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while len(answers) < len(expect):
            rank, cid, answer = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            if cid == command["id"] and rank in expect:
                assert "crash" not in answer, f"rank {rank} crashed:\n{answer['crash']}"
                answers[rank] = answer
        return answers

    def kill(self) -> None:
        """End every worker at once (a world whose group holds abandoned operations)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)

    def close(self) -> None:
        for q, p in zip(self.commands, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


@pytest.fixture(scope="module")
def world():
    w = World(WORLD)
    yield w
    w.close()


@pytest.fixture
def fault_world():
    """A fresh 3-rank world per failure test: a failed reshard leaves abandoned operations behind."""
    w = World(FAULT_WORLD)
    yield w
    w.kill()


def check_answers(answers: dict[int, dict], bucket_bytes: int) -> None:
    for rank, a in answers.items():
        assert "error" not in a, f"rank {rank}: {a.get('error')}"
        assert a["keys"] == a["expected_keys"], f"rank {rank} returned shards {a['keys']}"
        assert all(a["equal"].values()), (
            f"rank {rank}: shards differ from the cut source {a['equal']}"
        )
        assert all(a["equal_apply_plan"].values()), f"rank {rank}: shards differ from apply_plan"
        stats = a["stats"]
        assert (
            stats["sent_bytes"] == a["plan_sent"] and stats["received_bytes"] == a["plan_received"]
        )
        bound = 2 * a["max_bucket"] * a["peer_directions"]
        assert stats["peak_staging_bytes"] <= bound, (
            f"rank {rank} staged {stats['peak_staging_bytes']} > {bound}"
        )
        assert stats["peak_staging_bytes"] <= 2 * bucket_bytes * a["peer_directions"]
        assert stats["staging_bytes"] == 0


# --- layout pairs over a 4-rank world ----------------------------------------------------------


@pytest.mark.parametrize("bucket_bytes", [24, 1 << 20], ids=["tiny_buckets", "1MiB_buckets"])
@pytest.mark.parametrize("name,size,src,dst", CASES, ids=[c[0] for c in CASES])
def test_layout_pair_matches_reference(world, name, size, src, dst, bucket_bytes):
    dtype = list(DTYPES)[CASES.index((name, size, src, dst)) % len(DTYPES)]
    answers = world.run(size=size, src=src, dst=dst, dtype=dtype, bucket_bytes=bucket_bytes)
    check_answers(answers, bucket_bytes)
    assert any(a["keys"] for a in answers.values())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_across_dims_with_many_buckets(world, dtype):
    answers = world.run(size=M3, src="rows", dst="dim2", dtype=dtype, bucket_bytes=8)
    check_answers(answers, 8)
    assert max(a["stats"]["rounds"] for a in answers.values()) >= 2
    assert sum(a["stats"]["buckets_sent"] for a in answers.values()) > WORLD * (WORLD - 1)


@pytest.mark.parametrize("seed", range(6))
def test_random_grids(world, seed):
    size = M2 if seed % 2 else M3
    dtype = list(DTYPES)[seed % len(DTYPES)]
    answers = world.run(
        size=size,
        src=f"random:{2 * seed}",
        dst=f"random:{2 * seed + 1}",
        dtype=dtype,
        bucket_bytes=16 << seed,
    )
    check_answers(answers, 16 << seed)


def test_zero_copy_when_boxes_are_contiguous(world):
    # cols -> rows: every received box is whole rows of a row shard, so it lands in place.
    answers = world.run(size=M2, src="cols", dst="rows", dtype="float32", bucket_bytes=1 << 20)
    check_answers(answers, 1 << 20)
    assert all(
        a["stats"]["zero_copy_buckets"] >= a["stats"]["buckets_received"] for a in answers.values()
    )


def test_ranks_outside_the_plan_take_no_part(world):
    # Only ranks 0 and 1 hold source or destination shards; ranks 2 and 3 skip the job without
    # running anything, so 0 and 1 finish without them (no barrier, no all-ranks collective).
    answers = world.run(
        size=M2,
        src="rows_subset01",
        dst="cols_subset01",
        dtype="int64",
        bucket_bytes=64,
        roles={2: "absent", 3: "absent"},
    )
    assert answers[2] == answers[3] == {"absent": True}
    check_answers({r: answers[r] for r in (0, 1)}, 64)
    assert all(answers[r]["stats"]["buckets_received"] > 0 for r in (0, 1))
    check_answers(
        world.run(size=M2, src="rows", dst="cols", dtype="float32", bucket_bytes=1 << 20), 1 << 20
    )


# --- failure: a hung peer and a dead peer (3-rank world) ---------------------------------------

FAULT_LAYOUTS = {"src": "rows_fault", "dst": "cols_fault"}
LAYOUTS["rows_fault"] = lambda s, d: chunk(s, 0, list(range(FAULT_WORLD)), d)
LAYOUTS["cols_fault"] = lambda s, d: chunk(s, 1, list(range(FAULT_WORLD)), d)


def test_hung_peer_is_named_within_the_timeout(fault_world):
    started = time.monotonic()
    answers = fault_world.run(
        size=M2,
        dtype="float32",
        bucket_bytes=64,
        timeout_s=FAULT_TIMEOUT_S,
        expect=[0, 1],
        roles={2: "absent"},
        **FAULT_LAYOUTS,
    )
    for rank in (0, 1):
        assert answers[rank]["peers"] == (2,), answers[rank]
        assert "rank 2" in answers[rank]["error"]
        assert (
            answers[rank]["elapsed"] >= FAULT_TIMEOUT_S * 0.95
        )  # it did wait out the timeout it was given
    assert time.monotonic() - started < HANG_GUARD_S


def test_peer_that_dies_mid_reshard_is_named(fault_world):
    started = time.monotonic()
    answers = fault_world.run(
        expect=[0, 1],
        size=(64, 63),
        dtype="float32",
        bucket_bytes=64,
        timeout_s=DEAD_PEER_TIMEOUT_S,
        roles={2: "die"},
        **FAULT_LAYOUTS,
    )
    for rank in (0, 1):
        assert answers[rank]["peers"] == (2,), answers[rank]
        assert "rank 2" in answers[rank]["error"]
        assert (
            answers[rank]["elapsed"] < DEAD_PEER_TIMEOUT_S
        )  # the closed connection fails it, not the timeout
    assert time.monotonic() - started < HANG_GUARD_S
    fault_world.procs[2].join(timeout=10)
    assert fault_world.procs[2].exitcode == 3


# --- in-process: the collective thread and input validation ------------------------------------


def test_executor_runs_jobs_in_sequence_order_whatever_the_submission_order():
    order, lock = [], threading.Lock()

    def job(n):
        def run():
            with lock:
                order.append((n, threading.current_thread().name))
            return n

        return run

    with CollectiveExecutor(first_seq=5) as ex:
        futures = [ex.submit(seq, job(seq), wait_timeout_s=10) for seq in (7, 6, 9, 5, 8)]
        assert [f.result(timeout=10) for f in futures] == [7, 6, 9, 5, 8]
        assert [n for n, _ in order] == [5, 6, 7, 8, 9]
        assert (
            len({name for _, name in order}) == 1 and order[0][1] != threading.current_thread().name
        )
        assert ex.next_seq == 10


def test_executor_failed_job_does_not_block_the_next():
    with CollectiveExecutor() as ex:

        def boom():
            raise ReshardError("peer 3 gone", (3,))

        first = ex.submit(0, boom, wait_timeout_s=5)
        second = ex.submit(1, lambda: "ok", wait_timeout_s=5)
        with pytest.raises(ReshardError, match="peer 3 gone"):
            first.result(timeout=5)
        assert second.result(timeout=5) == "ok"


def test_executor_out_of_order_job_times_out_and_is_skipped():
    with CollectiveExecutor() as ex:
        late = ex.submit(1, lambda: "never", wait_timeout_s=0.3)
        with pytest.raises(SequenceTimeoutError, match="waiting for job 0"):
            late.result(timeout=5)
        assert ex.submit(0, lambda: "zero", wait_timeout_s=5).result(timeout=5) == "zero"
        assert ex.submit(2, lambda: "two", wait_timeout_s=5).result(timeout=5) == "two"


def test_executor_skip_lets_the_sequence_continue():
    with CollectiveExecutor() as ex:
        future = ex.submit(1, lambda: 1, wait_timeout_s=5)
        ex.skip(0)
        assert future.result(timeout=5) == 1


def test_executor_rejects_bad_sequence_numbers():
    with CollectiveExecutor() as ex:
        ex.submit(0, lambda: None, wait_timeout_s=5).result(timeout=5)
        with pytest.raises(ValueError, match="seq 0 was already used"):
            ex.submit(0, lambda: None, wait_timeout_s=5)
        with pytest.raises(ValueError, match="seq must be >= 0"):
            ex.submit(-1, lambda: None, wait_timeout_s=5)
        with pytest.raises(TypeError, match="seq must be an int"):
            ex.submit("1", lambda: None, wait_timeout_s=5)
        with pytest.raises(ValueError, match="wait_timeout_s"):
            ex.submit(1, lambda: None, wait_timeout_s=0)
        with pytest.raises(TypeError, match="fn must be callable"):
            ex.submit(1, None, wait_timeout_s=5)


def _single_rank_plan(dtype=torch.float32):
    src = make_metadata(M2, [((0, 0), (6, 21), 0), ((6, 0), (7, 21), 0)], dtype)
    dst = make_metadata(M2, [((0, 0), (13, 10), 0), ((0, 10), (13, 11), 0)], dtype)
    return src, dst, plan_reshard(src, dst, 64)


def test_local_only_plan_needs_no_process_group():
    src, dst, plan = _single_rank_plan()
    full = full_tensor(M2, torch.float32, 1)
    stats = ReshardStats()
    out = run_reshard(plan, 0, dict(enumerate(shards_of(full, src))), 5.0, stats=stats)
    assert sorted(out) == [0, 1]
    for i, expected in enumerate(shards_of(full, dst)):
        assert torch.equal(out[i], expected)
    assert (
        stats.local_bytes == full.numel() * 4
        and stats.sent_bytes == 0
        and stats.peak_staging_bytes == 0
    )


def test_bad_inputs_are_named():
    src, dst, plan = _single_rank_plan()
    good = dict(enumerate(shards_of(full_tensor(M2, torch.float32, 1), src)))
    with pytest.raises(TypeError, match="plan must be a ReshardPlan"):
        run_reshard("plan", 0, good, 5.0)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        run_reshard(plan, -1, good, 5.0)
    with pytest.raises(ValueError, match="timeout_s"):
        run_reshard(plan, 0, good, 0)
    with pytest.raises(ValueError, match="src_shards has no tensor for source shard 1"):
        run_reshard(plan, 0, {0: good[0]}, 5.0)
    with pytest.raises(ValueError, match=r"src_shards\[1\] has shape \(6, 21\)"):
        run_reshard(plan, 0, {0: good[0], 1: good[0]}, 5.0)
    with pytest.raises(ValueError, match=r"src_shards\[0\] has dtype torch.float64"):
        run_reshard(plan, 0, {0: good[0].double(), 1: good[1]}, 5.0)
    with pytest.raises(TypeError, match="src_shards must be a mapping"):
        run_reshard(plan, 0, [good[0], good[1]], 5.0)


def test_given_out_tensors_are_written_in_place():
    src, dst, plan = _single_rank_plan()
    full = full_tensor(M2, torch.float32, 3)
    given = {1: torch.full((13, 11), -1.0)}
    stats = ReshardStats()
    out = run_reshard(plan, 0, dict(enumerate(shards_of(full, src))), 5.0, stats=stats, out=given)
    assert out[1] is given[1] and torch.equal(given[1], full[:, 10:])
    assert torch.equal(out[0], full[:, :10])
    assert stats.new_shard_bytes == 13 * 10 * 4


def test_bad_out_tensors_are_named():
    src, dst, plan = _single_rank_plan()
    shards = dict(enumerate(shards_of(full_tensor(M2, torch.float32, 3), src)))
    with pytest.raises(
        ValueError, match=r"out\[1\] is \(13, 10\) torch.float32 but shard 1 is \(13, 11\)"
    ):
        run_reshard(plan, 0, shards, 5.0, out={1: torch.empty(13, 10)})
    with pytest.raises(ValueError, match="out has tensors for shards \\[5\\]"):
        run_reshard(plan, 0, shards, 5.0, out={5: torch.empty(13, 11)})
    whole = torch.empty(13, 21)
    with pytest.raises(ValueError, match=r"out\[0\] shares memory with a source shard"):
        run_reshard(plan, 0, {0: whole[:6], 1: whole[6:]}, 5.0, out={0: whole[:, :10]})
    with pytest.raises(TypeError, match="out must be a mapping"):
        run_reshard(plan, 0, shards, 5.0, out=[torch.empty(13, 10)])


def test_remote_plan_without_process_group_is_a_reshard_error():
    src = make_metadata(M2, [((0, 0), (13, 21), 0)], torch.float32)
    dst = make_metadata(M2, [((0, 0), (13, 21), 1)], torch.float32)
    plan = plan_reshard(src, dst, 1 << 20)
    with pytest.raises(ReshardError, match="torch.distributed is not initialized"):
        run_reshard(plan, 0, {0: torch.zeros(M2)}, 5.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_local_plan_allocates_on_the_destination_device():
    src = make_metadata(M2, [((0, 0), (13, 21), "rank:0/cuda:0")])
    dst = make_metadata(
        M2, [((0, 0), (13, 10), "rank:0/cuda:0"), ((0, 10), (13, 11), "rank:0/cpu")]
    )
    plan = plan_reshard(src, dst, 64)
    full = full_tensor(M2, torch.float32, 2)
    out = run_reshard(plan, 0, {0: full.cuda()}, 10.0)
    assert out[0].device.type == "cuda" and out[1].device.type == "cpu"
    assert torch.equal(out[0].cpu(), full[:, :10]) and torch.equal(out[1], full[:, 10:])


LAYOUTS["rows_cuda_pair"] = lambda s, d: chunk(s, 0, [0, 1], d)
LAYOUTS["cols_cuda_pair"] = lambda s, d: chunk(s, 1, [1, 0, 1], d)


@pytest.mark.cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 CUDA GPUs"
)
@pytest.mark.parametrize("bucket_bytes", [24, 1 << 20], ids=["tiny_buckets", "1MiB_buckets"])
def test_cuda_shards_move_over_nccl(bucket_bytes):
    w = World(2, backend="cpu:gloo,cuda:nccl")
    try:
        for dtype in DTYPES:
            answers = w.run(
                size=M2,
                src="rows_cuda_pair",
                dst="cols_cuda_pair",
                dtype=dtype,
                bucket_bytes=bucket_bytes,
                cuda=True,
            )
            check_answers(answers, bucket_bytes)
            assert all(
                d.startswith("cuda") for a in answers.values() for d in a["devices"].values()
            )
    finally:
        w.kill()
