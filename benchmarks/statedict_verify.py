"""Verified reads against plain ones: what checking every byte against its shard's checksum costs a get.

One process puts 64 x 16 MiB of fp32 (1 GiB; --quick: 16 x 1 MiB) and one 256 MiB tensor (--quick: 16 MiB)
through a 2-rank cluster (shared memory, durable=False) and reads each back into preallocated tensors, plain and
with verify=True, the two alternating round after round in the same process (so load swings hit both alike);
best and median of the rounds. A verified read of a whole shard through shared memory hashes the bytes as it
copies them (client.paths.copies.copy_checked), so it should cost little more than the plain read: the target
is the verified read within 1.3x of the plain one. The load average is printed and kept in each row's note.

    python -m benchmarks.statedict_verify [--quick] [--rounds 7]
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Row, Target
from benchmarks.statedict_cli import each_bytes, run_on_two_ranks, size_parser

MiB = 1 << 20
TENSORS, EACH, ONE = 64, 16 * MiB, 256 * MiB
QUICK_TENSORS, QUICK_EACH, QUICK_ONE = 16, MiB, 16 * MiB
ROUNDS, QUICK_ROUNDS = 7, 3
LIMIT = 1.3  # verified within this factor of the plain read
TARGET = Target(min_ratio=1 / LIMIT)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def alternating(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each of `runs` per round, the runs taking turns within every round (after one warm-up
    round), so that a change of load meets them all."""
    for run in runs.values():
        run()
    spent: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            spent[name].append(time.perf_counter() - start)
    return spent


def verify_case(client: Any, *, count: int, each: int, one: int, rounds: int) -> dict[str, Any]:
    """Seconds per round of the plain and verified get_state_dict and fetch, whether what they read is bit for
    bit what was put, and the load average before and after."""
    from shardserve import spmd

    generator = torch.Generator().manual_seed(3)
    state = {
        f"layer{i}.w": torch.randn((each // 4 // 256, 256), generator=generator)
        for i in range(count)
    }
    into = {key: torch.zeros_like(t) for key, t in state.items()}
    big = torch.randn((one // 4 // 1024, 1024), generator=generator)
    landed = torch.zeros_like(big)
    load_before = _load()
    spmd.put_state_dict(client, state, "verified-sd", keep=1, durable=False)
    proxy = client.put("verified-one", big, overwrite=True)
    shape = tuple(big.shape)
    spent = alternating(
        {
            "get": lambda: spmd.get_state_dict(client, "verified-sd", into=into),
            "get verify": lambda: spmd.get_state_dict(
                client, "verified-sd", into=into, verify=True
            ),
            "fetch": lambda: proxy.fetch((0, 0), shape, out=landed),
            "fetch verify": lambda: proxy.fetch((0, 0), shape, out=landed, verify=True),
        },
        rounds,
    )
    ok = all(torch.equal(into[key], state[key]) for key in state) and torch.equal(landed, big)
    return {"spent": spent, "ok": ok, "load": f"load average {load_before} before, {_load()} after"}


def verify_rows(
    cluster: Any,
    *,
    quick: bool,
    count: int | None = None,
    each: int | None = None,
    rounds: int | None = None,
) -> list[Row]:
    """The verify rows, measured through `cluster` (a 2-rank LocalCluster on this host): each verified read's
    median against the plain read's (target: within 1.3x), the best and median of both and the load average
    printed and kept in the rows' notes."""
    from shardserve import connect

    count = count or (QUICK_TENSORS if quick else TENSORS)
    each = each or (QUICK_EACH if quick else EACH)
    one = QUICK_ONE if quick else ONE
    with connect(cluster.address) as client:
        r = verify_case(
            client,
            count=count,
            each=each,
            one=one,
            rounds=rounds or (QUICK_ROUNDS if quick else ROUNDS),
        )
    spent = r["spent"]
    median = {name: statistics.median(times) for name, times in spent.items()}
    for name, times in spent.items():
        print(
            f"statedict verify: {name:12} best {min(times) * 1e3:7.1f} ms, median {median[name] * 1e3:7.1f} ms",
            flush=True,
        )
    for plain in ("get", "fetch"):
        ratio = median[f"{plain} verify"] / median[plain]
        print(
            f"statedict verify: {plain} verify / {plain} = {ratio:.2f} (limit {LIMIT}) {r['load']}",
            flush=True,
        )
    cases = {
        "get": (f"{count} x {each >> 10} KiB fp32, one process", count * each, "get_state_dict"),
        "fetch": (f"one {one >> 20} MiB fp32 tensor, one process", one, "fetch"),
    }
    rows = []
    for plain, (case, total, label) in cases.items():
        rows += [
            Row(
                "statedict-verify",
                case,
                f"{label} verify",
                median[f"{plain} verify"],
                path="shm",
                nbytes=total,
                ok=r["ok"],
                baseline=label,
                target=TARGET,
                note=f"best {min(spent[f'{plain} verify']) * 1e3:.1f} ms; {r['load']}",
            ),
            Row(
                "statedict-verify",
                case,
                label,
                median[plain],
                path="shm",
                role="baseline",
                nbytes=total,
                note=f"best {min(spent[plain]) * 1e3:.1f} ms, the same reads without verify",
            ),
        ]
    return rows


def main() -> None:
    parser = size_parser(__doc__.splitlines()[0], quick_help="16 x 1 MiB and 16 MiB, 3 rounds")
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (plain and verify alternate)"
    )
    args = parser.parse_args()
    run_on_two_ranks(
        lambda cluster: verify_rows(
            cluster, quick=args.quick, count=args.tensors, each=each_bytes(args), rounds=args.rounds
        ),
        width=40,
    )


if __name__ == "__main__":
    main()
