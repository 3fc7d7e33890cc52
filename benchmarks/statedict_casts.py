"""Weight sync with a cast in flight: a trainer's fp32 state dict got by inference as bf16, on one host.

One process puts 64 x 16 MiB of fp32 (1 GiB; --quick: 16 x 1 MiB) through a 2-rank cluster (shared memory,
durable=False, keep=1) and gets it into preallocated bf16 tensors, against torch's `copy_` of the same fp32
tensors into touched bf16 ones in the same process (the same cast, every core), and against the plain fp32 get;
the median after one warm-up round (benchmarks.baselines.median_seconds). The load average is printed and kept
in each row's note: torch's copy_ uses every core, so on a loaded machine the ratio says little.

    python -m benchmarks.statedict_casts [--tensors 64] [--each-mib 16] [--quick]
"""

from __future__ import annotations

import os
from typing import Any

import torch

from benchmarks.baselines import median_seconds
from benchmarks.harness import Row
from benchmarks.statedict_cli import each_bytes, run_on_two_ranks, size_parser

MiB = 1 << 20
TENSORS, EACH = 64, 16 * MiB
QUICK_TENSORS, QUICK_EACH = 16, MiB
REPEATS, QUICK_REPEATS = 5, 3


def _state(count: int, each: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    rows = each // 4 // 256
    generator = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}.w": torch.randn((rows, 256), generator=generator).to(dtype) for i in range(count)
    }


def _copy_all(sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    for key, source in sources.items():
        targets[key].copy_(source)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def cast_case(cluster: Any, count: int, each: int, repeats: int) -> dict[str, Any]:
    """Seconds of the bf16 get of an fp32 snapshot, of the plain fp32 get, of copy_ with the cast; whether the
    bf16 get matched `src.to(torch.bfloat16)` bit for bit; the load average before and after."""
    from shardserve import spmd

    prefix = f"cast{count}x{each}"
    state = _state(count, each, torch.float32, seed=1)
    halves = {key: torch.zeros_like(t, dtype=torch.bfloat16) for key, t in state.items()}
    whole = {key: torch.zeros_like(t) for key, t in state.items()}
    load_before = _load()
    spmd.put_state_dict(cluster, state, prefix, keep=1, durable=False)
    out = {
        "get bf16": median_seconds(
            lambda: spmd.get_state_dict(cluster, prefix, into=halves), repeats
        ),
        "get fp32": median_seconds(
            lambda: spmd.get_state_dict(cluster, prefix, into=whole), repeats
        ),
        "copy_ bf16": median_seconds(lambda: _copy_all(state, halves), repeats),
    }
    spmd.get_state_dict(cluster, prefix, into=halves)
    out["ok"] = all(
        torch.equal(halves[key].view(torch.int16), state[key].to(torch.bfloat16).view(torch.int16))
        for key in state
    )
    out["load"] = f"load average {load_before} before, {_load()} after"
    return out


def cast_rows(
    cluster: Any, *, quick: bool, count: int | None = None, each: int | None = None
) -> list[Row]:
    """The cast rows, measured through `cluster` (a 2-rank LocalCluster on this host), `count` x `each` bytes of
    fp32 (the defaults: 1 GiB, or 16 MiB when `quick`); the load average printed and kept in each row's note."""
    from shardserve import connect

    count = count or (QUICK_TENSORS if quick else TENSORS)
    each = each or (QUICK_EACH if quick else EACH)
    with connect(cluster.address) as client:
        r = cast_case(client, count, each, QUICK_REPEATS if quick else REPEATS)
    print(f"statedict casts, {count} x {each >> 10} KiB fp32: {r['load']}", flush=True)
    case, total = f"{count} x {each >> 10} KiB fp32 into bf16, one process", count * each
    subject = {"path": "shm", "ok": r["ok"], "note": r["load"]}
    return [
        Row(
            "statedict-cast",
            case,
            "get_state_dict bf16",
            r["get bf16"],
            nbytes=total,
            baseline="copy_ bf16",
            **subject,
        ),
        Row(
            "statedict-cast",
            case,
            "get_state_dict fp32",
            r["get fp32"],
            nbytes=total,
            baseline="copy_ bf16",
            **subject,
        ),
        Row(
            "statedict-cast",
            case,
            "copy_ bf16",
            r["copy_ bf16"],
            nbytes=total,
            role="baseline",
            path="memory",
            note="fp32 into touched bf16 tensors, same process",
        ),
    ]


def main() -> None:
    args = size_parser(__doc__.splitlines()[0], quick_help="16 x 1 MiB, 3 repeats").parse_args()
    run_on_two_ranks(
        lambda cluster: cast_rows(
            cluster, quick=args.quick, count=args.tensors, each=each_bytes(args)
        )
    )


if __name__ == "__main__":
    main()
