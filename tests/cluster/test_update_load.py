"""The online-update load as a short test: 16 client processes on a 3-rank cluster (default grace period).

12 processes look up 256 random ids (8 on the default path, mapped shards on this host; 4 over gRPC), 3 fetch
boxes of the table and of a second tensor, and 1 writer updates 64 rows every 50 ms while resharding the second
tensor every second. Afterwards: no read failed, no update failed or was aborted, and every answer equals the
table at one committed version bit for bit (the writer's values carry the number of the update that wrote
them, which narrows the versions an answer can be).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import update_load_client as load
from server_processes import fork_client, run_together

from shardserve import connect
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.launcher import LocalCluster

RUN_S = 3.0
START_TIMEOUT_S = 240.0  # 16 processes connecting on a busy 2-core host
ROLES = ["lookup-auto"] * 8 + ["lookup-grpc"] * 4 + ["fetch"] * 3 + ["writer"]


def _run_load(address: str, folder: Path) -> list[dict]:
    """Start the 16 clients, let them go together once all are connected, and collect what each saw. Each is a
    process of its own forked from the preloaded forkserver the ranks come from (torch imported once, not 16
    times), its output in its log file."""
    processes = [
        fork_client(folder / f"log-{k}.txt", load.main, role, address, str(folder), k, RUN_S)
        for k, role in enumerate(ROLES)
    ]
    run_together(processes, folder, START_TIMEOUT_S)
    return [torch.load(folder / f"result-{k}.pt") for k in range(len(ROLES))]


def _states(updates: list[tuple[int, int, torch.Tensor]]) -> tuple[list[int], list[torch.Tensor]]:
    """The table at every committed version, in version order (the put's, then after each update), and the number
    of the update that made each (0: the put)."""
    numbers, tables, table = [0], [load.initial_table()], load.initial_table()
    for _, number, ids in sorted(updates, key=lambda u: u[0]):
        table[ids] = load.update_values(number, ids)
        numbers.append(number)
        tables.append(table.clone())
    return numbers, tables


def _is_a_committed_version(
    ids: torch.Tensor, rows: torch.Tensor, numbers: list[int], tables: list[torch.Tensor]
) -> bool:
    """Whether `rows` equal rows `ids` of one committed table: tried from the version of the newest update the
    answer shows, on until a table holds a newer update of those rows than the answer does."""
    newest = int(rows[:, 0].max())
    for table in tables[numbers.index(newest) :]:
        expected = table[ids]
        if torch.equal(rows, expected):
            return True
        if bool((expected[:, 0] > rows[:, 0]).any()):
            return False
    return False


@pytest.mark.slow
def test_sixteen_clients_read_while_one_writes_and_reshards(
    cluster3: LocalCluster, tmp_path: Path
) -> None:
    """Zero failed reads, zero failed or aborted updates, zero wrong answers under the issue's mixed load."""
    with connect(cluster3.address) as admin:
        admin.put(
            load.TABLE,
            load.initial_table(),
            spec=ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(3)]),
        )
        admin.put(load.SQUARE, load.square(), spec=load.SQUARE_SPECS[0])
    try:
        results = _run_load(cluster3.address, tmp_path)
    finally:
        with connect(cluster3.address) as admin:
            final = admin.tensor(load.TABLE).full_tensor()
            square = admin.tensor(load.SQUARE).full_tensor()
            admin.delete(load.TABLE)
            admin.delete(load.SQUARE)
    assert [(r["role"], e) for r in results for e in r["errors"]] == []
    assert [w for r in results for w in r["wrong"]] == []
    writer = results[ROLES.index("writer")]
    assert writer["updates"] and writer["reshards"] >= 1
    updates = writer["updates"]
    assert [u[0] for u in updates] == sorted(
        {u[0] for u in updates}
    )  # one writer: a new version per call, in order
    numbers, tables = _states(updates)
    assert torch.equal(final, tables[-1])
    assert torch.equal(square, load.square())
    answers = [answer for r in results if r["role"] != "writer" for answer in r["answers"]]
    assert all(r["reads"] > 0 for r in results if r["role"] != "writer")
    wrong = [
        k
        for k, (ids, rows) in enumerate(answers)
        if not _is_a_committed_version(ids, rows, numbers, tables)
    ]
    assert wrong == [], f"{len(wrong)} of {len(answers)} answers match no committed version"
