"""A GPU trainer's state dict through a cluster on the same host, for the "cuda" scenario: steady
`spmd.put_state_dict` and `get_state_dict` of CUDA tensors (keep=1, durable=False, into preallocated CUDA
tensors), against the copies of the same bytes a single process would make: to and from pinned host memory
for CPU ranks, device to device for CUDA ranks on the same GPU.

The first two puts go into new rank memory and are not timed; from the third on a put fills the snapshot the
one before reserved (the steady state of a weight sync). Needs CUDA; the caller checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.baselines import median_seconds
from benchmarks.harness import Row, Target, failure_row

GROUP = "cuda-statedict"
COLUMNS = 256
TO_PINNED, FROM_PINNED, DEVICE_COPY = (
    "copy to pinned memory",
    "copy from pinned memory",
    "device-to-device copy",
)
CPU_RANK_TARGET = Target(min_ratio=0.7)  # of the pinned copy, put and get each
CUDA_RANK_TARGET = Target(max_seconds=0.010)  # for 1 GiB, put and get each


def cuda_state(count: int, each_bytes: int, seed: float) -> dict[str, torch.Tensor]:
    """`count` float32 CUDA tensors of `each_bytes` each, every one filled with its own value."""
    rows = max(1, each_bytes // 4 // COLUMNS)
    return {
        f"layer{i}.w": torch.full((rows, COLUMNS), seed + i, dtype=torch.float32, device="cuda")
        for i in range(count)
    }


def synced(fn: Callable[[], object]) -> Callable[[], None]:
    """fn, then a wait for the GPU: a timed call ends when its copies have landed."""

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def copy_all(sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    for key, source in sources.items():
        targets[key].copy_(source, non_blocking=True)


def limit_seconds(
    state: dict[str, torch.Tensor], into: dict[str, torch.Tensor], *, host: bool, repeats: int
) -> dict[str, float]:
    """Seconds of the plain copies of `state`'s bytes: to and from pinned host memory (`host`), else from
    device to device."""
    if not host:
        return {DEVICE_COPY: median_seconds(synced(lambda: copy_all(state, into)), repeats)}
    pinned = {key: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for key, t in state.items()}
    return {
        TO_PINNED: median_seconds(synced(lambda: copy_all(state, pinned)), repeats),
        FROM_PINNED: median_seconds(synced(lambda: copy_all(pinned, into)), repeats),
    }


def state_dict_rows(
    cluster: Any,
    ranks: str,
    *,
    count: int,
    each_bytes: int,
    repeats: int,
    peaks: dict[str, int],
) -> list[Row]:
    """Steady put and get of a CUDA state dict through `cluster` (its ranks described by `ranks`: "CPU ranks"
    or "CUDA ranks"), and the limits of the same bytes, measured now; `peaks`: the ranks' RSS window."""
    from shardserve import spmd

    host = ranks.startswith("CPU")
    state, into = cuda_state(count, each_bytes, 1.0), cuda_state(count, each_bytes, 0.0)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    case = f"{count} x {each_bytes >> 20} MiB CUDA state dict, {ranks}"
    prefix = f"cuda-sd-{'cpu' if host else 'cuda'}"
    target = CPU_RANK_TARGET if host else CUDA_RANK_TARGET
    limits = limit_seconds(state, into, host=host, repeats=repeats)
    rows = [
        Row(GROUP, case, name, seconds, path="in-process", role="baseline", nbytes=nbytes)
        for name, seconds in limits.items()
    ]
    put = synced(lambda: spmd.put_state_dict(cluster, state, prefix, keep=1, durable=False))
    get = synced(lambda: spmd.get_state_dict(cluster, prefix, into=into))
    for name, run, baseline in (
        ("put_state_dict (steady)", put, TO_PINNED if host else DEVICE_COPY),
        ("get_state_dict", get, FROM_PINNED if host else DEVICE_COPY),
    ):
        fields: dict[str, Any] = {"baseline": baseline, "nbytes": nbytes, "target": target}
        try:
            if name.startswith("put"):
                put()  # into new rank memory; the timed puts (after one more warm-up) fill reservations
            seconds = median_seconds(run, repeats)
        except Exception as exc:
            rows.append(failure_row(GROUP, case, name, exc, **fields))
            continue
        ok = None
        if name.startswith("get"):
            ok = all(torch.equal(into[key], state[key]) for key in state)
        rows.append(Row(GROUP, case, name, seconds, path="auto", peak_rss=peaks, ok=ok, **fields))
    return rows
