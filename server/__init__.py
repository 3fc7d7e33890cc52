"""shardserve servers: the per-rank ShardServer, the Coordinator, the catalog and the launcher."""
