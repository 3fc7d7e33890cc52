"""Persistence: what a put and an update cost with persistence off, `--fsync interval` and `--fsync always`,
against a bare write+fsync of the same bytes on the same disk (the limit), and how long a cluster SIGKILLed
while holding a table takes to serve it again, against dcp.load of the same bytes.

On 2-rank local clusters (row-wise float32 tables, 256 columns): one put of a 256 MiB table (4 MiB with
--quick, which runs `always` only) and 50 update_rows of 64 random rows (10 quick), per mode; the baseline
writes the put's bytes to one file and fsyncs it, and appends each update's rows to a file with an fsync per
update. Then the `always` cluster takes a 1 GiB table (4 MiB quick), every rank is SIGKILLed, the coordinator
stopped, and `up` started again on the same state dir: the time until a row of every shard is read back,
against dcp.load of the table saved with dcp.save (no process group) into a preallocated tensor. Both read
from the page cache where it still holds the files (nothing here drops it).

    python -m benchmarks --only persist
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from benchmarks.harness import Context, Row, coordinator_options, scenario

COLUMNS = 256
ROWS_PER_UPDATE = 64
MODES = ("off", "interval", "always")
QUICK_MODES = ("always",)  # --quick: two cluster starts fewer (the smoke test's time limit)
SERVE_TIMEOUT_S = 600.0


def _rows(nbytes: int) -> int:
    return nbytes // (COLUMNS * 4)


def _start(state: Path, mode: str):  # type: ignore[no-untyped-def]
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    persist = None if mode == "off" else state / "data"
    cluster = LocalCluster(
        2,
        state_dir=state,
        coordinator_options=coordinator_options(),
        rank_options=RankOptions(
            log_level="WARNING", persist_dir=persist, fsync=None if mode == "off" else mode
        ),
        start_method="forkserver",
    )
    return cluster.start(timeout=SERVE_TIMEOUT_S)


def write_and_put(
    ctx: Context,
    state: Path,
    mode: str,
    table: torch.Tensor,
    updates: int,
    then_killed: torch.Tensor | None = None,
) -> dict:
    """Seconds of one put of `table` and of `updates` update_rows on a fresh cluster in `mode`; with
    `then_killed`, that is put as "restarted" and every rank SIGKILLed before the cluster stops."""
    from shardserve import connect

    generator = torch.Generator().manual_seed(0)
    cluster = _start(state, mode)
    try:
        for rank, pid in enumerate(cluster.rank_pids):
            ctx.sampler.label(pid, f"rank {rank} server ({mode})")
        with connect(cluster.address) as client:
            start = time.perf_counter()
            client.put("persisted", table)
            put_s = time.perf_counter() - start
            expected = table.clone()
            start = time.perf_counter()
            for _ in range(updates):
                ids = torch.randperm(table.shape[0], generator=generator)[:ROWS_PER_UPDATE]
                values = torch.randn(ROWS_PER_UPDATE, COLUMNS, generator=generator)
                client.update_rows("persisted", ids, values)
                expected[ids] = values
            update_s = time.perf_counter() - start
            ok = torch.equal(client.tensor("persisted").full_tensor(), expected)
            if then_killed is not None:
                client.put("restarted", then_killed)
                for rank in range(cluster.ranks):
                    cluster.kill_rank(rank, signal.SIGKILL)
    finally:
        cluster.stop()
    return {"put_s": put_s, "update_s": update_s, "ok": ok}


def bare_writes(folder: Path, table: torch.Tensor, updates: int) -> dict:
    """The limit: the put's bytes written to one file and fsynced; each update's rows appended and fsynced."""
    data = table.numpy().tobytes()
    row_bytes = bytes(ROWS_PER_UPDATE * (COLUMNS * 4 + 8))
    start = time.perf_counter()
    with open(folder / "bare-put", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    with open(folder / "bare-log", "ab") as f:
        for _ in range(updates):
            f.write(row_bytes)
            f.flush()
            os.fsync(f.fileno())
    return {"put_s": put_s, "update_s": time.perf_counter() - start}


def restart_to_serving(state: Path, table: torch.Tensor) -> dict:
    """Start `up` again on the state dir of a cluster SIGKILLed holding `table` as "restarted" (write_and_put):
    seconds until a row of every shard is served again, and whether the table then reads back bit for bit."""
    from shardserve import connect

    start = time.perf_counter()
    cluster = _start(state, "always")
    try:
        with connect(cluster.address) as client:
            first = _first_rows(client, table.shape[0])
            serve_s = time.perf_counter() - start
            ok = torch.equal(first, table[[0, -1]]) and torch.equal(
                client.tensor("restarted").full_tensor(), table
            )
    finally:
        cluster.stop()
    return {"serve_s": serve_s, "ok": ok}


def _first_rows(client, rows: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Rows 0 and rows-1 (one on each rank) once both are served again; bounded by SERVE_TIMEOUT_S."""
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while True:
        try:
            tensor = client.tensor("restarted")
            return torch.cat([tensor[0:1], tensor[rows - 1 : rows]])
        except Exception:  # noqa: BLE001 - ranks still restoring; bounded by SERVE_TIMEOUT_S
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def dcp_load(folder: Path, table: torch.Tensor) -> dict:
    """Seconds of dcp.load of `table` (saved by dcp.save without a process group) into a preallocated tensor."""
    import torch.distributed.checkpoint as dcp

    path = str(folder / "dcp")
    dcp.save({"restarted": table}, checkpoint_id=path, no_dist=True)
    into = {"restarted": torch.empty_like(table)}
    start = time.perf_counter()
    dcp.load(into, checkpoint_id=path, no_dist=True)
    return {"load_s": time.perf_counter() - start, "ok": torch.equal(into["restarted"], table)}


@scenario(
    "persist",
    help="put/update_rows with persistence off/interval/always vs write+fsync; restart vs dcp.load",
)
def persist_scenario(ctx: Context) -> list[Row]:
    """Put and update costs per fsync mode against a bare write+fsync, and restart-to-serving against dcp.load."""
    put_bytes = (4 << 20) if ctx.quick else (256 << 20)
    restart_bytes = (4 << 20) if ctx.quick else (1 << 30)
    updates = 10 if ctx.quick else 50
    table = torch.randn(_rows(put_bytes), COLUMNS, generator=torch.Generator().manual_seed(1))
    with ExitStack() as stack:
        folder = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="shardserve-bench-persist-"))
        )
        big = torch.randn(_rows(restart_bytes), COLUMNS, generator=torch.Generator().manual_seed(2))
        with ctx.rss() as peaks:
            modes = {
                mode: write_and_put(
                    ctx, folder / mode, mode, table, updates, big if mode == "always" else None
                )
                for mode in (QUICK_MODES if ctx.quick else MODES)
            }
            bare = bare_writes(folder, table, updates)
            restart = restart_to_serving(folder / "always", big)
            load = dcp_load(folder, big)
    put_case, update_case = (
        f"put {put_bytes >> 20} MiB",
        f"{updates} update_rows of {ROWS_PER_UPDATE} rows",
    )
    update_bytes = updates * ROWS_PER_UPDATE * COLUMNS * 4
    rows = [
        Row(
            "persist",
            put_case,
            "write+fsync",
            bare["put_s"],
            path="filesystem",
            role="baseline",
            nbytes=put_bytes,
        ),
        Row(
            "persist",
            update_case,
            "write+fsync",
            bare["update_s"],
            path="filesystem",
            role="baseline",
            nbytes=update_bytes,
        ),
    ]
    for mode, result in modes.items():
        rows += [
            Row(
                "persist",
                put_case,
                f"put ({mode})",
                result["put_s"],
                path="grpc",
                nbytes=put_bytes,
                ok=result["ok"],
                peak_rss=peaks,
            ),
            Row(
                "persist",
                update_case,
                f"update_rows ({mode})",
                result["update_s"],
                path="grpc",
                nbytes=update_bytes,
                ok=result["ok"],
                extra={"updates_per_s": updates / result["update_s"]},
            ),
        ]
    restart_case = f"restart to serving, {restart_bytes >> 20} MiB on 2 ranks"
    rows += [
        Row(
            "persist",
            restart_case,
            "SIGKILL + up (always)",
            restart["serve_s"],
            path="persist dir",
            nbytes=restart_bytes,
            ok=restart["ok"],
            baseline="dcp.load",
        ),
        Row(
            "persist",
            restart_case,
            "dcp.load",
            load["load_s"],
            path="filesystem",
            role="baseline",
            nbytes=restart_bytes,
            ok=load["ok"],
        ),
    ]
    return rows
