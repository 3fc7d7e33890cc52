"""RemoteEmbeddingBagCollection: TorchRec's EmbeddingBagCollection over tables served by the cluster.

forward(KeyedJaggedTensor) -> KeyedTensor gives what EmbeddingBagCollection
gives for the same weights (keys, feature@table names for features shared by
tables, float32 values). Every table's bags of a batch go into one
multi-table pooled lookup (Lookups.lookup_bags): one Lookup call per rank per
forward, with the ranks' routing, dedup, row cache and bag pooling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from shardserve.client.cluster import Cluster
from shardserve.client.embedding.ids import POOLINGS, BagRequest
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.torchrec.features import FeatureBatch, per_feature
from shardserve.client.torchrec.tables import (
    DTYPES,
    bind_tables,
    snapshot_names,
    table_name,
    upload_tables,
)

MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


class RemoteEmbeddingBagCollection(nn.Module):
    """EmbeddingBagCollection whose tables live on the cluster: forward(KJT) -> KeyedTensor, no parameters.

    Table config T is served by the tensor PREFIX/T (T without a prefix), or by `names[T]` when given."""

    def __init__(
        self,
        cluster: Cluster,
        tables: Sequence[EmbeddingBagConfig],
        prefix: str = "",
        *,
        is_weighted: bool = False,
        names: Mapping[str, str] | None = None,
        pooling: str = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be a shardserve Cluster, got {type(cluster).__name__}")
        if pooling not in POOLINGS:
            raise InvalidArgumentError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        tables = list(tables)
        for config in tables:
            if not isinstance(config, EmbeddingBagConfig):
                raise TypeError(
                    f"tables must hold EmbeddingBagConfigs, got {type(config).__name__}"
                )
            if config.pooling not in MODES:
                raise InvalidArgumentError(
                    f"table {config.name!r} has pooling {config.pooling.name}; served: SUM and MEAN"
                )
        names = dict(names or {})
        for config in tables:
            names.setdefault(config.name, table_name(prefix, config.name))
        self.cluster = cluster
        self.tables = bind_tables(cluster, tables, names)
        self.is_weighted = bool(is_weighted)
        self.pooling = pooling
        self.embedding_names = [
            name for group in get_embedding_names_by_table(tables) for name in group
        ]
        self.length_per_key = [t.config.embedding_dim for t in self.tables for _ in t.features]

    @classmethod
    def from_module(
        cls,
        cluster: Cluster,
        ebc: EmbeddingBagCollection,
        prefix: str,
        spec: Any = None,
        replicas: int = 1,
        *,
        upload: bool = True,
        oov: str = "error",
        overwrite: bool = False,
        pooling: str = "auto",
    ) -> RemoteEmbeddingBagCollection:
        """Put `ebc`'s tables as PREFIX/TABLE (`spec`: one for all or {table: spec}) and serve them; with
        upload=False only its configs are used, for tables already on the cluster."""
        if not isinstance(ebc, EmbeddingBagCollection):
            raise TypeError(f"ebc must be an EmbeddingBagCollection, got {type(ebc).__name__}")
        configs = ebc.embedding_bag_configs()
        if upload:
            weights = {c.name: ebc.embedding_bags[c.name].weight for c in configs}
            upload_tables(
                cluster,
                weights,
                prefix,
                spec=spec,
                replicas=replicas,
                oov=oov,
                overwrite=overwrite,
            )
        return cls(cluster, configs, prefix, is_weighted=ebc.is_weighted(), pooling=pooling)

    @classmethod
    def from_snapshot(
        cls,
        cluster: Cluster,
        prefix: str,
        configs: Sequence[EmbeddingBagConfig],
        *,
        is_weighted: bool = False,
        module: str | None = None,
        number: int | None = None,
        pooling: str = "auto",
    ) -> RemoteEmbeddingBagCollection:
        """Serve the tables of snapshot `number` (None: the newest) that `spmd.put_state_dict` put under
        `prefix`: table T is the entry MODULE.embedding_bags.T.weight (without `module`: the one such key)."""
        names = snapshot_names(
            cluster,
            prefix,
            [c.name for c in configs],
            attribute="embedding_bags",
            module=module,
            number=number,
        )
        return cls(cluster, configs, is_weighted=is_weighted, names=names, pooling=pooling)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        batch = FeatureBatch(features, weighted=self.is_weighted)
        requests: dict[str, BagRequest] = {}
        for table in self.tables:
            ids = batch.table(table.features)
            weights = (
                None if ids.weights is None else ids.weights.to(DTYPES[table.config.data_type])
            )
            requests[table.name] = BagRequest(
                ids.ids, ids.offsets, MODES[table.config.pooling], weights
            )
        pooled = self.cluster.lookups.lookup_bags(requests, pooling=self.pooling)
        stride = batch.stride
        columns = [
            bags
            for table in self.tables
            for bags in per_feature(pooled[table.name], len(table.features), stride)
        ]
        values = torch.cat(columns, dim=1) if columns else torch.empty((stride, 0))
        return KeyedTensor(
            keys=self.embedding_names,
            length_per_key=self.length_per_key,
            values=values.float().to(features.device()),
        )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs served, as EmbeddingBagCollection.embedding_bag_configs gives them."""
        return [table.config for table in self.tables]

    def extra_repr(self) -> str:
        served = ", ".join(f"{t.config.name}->{t.name!r}" for t in self.tables)
        return f"{served}, is_weighted={self.is_weighted}"
