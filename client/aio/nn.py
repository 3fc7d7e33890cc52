"""AsyncEmbeddingBag: nn.EmbeddingBag's forward over a table served by the cluster, awaited.

It wraps the blocking RemoteEmbeddingBag (`blocking`: the same input forms, checks and pooling) and runs its
forward off the event loop: `await bag(ids, offsets)` gives what `nn.EmbeddingBag(...)(ids, offsets)` holding
the cluster's table would give, for a batch of requests in one call.
"""

from __future__ import annotations

import torch

from shardserve.client.aio.session import AioSession
from shardserve.client.nn import RemoteEmbeddingBag


class AsyncEmbeddingBag:
    """Pooled bags of one 2-D table, `await bag(input, offsets, per_sample_weights)`; made by
    AsyncCluster.embedding_bag."""

    def __init__(self, session: AioSession, blocking: RemoteEmbeddingBag) -> None:
        self._session = session
        self.blocking = blocking

    @property
    def name(self) -> str:
        return self.blocking.name

    @property
    def num_embeddings(self) -> int:
        return self.blocking.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.blocking.embedding_dim

    async def __call__(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RemoteEmbeddingBag.forward(input, offsets, per_sample_weights), off the loop."""
        return await self._session.run(
            lambda: self.blocking(input, offsets, per_sample_weights),
            f"bag lookup in {self.name!r}",
        )

    def __repr__(self) -> str:
        return f"AsyncEmbeddingBag({self.blocking.extra_repr()})"
