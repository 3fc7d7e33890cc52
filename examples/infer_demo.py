"""Inference against `shardserve up --demo`: a bag-of-ids model whose embedding table lives on the cluster.

    shardserve up --ranks 2 --demo            # prints: coordinator: HOST:PORT
    python examples/infer_demo.py HOST:PORT

The only change from local inference is the one line building the
EmbeddingBag: `RemoteEmbeddingBag(cluster, "demo", mode="mean")` instead of
`nn.EmbeddingBag.from_pretrained(table, mode="mean")`.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from shardserve import RemoteEmbeddingBag, connect


class BagClassifier(nn.Module):
    """Mean of the embeddings of a bag of ids, then a linear layer."""

    def __init__(self, embedding: nn.Module, dim: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids, offsets))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("coordinator", help="HOST:PORT printed by `shardserve up --demo`")
    parser.add_argument("--batch", type=int, default=256, help="bags per batch")
    parser.add_argument("--bag", type=int, default=20, help="ids per bag")
    args = parser.parse_args()
    torch.manual_seed(0)
    with connect(args.coordinator) as cluster:
        model = BagClassifier(RemoteEmbeddingBag(cluster, "demo", mode="mean")).eval()
        ids = torch.randint(0, 1_000_000, (args.batch * args.bag,))
        offsets = torch.arange(0, ids.numel(), args.bag)
        with torch.no_grad():
            times = []
            for _ in range(
                2
            ):  # the first call also opens connections (and maps shards on this host)
                start = time.perf_counter()
                logits = model(ids, offsets)
                times.append(time.perf_counter() - start)
        print(
            f"{args.batch} bags of {args.bag} ids -> logits {tuple(logits.shape)} in {times[1] * 1e3:.1f} ms "
            f"(first call {times[0] * 1e3:.1f} ms)"
        )
        print("predicted classes of the first 8 bags:", logits.argmax(dim=1)[:8].tolist())


if __name__ == "__main__":
    main()
