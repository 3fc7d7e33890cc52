"""RemoteEmbeddingCollection: TorchRec's EmbeddingCollection (unpooled) over tables served by the cluster.

forward(KeyedJaggedTensor) -> {embedding name: JaggedTensor of the rows of
its ids, the feature's lengths}, as EmbeddingCollection gives it. Every
table's ids of a batch go into one multi-table row lookup (Lookups.lookup):
one Lookup call per rank per forward, deduplicated, through the row cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from shardserve.client.cluster import Cluster
from shardserve.client.torchrec.features import FeatureBatch
from shardserve.client.torchrec.tables import (
    bind_tables,
    snapshot_names,
    table_name,
    upload_tables,
)


class RemoteEmbeddingCollection(nn.Module):
    """EmbeddingCollection whose tables live on the cluster: forward(KJT) -> {name: JaggedTensor}.

    Table config T is served by the tensor PREFIX/T (T without a prefix), or by `names[T]` when given."""

    def __init__(
        self,
        cluster: Cluster,
        tables: Sequence[EmbeddingConfig],
        prefix: str = "",
        *,
        need_indices: bool = False,
        names: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be a shardserve Cluster, got {type(cluster).__name__}")
        tables = list(tables)
        for config in tables:
            if not isinstance(config, EmbeddingConfig):
                raise TypeError(f"tables must hold EmbeddingConfigs, got {type(config).__name__}")
        names = dict(names or {})
        for config in tables:
            names.setdefault(config.name, table_name(prefix, config.name))
        self.cluster = cluster
        self.tables = bind_tables(cluster, tables, names)
        self.need_indices = bool(need_indices)
        self.embedding_names_by_table = get_embedding_names_by_table(tables)

    @classmethod
    def from_module(
        cls,
        cluster: Cluster,
        ec: EmbeddingCollection,
        prefix: str,
        spec: Any = None,
        replicas: int = 1,
        *,
        upload: bool = True,
        oov: str = "error",
        overwrite: bool = False,
    ) -> RemoteEmbeddingCollection:
        """Put `ec`'s tables as PREFIX/TABLE (`spec`: one for all or {table: spec}) and serve them; with
        upload=False only its configs are used, for tables already on the cluster."""
        if not isinstance(ec, EmbeddingCollection):
            raise TypeError(f"ec must be an EmbeddingCollection, got {type(ec).__name__}")
        configs = ec.embedding_configs()
        if upload:
            weights = {c.name: ec.embeddings[c.name].weight for c in configs}
            upload_tables(
                cluster,
                weights,
                prefix,
                spec=spec,
                replicas=replicas,
                oov=oov,
                overwrite=overwrite,
            )
        return cls(cluster, configs, prefix, need_indices=ec.need_indices())

    @classmethod
    def from_snapshot(
        cls,
        cluster: Cluster,
        prefix: str,
        configs: Sequence[EmbeddingConfig],
        *,
        need_indices: bool = False,
        module: str | None = None,
        number: int | None = None,
    ) -> RemoteEmbeddingCollection:
        """Serve the tables of snapshot `number` (None: the newest) that `spmd.put_state_dict` put under
        `prefix`: table T is the entry MODULE.embeddings.T.weight (without `module`: the one such key)."""
        names = snapshot_names(
            cluster,
            prefix,
            [c.name for c in configs],
            attribute="embeddings",
            module=module,
            number=number,
        )
        return cls(cluster, configs, need_indices=need_indices, names=names)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        batch = FeatureBatch(features, weighted=False)
        asked = {table.name: batch.table(table.features) for table in self.tables}
        rows = self.cluster.lookups.lookup({name: ids.ids for name, ids in asked.items()})
        out: dict[str, JaggedTensor] = {}
        for table, names in zip(self.tables, self.embedding_names_by_table):
            ids = asked[table.name]
            lengths = [batch.lengths(position) for position in ids.positions]
            counts = [batch.bounds[p + 1] - batch.bounds[p] for p in ids.positions]
            pieces = torch.split(rows[table.name].float(), counts)
            values = torch.split(ids.ids.to(features.values().dtype), counts)  # the KJT's own dtype
            for name, length, piece, feature_ids in zip(names, lengths, pieces, values):
                out[name] = JaggedTensor(
                    values=piece.to(features.device()),
                    lengths=length,
                    weights=feature_ids if self.need_indices else None,
                )
        return out

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The table configs served, as EmbeddingCollection.embedding_configs gives them."""
        return [table.config for table in self.tables]

    def extra_repr(self) -> str:
        return ", ".join(f"{t.config.name}->{t.name!r}" for t in self.tables)
