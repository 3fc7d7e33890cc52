"""Weight sync on one host at the memory limit: one process puts and gets a state dict through a 2-rank
cluster (shared memory both ways, durable=False, keep=1), against the limit, torch's copy_ of the same tensors
into already-touched destinations in one process, and against dcp.save / dcp.load to /dev/shm.

Cases: 64 x 16 MiB (bandwidth), 300 x 512 KiB (a 7B model's count of tensors, each read through a mapping) and
512 x 8 KiB (per-tensor cost): the first put into new rank memory, then
the weight-sync loop after a second put: put then get into preallocated tensors, alternating, each timed
(medians; each get reads the snapshot the put before it made, the puts go into the memory the snapshot before
freed), and the same loop with reserve_next="later"; one 64 MiB tensor put (Cluster.put) and fetched whole into
a preallocated tensor, alternating as well (each put after the first two fills the version reserved after the put
before); a 1 MiB row slice of it. The small tensors' case runs the loop again with pack=True (one byte tensor
for all of them on the cluster).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.baselines import median_seconds
from benchmarks.harness import Row

MiB = 1 << 20
CASES = ((64, 16 * MiB), (300, 512 << 10), (512, 8 << 10))  # (tensors, bytes each)
QUICK_CASES = ((16, MiB), (128, 8 << 10))
SINGLE_BYTES, SLICE_BYTES = 64 * MiB, MiB
QUICK_SINGLE_BYTES, QUICK_SLICE_BYTES = 4 * MiB, 64 << 10
REPEATS, QUICK_REPEATS = 5, 3
WARM_ROUNDS = 4  # untimed rounds of the weight-sync loop before the timed ones (_sync_loop)
SHM = "/dev/shm"


def _state(count: int, each: int, seed: float) -> dict[str, torch.Tensor]:
    rows = each // 4 // 256
    return {
        f"layer{i}.w": torch.full((rows, 256), seed + i, dtype=torch.float32) for i in range(count)
    }


def _copy_all(sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    for key, source in sources.items():
        targets[key].copy_(source)


def _dcp_s(state: dict[str, torch.Tensor], repeats: int) -> tuple[float, float]:
    """Median seconds of dcp.save and of dcp.load of `state` to and from a folder in /dev/shm."""
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory(prefix="shardserve-bench-dcp-", dir=SHM) as folder:
        counter = iter(range(1 << 30))
        save_s = median_seconds(
            lambda: dcp.save(state, checkpoint_id=f"{folder}/{next(counter)}", no_dist=True),
            repeats,
        )
        load_s = median_seconds(
            lambda: dcp.load(state, checkpoint_id=f"{folder}/0", no_dist=True), repeats
        )
    return save_s, load_s


def _state_dict_case(cluster: Any, count: int, each: int, repeats: int) -> dict[str, Any]:
    """Seconds of the first and steady put, steady get, copy_ and dcp of one state dict; whether it matched."""
    from shardserve import spmd
    from shardserve.client.spmd_packs import PACK_ITEM_BYTES

    prefix = f"host{count}x{each}"
    state, into = _state(count, each, 1.0), _state(count, each, 0.0)
    put = lambda: spmd.put_state_dict(cluster, state, prefix, keep=1, durable=False)  # noqa: E731
    start = time.perf_counter()
    put()
    first_s = time.perf_counter() - start
    put()  # the second put's memory is new too; from the third on, puts reuse what the one before freed
    out = {"first put": first_s}
    out["put"], out["get"] = _sync_loop(cluster, put, prefix, into, repeats)
    out["copy_"] = median_seconds(lambda: _copy_all(state, into), repeats)
    put_later = lambda: spmd.put_state_dict(  # noqa: E731
        cluster, state, prefix, keep=1, durable=False, reserve_next="later"
    )
    put_later()  # the first commits with reserve_later; from the second on, puts fill what it reserved
    out["put later"], out["get after later"] = _sync_loop(cluster, put_later, prefix, into, repeats)
    out["dcp.save"], out["dcp.load"] = _dcp_s(state, repeats)
    spmd.get_state_dict(cluster, prefix, into=into)
    out["ok"] = all(torch.equal(into[key], state[key]) for key in state)
    if each <= PACK_ITEM_BYTES:
        out.update(_packed_case(cluster, state, f"{prefix}-packed", repeats))
    return out


def _packed_case(
    cluster: Any, state: dict[str, torch.Tensor], prefix: str, repeats: int
) -> dict[str, Any]:
    """The weight-sync loop of small tensors put with pack=True (client/spmd_packs.py); whether it matched."""
    from shardserve import spmd

    into = {key: torch.zeros_like(value) for key, value in state.items()}
    put = lambda: spmd.put_state_dict(  # noqa: E731
        cluster, state, prefix, keep=1, durable=False, pack=True
    )
    put()
    put()
    out = dict(zip(("put packed", "get packed"), _sync_loop(cluster, put, prefix, into, repeats)))
    out["packed ok"] = all(torch.equal(into[key], state[key]) for key in state)
    return out


def _sync_loop(
    cluster: Any, put: Any, prefix: str, into: dict[str, torch.Tensor], repeats: int
) -> tuple[float, float]:
    """The weight-sync loop, `repeats` times after WARM_ROUNDS untimed rounds: `put`, then a get of the snapshot
    it made into `into` (with reserve_next="later", while the next snapshot is reserved); the median seconds
    of each. The first rounds are not steady: steady snapshots alternate between two memory areas, and the
    reader maps each for the first time there (the first get of 1 GiB took 0.65 s on the 2-core VM, the
    second 0.14 s, the puts settled from the fifth round on)."""
    from shardserve import spmd

    return _alternating(put, lambda: spmd.get_state_dict(cluster, prefix, into=into), repeats)


def _alternating(put: Any, get: Any, repeats: int) -> tuple[float, float]:
    """`put` then `get`, `repeats` times after WARM_ROUNDS untimed rounds: the median seconds of each."""
    for _ in range(WARM_ROUNDS):
        put()
        get()
    puts, gets = [], []
    for _ in range(repeats):
        puts.append(_seconds(put))
        gets.append(_seconds(get))
    return statistics.median(puts), statistics.median(gets)


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _single_case(cluster: Any, nbytes: int, slice_bytes: int, repeats: int) -> dict[str, Any]:
    """Seconds of a one-tensor put and whole fetch (alternating, as a weight sync's loop puts and reads: each put
    after the first two fills the version reserved after the one before), a row-slice fetch, copy_ of each, and
    dcp."""
    from shardserve.core.specs import ChunkShardingSpec

    spec = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    tensor = torch.randn(nbytes // 4 // 1024, 1024)
    whole, rows = torch.empty_like(tensor), slice_bytes // 4 // 1024
    part = torch.empty(rows, 1024)
    first = tensor.shape[0] // 2 - rows // 2  # across both ranks' shards
    put = lambda: cluster.put("single", tensor, spec, overwrite=True, durable=False)  # noqa: E731
    put()
    remote = cluster.tensor("single")
    out = {}
    out["put"], out["fetch"] = _alternating(
        put, lambda: remote.fetch((0, 0), tuple(tensor.shape), out=whole), repeats
    )
    out |= {
        "slice": median_seconds(lambda: remote.fetch((first, 0), (rows, 1024), out=part), repeats),
        "copy_": median_seconds(lambda: whole.copy_(tensor), repeats),
        "slice copy_": median_seconds(lambda: part.copy_(tensor[first : first + rows]), repeats),
    }
    out["dcp.save"], out["dcp.load"] = _dcp_s({"single": tensor}, repeats)
    remote.fetch((0, 0), tuple(tensor.shape), out=whole)
    remote.fetch((first, 0), (rows, 1024), out=part)
    out["ok"] = torch.equal(whole, tensor) and torch.equal(part, tensor[first : first + rows])
    return out


def _first_put_s(address: str) -> tuple[float, float, bool]:
    """Seconds of a new client's first put of 16 x 1 MiB into new rank memory, and of copy_ of the same."""
    from shardserve import connect, spmd

    state, into = _state(16, MiB, 3.0), _state(16, MiB, 0.0)
    with connect(address) as client:
        start = time.perf_counter()
        spmd.put_state_dict(client, state, "first", keep=1, durable=False)
        seconds = time.perf_counter() - start
        spmd.get_state_dict(client, "first", into=into)
    copy_s = median_seconds(lambda: _copy_all(state, into), 3)
    return seconds, copy_s, all(torch.equal(into[key], state[key]) for key in state)


def host_rows(cluster: Any, *, quick: bool, peaks: dict[str, int]) -> list[Row]:
    """Every one-host case, measured through `cluster` (a 2-rank LocalCluster on this host)."""
    from shardserve import connect

    repeats = QUICK_REPEATS if quick else REPEATS
    first_s, first_copy_s, first_ok = _first_put_s(cluster.address)
    case = "16 x 1 MiB, a new client's first put"
    rows: list[Row] = [
        _row(
            case,
            "put_state_dict (first)",
            first_s,
            16 * MiB,
            baseline="copy_",
            path="shm",
            ok=first_ok,
            peak_rss=peaks,
            note="new connection, new rank memory",
        ),
        _row(case, "copy_", first_copy_s, 16 * MiB, role="baseline", path="memory"),
    ]
    with connect(cluster.address) as client:
        for count, each in QUICK_CASES if quick else CASES:
            rows += _state_dict_rows(
                _state_dict_case(client, count, each, repeats), count, each, peaks
            )
        single, sliced = (
            (QUICK_SINGLE_BYTES, QUICK_SLICE_BYTES) if quick else (SINGLE_BYTES, SLICE_BYTES)
        )
        rows += _single_rows(_single_case(client, single, sliced, repeats), single, sliced, peaks)
    return rows


def _row(case: str, name: str, seconds: float, nbytes: int, **fields: Any) -> Row:
    return Row("statedict-host", case, name, seconds, nbytes=nbytes, **fields)


def _state_dict_rows(r: dict[str, Any], count: int, each: int, peaks: dict[str, int]) -> list[Row]:
    case, total = f"{count} x {_size(each)}, one process", count * each
    subject = {"path": "shm", "ok": r["ok"], "peak_rss": peaks}
    return [
        _row(
            case,
            "put_state_dict (first)",
            r["first put"],
            total,
            baseline="copy_",
            note="new rank memory",
            **subject,
        ),
        _row(
            case,
            "put_state_dict",
            r["put"],
            total,
            baseline="copy_",
            note="steady, keep=1, durable=False",
            **subject,
        ),
        _row(
            case,
            "get_state_dict",
            r["get"],
            total,
            baseline="copy_",
            note="into preallocated tensors",
            **subject,
        ),
        _row(
            case,
            "put_state_dict later",
            r["put later"],
            total,
            baseline="copy_",
            note='steady, reserve_next="later": the commit answers before the next snapshot is reserved',
            **subject,
        ),
        _row(
            case,
            "get_state_dict after it",
            r["get after later"],
            total,
            baseline="copy_",
            note="right after that put: the reservation is made meanwhile, on the same cores",
            **subject,
        ),
        *_packed_rows(r, case, total, peaks),
        _row(
            case,
            "copy_",
            r["copy_"],
            total,
            role="baseline",
            path="memory",
            note="into touched tensors",
        ),
        _row(case, "dcp.save", r["dcp.save"], total, role="baseline", path=SHM),
        _row(case, "dcp.load", r["dcp.load"], total, role="baseline", path=SHM),
    ]


def _packed_rows(r: dict[str, Any], case: str, total: int, peaks: dict[str, int]) -> list[Row]:
    """The packed weight-sync loop's rows, where the case's tensors are small enough to pack."""
    if "put packed" not in r:
        return []
    subject = {"path": "shm", "ok": r["packed ok"], "peak_rss": peaks}
    note = "steady, pack=True: the tensors stored in one byte tensor"
    return [
        _row(
            case,
            "put_state_dict pack=True",
            r["put packed"],
            total,
            baseline="copy_",
            note=note,
            **subject,
        ),
        _row(case, "get_state_dict of it", r["get packed"], total, baseline="copy_", **subject),
    ]


def _single_rows(
    r: dict[str, Any], nbytes: int, slice_bytes: int, peaks: dict[str, int]
) -> list[Row]:
    case, sliced = f"one {_size(nbytes)} tensor", f"{_size(slice_bytes)} row slice"
    subject = {"path": "shm", "ok": r["ok"], "peak_rss": peaks}
    return [
        _row(
            case,
            "Cluster.put",
            r["put"],
            nbytes,
            baseline="copy_",
            note="steady, durable=False, a fetch between puts",
            **subject,
        ),
        _row(
            case,
            "fetch whole",
            r["fetch"],
            nbytes,
            baseline="copy_",
            note="right after each put, into a preallocated tensor",
            **subject,
        ),
        _row(case, "copy_", r["copy_"], nbytes, role="baseline", path="memory"),
        _row(case, "dcp.save", r["dcp.save"], nbytes, role="baseline", path=SHM),
        _row(case, "dcp.load", r["dcp.load"], nbytes, role="baseline", path=SHM),
        _row(sliced, "fetch slice", r["slice"], slice_bytes, baseline="copy_", **subject),
        _row(sliced, "copy_", r["slice copy_"], slice_bytes, role="baseline", path="memory"),
    ]


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes >> 10} KiB"
