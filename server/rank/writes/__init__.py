"""Writes of whole shards in batches (WriteShards): one call per rank for many shards, their bytes inline,
from a same-host writer's memfd, or following the request on the bulk port."""
