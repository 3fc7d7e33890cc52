"""A shardserve client driven by JSON lines on stdin, one JSON answer per line on stdout.

Usage: two_host_client.py COORDINATOR [CALL_TIMEOUT_S]. tests/cluster/test_two_hosts.py runs it in another
network namespace (`ip netns exec NS python two_host_client.py COORDINATOR 4`) and drives it by commands.
Every tensor a command names is made from a seed with plain torch, and answers compare the cluster's bytes
with it bit for bit. An answer is {"ok": true, ...} or {"ok": false, "error": exception class name,
"message": ...}, with "seconds": how long the command took.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardserve import RankUnavailableError, connect
from shardserve.core import ChunkShardingSpec

PLACEMENTS = ["rank:0/cpu", "rank:1/cpu"]


def reference(seed: int, rows: int, cols: int) -> torch.Tensor:
    """The plain-torch tensor of `seed`, float32 [rows, cols]."""
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


class Driver:
    """The commands, over one connected client."""

    def __init__(self, address: str, timeout: float) -> None:
        self.cluster = connect_when_up(address, timeout)
        self.tcp = connect(address, timeout=timeout, transport="bulk")
        self.grpc = connect(address, timeout=timeout, transport="grpc")
        self.expected: dict[str, torch.Tensor] = {}

    def _client(self, transport: str) -> Any:
        return {"auto": self.cluster, "bulk": self.tcp, "grpc": self.grpc}[transport]

    def put(self, name: str, seed: int, rows: int, cols: int, dim: int = 0) -> dict:
        table = reference(seed, rows, cols)
        remote = self.cluster.put(name, table, ChunkShardingSpec(dim, PLACEMENTS), overwrite=True)
        self.expected[name] = table
        return {"version": remote.version}

    def check(self, name: str, transport: str = "auto") -> dict:
        """The whole tensor read by `transport`, compared bit for bit; also the ranks that hold it."""
        remote = self._client(transport).tensor(name)
        got = remote.full_tensor()
        return {
            "equal": torch.equal(got, self.expected[name]),
            "version": remote.version,
            "ranks": sorted(remote.remote_shards()),
            "dim": _split_dim(remote),
        }

    def read(
        self, name: str, offsets: list[int], sizes: list[int], transport: str = "auto"
    ) -> dict:
        """One box, compared bit for bit with the same box of the reference."""
        got = self._client(transport).tensor(name).fetch(offsets, sizes)
        want = self.expected[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        return {"equal": torch.equal(got, want)}

    def lookup(self, name: str, ids: list[int], transport: str = "auto") -> dict:
        index = torch.tensor(ids, dtype=torch.int64)
        got = self._client(transport).tensor(name).lookup(index)
        return {"equal": torch.equal(got, F.embedding(index, self.expected[name]))}

    def update_rows(self, name: str, ids: list[int], seed: int) -> dict:
        index = torch.tensor(ids, dtype=torch.int64)
        values = reference(seed, len(ids), self.expected[name].shape[1])
        version = self.cluster.tensor(name).update_rows(index, values)
        self.expected[name] = self.expected[name].clone()
        self.expected[name][index] = values
        return {"version": version}

    def reshard(self, name: str, dim: int, timeout: float | None = None) -> dict:
        remote = self.cluster.tensor(name).reshard(
            ChunkShardingSpec(dim, PLACEMENTS), timeout=timeout
        )
        return {"version": remote.version, "dim": _split_dim(remote)}

    def first_good_read(
        self, name: str, offsets: list[int], sizes: list[int], transport: str, limit: float
    ) -> dict:
        """Read the box again and again (every 20 ms) with this long-lived client until a read is whole and
        equal, at most `limit` seconds: how long the client takes to read a returned rank again."""
        start, deadline = time.monotonic(), time.monotonic() + limit
        want = self.expected[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        while True:
            try:
                if torch.equal(self._client(transport).tensor(name).fetch(offsets, sizes), want):
                    return {"reached": True, "after": time.monotonic() - start}
            except Exception:  # noqa: BLE001 - any failure means "not yet"
                pass
            if time.monotonic() > deadline:
                return {"reached": False, "after": time.monotonic() - start}
            time.sleep(0.02)

    def ranks(self) -> dict:
        return {"alive": {str(r.rank): r.alive for r in self.cluster.ranks()}}

    def wait_alive(self, rank: int, alive: bool, limit: float) -> dict:
        """Poll the coordinator until `rank` is (or is not) alive, at most `limit` seconds."""
        deadline = time.monotonic() + limit
        while True:
            now = {r.rank: r.alive for r in self.cluster.ranks()}
            if now.get(rank) == alive or time.monotonic() > deadline:
                return {"reached": now.get(rank) == alive}
            time.sleep(0.1)

    def health(self, name: str) -> dict:
        remote = self.cluster.tensor(name)
        return {"health": remote.health, "version": remote.version}

    def same_host(self) -> dict:
        """Which ranks this client would read through shared memory."""
        policy = self.cluster.session.paths
        return {"mapped": {str(r.rank): policy.maps(r) for r in self.cluster.ranks()}}


def connect_when_up(address: str, timeout: float, limit: float = 60.0) -> Any:
    """connect(), retried while the coordinator is not serving yet (it starts beside this client)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            return connect(address, timeout=timeout)
        except RankUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _split_dim(remote: Any) -> int:
    """The dim along which the shards differ (-1 for one shard)."""
    shards = remote.metadata().shards_metadata
    for dim in range(len(remote.shape)):
        if len({s.shard_offsets[dim] for s in shards}) > 1:
            return dim
    return -1


def answer(run: Callable[[], dict]) -> dict:
    start = time.monotonic()
    try:
        result = {"ok": True, **run()}
    except Exception as err:  # noqa: BLE001 - every failure is an answer the test checks
        result = {"ok": False, "error": type(err).__name__, "message": str(err)}
    result["seconds"] = round(time.monotonic() - start, 3)
    return result


def main() -> int:
    driver = Driver(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 30.0)
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        print(json.dumps(answer(lambda: getattr(driver, op)(**command))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
