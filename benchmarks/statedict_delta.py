"""Delta puts in the weight-sync loop: a 1 GiB state dict of which one 16 MiB tensor changed between puts.

One process puts 64 x 16 MiB of fp32 (1 GiB; --quick: 16 x 1 MiB) through a 2-rank cluster (shared memory,
durable=False, keep=2): the steady full put (the reserved snapshot filled in place) against the delta put
(spmd.put_state_dict(..., delta=True)) and the delta put that trusts torch's version counters
(delta="version_counters": only the tensor written since is read), each after a different tensor was changed
in place, best and median of the repeats after the warm-up puts. The load average is printed and kept in each
row's note: the delta put hashes every block of the state dict (xxh3 on every core), so on a loaded machine the
ratio says little.

    python -m benchmarks.statedict_delta [--tensors 64] [--each-mib 16] [--quick]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.harness import Row
from benchmarks.statedict_casts import _load, _state
from benchmarks.statedict_cli import each_bytes, run_on_two_ranks, size_parser

MiB = 1 << 20
TENSORS, EACH = 64, 16 * MiB
QUICK_TENSORS, QUICK_EACH = 16, MiB
REPEATS, QUICK_REPEATS = 7, 3


def _timed_puts(
    cluster: Any, state: dict[str, torch.Tensor], prefix: str, *, delta: bool | str, repeats: int
) -> tuple[list[float], list[float], list[float]]:
    """Seconds of each put after the warm-up ones, a different tensor changed before each; of the get into
    preallocated tensors right after each put, and of the same get once more (what a repeated get costs)."""
    from shardserve import spmd

    keys = list(state)
    into = {key: torch.empty_like(t) for key, t in state.items()}
    for _ in range(2):  # the first full put, then the steady path (a reservation, or the hashes)
        spmd.put_state_dict(cluster, state, prefix, keep=2, durable=False, delta=delta)
        spmd.get_state_dict(cluster, prefix, into=into)
    puts, gets, again = [], [], []
    for k in range(repeats):
        state[keys[k % len(keys)]].add_(1.0)
        for seconds, step in (
            (
                puts,
                lambda: spmd.put_state_dict(
                    cluster, state, prefix, keep=2, durable=False, delta=delta
                ),
            ),
            (gets, lambda: spmd.get_state_dict(cluster, prefix, into=into)),
            (again, lambda: spmd.get_state_dict(cluster, prefix, into=into)),
        ):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
    return puts, gets, again


def delta_case(cluster: Any, count: int, each: int, repeats: int) -> dict[str, Any]:
    """Full, delta and trusting delta put seconds (best, median), the medians of the get right after each
    kind of put and of the same get repeated, whether the last snapshot of each delta put read back bit for
    bit, and the load average before and after."""
    from shardserve import spmd

    state = _state(count, each, torch.float32, seed=2)
    load_before = _load()
    out: dict[str, Any] = {}
    ok = True
    for kind, delta in (("full", False), ("delta", True), ("trusted", "version_counters")):
        prefix = f"{kind}{count}x{each}"
        puts, gets, again = _timed_puts(cluster, state, prefix, delta=delta, repeats=repeats)
        out[kind] = (min(puts), statistics.median(puts))
        out[f"{kind} get"] = (statistics.median(gets), statistics.median(again))
        if delta:
            back = {key: torch.zeros_like(t) for key, t in state.items()}
            spmd.get_state_dict(cluster, prefix, into=back)
            ok = ok and all(torch.equal(back[key], state[key]) for key in state)
    return out | {"ok": ok, "load": f"load average {load_before} before, {_load()} after"}


def delta_rows(
    cluster: Any, *, quick: bool, count: int | None = None, each: int | None = None
) -> list[Row]:
    """The delta put rows, measured through `cluster` (a 2-rank LocalCluster on this host); the load average
    printed and kept in each row's note."""
    from shardserve import connect

    count = count or (QUICK_TENSORS if quick else TENSORS)
    each = each or (QUICK_EACH if quick else EACH)
    with connect(cluster.address) as client:
        r = delta_case(client, count, each, QUICK_REPEATS if quick else REPEATS)
    full_best, full_median = r["full"]
    case, total = f"{count} x {each >> 10} KiB fp32, one tensor changed", count * each
    rows = []
    for kind, method in (
        ("delta", "put_state_dict delta"),
        ("trusted", "put_state_dict delta trusted"),
    ):
        best, median = r[kind]
        note = (
            f"best {best * 1e3:.1f} / median {median * 1e3:.1f} ms against the full put's "
            f"{full_best * 1e3:.1f} / {full_median * 1e3:.1f} ms; {r['load']}"
        )
        print(
            f"statedict {method}, {count} x {each >> 10} KiB fp32, one changed: {note}", flush=True
        )
        rows.append(
            Row(
                "statedict-delta",
                case,
                method,
                median,
                nbytes=total,
                baseline="put_state_dict full",
                path="shm",
                ok=r["ok"],
                note=note,
                extra={"best_s": best},
            )
        )
    for kind, label in (("full", "full"), ("delta", "delta"), ("trusted", "delta trusted")):
        after, again = r[f"{kind} get"]
        note = f"median {after * 1e3:.1f} ms against {again * 1e3:.1f} ms repeated; {r['load']}"
        print(f"statedict get_state_dict after a {label} put: {note}", flush=True)
        rows += [
            Row(
                "statedict-delta",
                case,
                f"get_state_dict after a {label} put",
                after,
                nbytes=total,
                baseline=f"get_state_dict again ({label})",
                path="shm",
                ok=r["ok"],
                note=note,
            ),
            Row(
                "statedict-delta",
                case,
                f"get_state_dict again ({label})",
                again,
                nbytes=total,
                role="baseline",
                path="shm",
                note="the same get once more: its mappings and leases all kept",
            ),
        ]
    return rows + [
        Row(
            "statedict-delta",
            case,
            "put_state_dict full",
            full_median,
            nbytes=total,
            role="baseline",
            path="shm",
            note=f"the steady full put (reserved snapshot); {r['load']}",
            extra={"best_s": full_best},
        ),
    ]


def main() -> None:
    args = size_parser(__doc__.splitlines()[0], quick_help="16 x 1 MiB, 3 repeats").parse_args()
    run_on_two_ranks(
        lambda cluster: delta_rows(
            cluster, quick=args.quick, count=args.tensors, each=each_bytes(args)
        )
    )


if __name__ == "__main__":
    main()
