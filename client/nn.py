"""Drop-in nn.Modules for inference: RemoteEmbedding (nn.Embedding) and RemoteEmbeddingBag (nn.EmbeddingBag).

Their forward gives what nn.Embedding / nn.EmbeddingBag holding the cluster's
table would give (the same input forms: any-shape ids for Embedding; 2-D ids,
or 1-D ids with offsets, for EmbeddingBag), so inference code swaps one line.
No parameters, no gradients: the weights stay on the cluster. Ids on a GPU are answered on
that GPU: looked up and pooled there against CUDA shards mapped on this host, else gathered from mapped rows
on the CPU with only the result copied up (client.embedding.routes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardserve.client.arguments import tensor_name
from shardserve.client.cluster import Cluster
from shardserve.client.embedding.ids import POOLINGS, as_device_ids
from shardserve.client.errors import InvalidArgumentError


class RemoteEmbedding(nn.Module):
    """nn.Embedding over a 2-D table served by the cluster: forward(ids) -> ids.shape + (dim,)."""

    def __init__(self, cluster: Cluster, name: str, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cluster = _checked_cluster(cluster)
        self.name = tensor_name(name)
        self.dtype = dtype
        view = cluster.lookups.views.view(name)
        self.num_embeddings, self.embedding_dim = view.summary.metadata.size

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a tensor of ids, got {type(input).__name__}")
        ids = as_device_ids(
            input.reshape(-1), "input"
        )  # errors name the module's argument, not the table's request
        rows = self.cluster.lookups.lookup_on(self.name, ids, self.dtype)
        return rows.view(*input.shape, rows.shape[1]).to(input.device)

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.num_embeddings}, {self.embedding_dim}"


class RemoteEmbeddingBag(nn.Module):
    """nn.EmbeddingBag (include_last_offset=False) over a 2-D table served by the cluster."""

    def __init__(
        self,
        cluster: Cluster,
        name: str,
        mode: str = "mean",
        dtype: torch.dtype | None = None,
        pooling: str = "auto",
    ) -> None:
        super().__init__()
        if mode not in ("sum", "mean"):
            raise InvalidArgumentError(f"mode must be 'sum' or 'mean', got {mode!r}")
        if pooling not in POOLINGS:
            raise InvalidArgumentError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.cluster = _checked_cluster(cluster)
        self.name = tensor_name(name)
        self.mode = mode
        self.dtype = dtype
        self.pooling = pooling
        view = cluster.lookups.views.view(name)
        self.num_embeddings, self.embedding_dim = view.summary.metadata.size

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a tensor of ids, got {type(input).__name__}")
        if input.dim() == 2:
            if offsets is not None:
                raise InvalidArgumentError("offsets has to be None if input is 2-D")
            if per_sample_weights is not None:
                if (
                    not isinstance(per_sample_weights, torch.Tensor)
                    or per_sample_weights.shape != input.shape
                ):
                    raise InvalidArgumentError(
                        f"per_sample_weights must have the shape of input "
                        f"{tuple(input.shape)}, as nn.EmbeddingBag wants"
                    )
                per_sample_weights = per_sample_weights.reshape(-1)
            bags, length = input.shape
            offsets = torch.arange(bags, dtype=torch.int64, device=input.device) * length
            input = input.reshape(-1)
        elif input.dim() == 1:
            if offsets is None:
                raise InvalidArgumentError("offsets has to be a 1-D tensor when input is 1-D")
        else:
            raise InvalidArgumentError(
                f"input has to be 1-D or 2-D, got shape {tuple(input.shape)}"
            )
        pooled = self.cluster.lookups.lookup_bag_on(
            self.name,
            input,
            offsets,
            self.mode,
            per_sample_weights,
            dtype=self.dtype,
            pooling=self.pooling,
        )
        return pooled.to(input.device)

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"


def _checked_cluster(cluster: Any) -> Cluster:
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"cluster must be a client.Cluster (from connect()), got {type(cluster).__name__}"
        )
    return cluster
