"""One writer process of the cross-client group commit test (tests/cluster/test_updates_cluster.py, which forks
each from its forkserver through server_processes.fork_client).

By hand: group_commit_writer.py COORDINATOR FOLDER INDEX UPDATES. The process connects, writes FOLDER/ready-INDEX,
waits for FOLDER/go, then makes UPDATES update_rows_ordered calls on table TABLE, each of ROWS_PER_UPDATE ids
drawn from the first HOT_ROWS rows (so writers overlap), and saves to FOLDER/result-INDEX.pt (torch.save) every
call it made as (version, order, ids, values) and the errors it met. Nothing is judged here.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from shardserve import connect

TABLE = "upd-groups"
HOT_ROWS, ROWS_PER_UPDATE = 24, 8
START_WAIT_S = 300.0


def update_values(index: int, number: int, ids: torch.Tensor, columns: int) -> torch.Tensor:
    """The rows writer `index` writes in its update `number`: [index, number, seeded floats...]."""
    values = torch.randn(
        ids.numel(), columns, generator=torch.Generator().manual_seed(1000 * index + number)
    )
    values[:, 0] = float(index)
    values[:, 1] = float(number)
    return values


def main(address: str, folder: Path, index: int, updates: int) -> None:
    calls: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    errors: list[str] = []
    generator = torch.Generator().manual_seed(index)
    with connect(address) as client:
        columns = client.tensor(TABLE).shape[1]
        (folder / f"ready-{index}").touch()
        give_up = time.monotonic() + START_WAIT_S
        while not (folder / "go").exists() and time.monotonic() < give_up:
            time.sleep(0.01)
        for number in range(updates):
            ids = torch.randperm(HOT_ROWS, generator=generator)[:ROWS_PER_UPDATE]
            values = update_values(index, number, ids, columns)
            try:
                landed = client.update_rows_ordered(TABLE, ids, values)
            except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
                errors.append(repr(err))
                continue
            calls.append((landed.version, landed.order, ids, values))
    torch.save({"calls": calls, "errors": errors}, folder / f"result-{index}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
