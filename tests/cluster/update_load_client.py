"""One client process of the online-update load (tests/cluster/test_update_load.py, which forks each from its
forkserver through server_processes.fork_client).

By hand: update_load_client.py ROLE COORDINATOR FOLDER INDEX SECONDS, ROLE one of lookup-auto, lookup-grpc, fetch,
writer. The process connects, writes FOLDER/ready-INDEX, waits for FOLDER/go, runs its role for SECONDS and
saves what it saw to FOLDER/result-INDEX.pt (torch.save of a dict): readers their answers (checked by the test
against the versions the writer committed), the writer every update it committed (version, ids, values), and
every process the errors it met. Nothing is judged here: the test compares the answers bit for bit.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardserve import connect
from shardserve.core import ChunkShardingSpec

TABLE, SQUARE = "load-table", "load-square"
ROWS, COLUMNS = (
    20_000,
    8,
)  # column 0 of a row: the writer's number of the update that wrote it (0: the put)
SQUARE_SIZE = 1024
LOOKUP_IDS, UPDATE_ROWS, FETCH_ROWS = 256, 64, 500
UPDATE_EVERY_S, RESHARD_EVERY_S = 0.05, 1.0
READS_KEPT = 3000  # answers saved per reader (later ones are still checked for errors, not saved)
START_WAIT_S = 300.0
SQUARE_SPECS = (
    ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]),
    ChunkShardingSpec(1, ["rank:2/cpu", "rank:1/cpu"]),
)


def initial_table() -> torch.Tensor:
    """The table as put: row i is [0, i, six seeded floats]."""
    table = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(1))
    table[:, 0] = 0
    table[:, 1] = torch.arange(ROWS, dtype=torch.float32)
    return table


def square() -> torch.Tensor:
    """The second tensor (resharded by the writer, never changed): seeded floats."""
    return torch.randn(SQUARE_SIZE, SQUARE_SIZE, generator=torch.Generator().manual_seed(2))


def update_values(number: int, ids: torch.Tensor) -> torch.Tensor:
    """The rows update `number` writes at `ids`: [number, id, six seeded floats]."""
    values = torch.randn(
        ids.numel(), COLUMNS, generator=torch.Generator().manual_seed(1000 + number)
    )
    values[:, 0] = float(number)
    values[:, 1] = ids.to(torch.float32)
    return values


def _lookups(client: Any, until: float, seed: int, out: dict) -> None:
    generator = torch.Generator().manual_seed(seed)
    while time.monotonic() < until:
        ids = torch.randint(0, ROWS, (LOOKUP_IDS,), generator=generator)
        _attempt(out, lambda: client.lookup({TABLE: ids})[TABLE], lambda rows: (ids, rows))


def _fetches(client: Any, until: float, seed: int, out: dict) -> None:
    generator = torch.Generator().manual_seed(seed)
    reference = square()
    while time.monotonic() < until:
        start = int(torch.randint(0, ROWS - FETCH_ROWS, (1,), generator=generator))
        _attempt(
            out,
            lambda: client.tensor(TABLE).fetch([start, 0], [FETCH_ROWS, COLUMNS]),
            lambda rows: (torch.arange(start, start + FETCH_ROWS), rows),
        )
        corner = int(torch.randint(0, SQUARE_SIZE // 2, (1,), generator=generator))
        box = (
            slice(corner, corner + SQUARE_SIZE // 2),
            slice(corner // 2, corner // 2 + SQUARE_SIZE // 2),
        )
        try:
            got = client.tensor(SQUARE).fetch(
                [corner, corner // 2], [SQUARE_SIZE // 2, SQUARE_SIZE // 2]
            )
            out["square_reads"] += 1
            if not torch.equal(got, reference[box]):
                out["wrong"].append(f"box of {SQUARE} at {corner} differs")
        except Exception as err:  # noqa: BLE001 - every failure is reported to the test
            out["errors"].append(f"fetch {SQUARE}: {err!r}")


def _attempt(
    out: dict, read: Callable[[], torch.Tensor], keep: Callable[[torch.Tensor], tuple]
) -> None:
    """One read: its answer kept for the test (up to READS_KEPT), its failure reported."""
    try:
        rows = read()
    except Exception as err:  # noqa: BLE001 - every failure is reported to the test
        out["errors"].append(repr(err))
        return
    out["reads"] += 1
    if len(out["answers"]) < READS_KEPT:
        out["answers"].append(keep(rows))


def _writes(client: Any, until: float, seed: int, out: dict) -> None:
    generator = torch.Generator().manual_seed(seed)
    resharder = threading.Thread(target=_reshards, args=(client, until, out))
    resharder.start()
    tick, number = time.monotonic(), 0
    while time.monotonic() < until:
        number += 1
        ids = torch.randint(0, ROWS, (UPDATE_ROWS,), generator=generator).unique()
        values = update_values(number, ids)
        try:
            out["updates"].append((client.update_rows(TABLE, ids, values), number, ids))
        except Exception as err:  # noqa: BLE001 - every failure is reported to the test
            out["errors"].append(f"update {number}: {err!r}")
        tick += UPDATE_EVERY_S
        time.sleep(max(0.0, tick - time.monotonic()))
    resharder.join()


def _reshards(client: Any, until: float, out: dict) -> None:
    turn = 0
    while time.monotonic() + RESHARD_EVERY_S < until:
        time.sleep(RESHARD_EVERY_S)
        turn += 1
        try:
            client.tensor(SQUARE).reshard(SQUARE_SPECS[turn % 2])
            out["reshards"] += 1
        except Exception as err:  # noqa: BLE001 - every failure is reported to the test
            out["errors"].append(f"reshard {turn}: {err!r}")


ROLES = {
    "lookup-auto": ("auto", _lookups),
    "lookup-grpc": ("grpc", _lookups),
    "fetch": ("auto", _fetches),
    "writer": ("auto", _writes),
}


def main(role: str, address: str, folder: str, index: int, seconds: float) -> None:
    transport, run = ROLES[role]
    out: dict = {
        "role": role,
        "errors": [],
        "wrong": [],
        "answers": [],
        "updates": [],
        "reads": 0,
        "square_reads": 0,
        "reshards": 0,
    }
    with connect(address, transport=transport) as client:
        client.tensor(TABLE)  # metadata cached before the clock starts
        Path(folder, f"ready-{index}").touch()
        give_up = time.monotonic() + START_WAIT_S
        while not Path(folder, "go").exists():
            if time.monotonic() > give_up:
                raise TimeoutError("the test never said go")
            time.sleep(0.01)
        run(client, time.monotonic() + seconds, index, out)
    torch.save(out, Path(folder, f"result-{index}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
