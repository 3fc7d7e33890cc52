"""GPU embedding lookups for the "cuda" scenario: `RemoteEmbeddingBag` called with CUDA ids (2-D input, one
bag per row, mode "mean") over a table served by ranks on this host, against `nn.EmbeddingBag` holding the
same table on the same GPU. Needs CUDA; the caller checks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks.fetch import interleaved_medians
from benchmarks.harness import Row, Target, failure_row

GROUP = "cuda-lookups"
BASELINE = "nn.EmbeddingBag on the GPU"
TARGET = Target(min_ratio=1 / 3)  # within 3x of nn.EmbeddingBag
REPEATS, QUICK_REPEATS = 50, 5


def bag_table(rows: int, dim: int) -> torch.Tensor:
    """The benchmark table, the same numbers in every run."""
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(3))


def bag_rows(
    writer: Any,
    reader: Any,
    table: torch.Tensor,
    spec: Any,
    *,
    ranks: str,
    batch: int,
    bag: int,
    quick: bool,
) -> list[Row]:
    """`RemoteEmbeddingBag` read through `reader` over `table` put by `writer` with `spec` (its ranks described
    by `ranks`) against `nn.EmbeddingBag` on the GPU, on the same CUDA ids."""
    from shardserve import RemoteEmbeddingBag

    case = f"{batch} x {bag} CUDA ids, {table.shape[0]:,} x {table.shape[1]} table, {ranks}"
    ids = torch.randint(0, table.shape[0], (batch, bag), generator=torch.Generator().manual_seed(5))
    ids = ids.cuda()
    local = nn.EmbeddingBag.from_pretrained(table.cuda(), mode="mean")
    theirs = local(ids)
    results: dict[str, torch.Tensor] = {}

    def baseline() -> None:
        local(ids)
        torch.cuda.synchronize()

    try:
        writer.put("cuda-bag", table, spec, overwrite=True, durable=False)
        remote = RemoteEmbeddingBag(reader, "cuda-bag", mode="mean")

        def ours() -> None:
            results["out"] = remote(ids)
            torch.cuda.synchronize()

        seconds, limit = interleaved_medians([ours, baseline], QUICK_REPEATS if quick else REPEATS)
    except Exception as exc:
        return [
            failure_row(GROUP, case, "RemoteEmbeddingBag", exc, baseline=BASELINE, target=TARGET),
            Row(
                GROUP,
                case,
                BASELINE,
                limit_only(baseline, quick),
                path="in-process",
                role="baseline",
            ),
        ]
    out = results["out"]
    ok = out.device == ids.device and torch.allclose(out, theirs, rtol=1e-5, atol=1e-6)
    return [
        Row(
            GROUP,
            case,
            "RemoteEmbeddingBag",
            seconds,
            path="auto",
            baseline=BASELINE,
            ok=bool(ok),
            target=TARGET,
            note=f"result on {out.device}",
        ),
        Row(GROUP, case, BASELINE, limit, path="in-process", role="baseline"),
    ]


def limit_only(baseline: Any, quick: bool) -> float:
    (seconds,) = interleaved_medians([baseline], QUICK_REPEATS if quick else REPEATS)
    return seconds
